"""Batches with images (``trainer_sink.vision``), from a real image session of the tiny
vision-language model (sampled by the local backend, its own pixel path): what verl's multimodal
path reads, and the reference trainer's log-probs over the image turns equal to the recorded
ones (fp32, <= 1e-4)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from pathlib import Path

import msgspec
import pyarrow.parquet as pq
import pytest
import torch

from consumers import fold
from eventlog import ImageMissing
from gateway.model.tiny_vl import ensure_tiny_vl_model
from schemas.events import TrajectoryReady
from schemas.shards import trajectories_to_table
from tests.helpers.sessions import append_only, session_events
from tests.helpers.vision_turns import VisionSession, vision_session
from trainer_sink import (
    AssemblySettings,
    BatchError,
    BatchingSettings,
    ImageDirectory,
    ImagesSpec,
    OfflineSpec,
    Received,
    SinkSpec,
    SinkVision,
    TrainerSink,
    VisionModel,
    add_images,
    assemble,
    non_tensor_values,
)
from turnstream.trainer.objective import response_log_probs
from turnstream.trainer.reference import ReferenceTrainer, ReferenceTrainerSettings


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_vl_model(tmp_path_factory.mktemp("tiny-vl"))


@pytest.fixture(scope="module")
def seen(vl_dir: Path) -> VisionSession:
    return asyncio.run(vision_session(vl_dir, temperature=0.8, top_p=0.9, max_tokens=16))


@pytest.fixture(scope="module")
def vision(vl_dir: Path) -> VisionModel:
    return VisionModel.load(vl_dir)


def samples(seen: VisionSession) -> list[TrajectoryReady]:
    """The image session, and a text-only one beside it."""
    [with_images] = fold(seen.events).trajectories
    [text_only] = fold(session_events(append_only(2), session="plain")).trajectories
    return [with_images, text_only]


def test_a_batch_carries_verls_multimodal_inputs_and_mrope_positions(
    seen: VisionSession, vision: VisionModel
) -> None:
    trajectories = samples(seen)
    batch = add_images(assemble(trajectories), trajectories, seen.images, vision)
    width = batch["input_ids"].shape[1]
    assert batch["position_ids"].shape == (2, 4, width)
    [with_images, text_only] = non_tensor_values(batch, "multi_modal_inputs")
    assert text_only == {}
    assert sorted(with_images) == ["image_grid_thw", "images_seqlens", "pixel_values"]
    assert with_images["image_grid_thw"].tolist() == [[1, 4, 8], [1, 6, 4]]
    assert with_images["images_seqlens"].tolist() == [32, 24]  # h * w per image, t times
    assert with_images["pixel_values"].shape == (32 + 24, 1176)
    assert with_images["pixel_values"].dtype == torch.float32

    positions, mask = batch["position_ids"][0], batch["attention_mask"][0].bool()
    assert positions[0, mask].tolist() == list(range(int(mask.sum())))  # verl's text row
    image = trajectories[0].images[0]
    column = image.offset - trajectories[0].prompt_len + batch["prompts"].shape[1]
    run = positions[1:, column : column + image.length]
    start = int(positions[1, column - 1]) + 1
    assert run[0].tolist() == [start] * 8  # t: one frame
    assert run[1].tolist() == [start] * 4 + [start + 1] * 4  # h: 2 rows of merged patches
    assert run[2].tolist() == [start + i for i in range(4)] * 2  # w: 4 columns
    # The text-only row: its three M-RoPE rows are its text positions.
    text_row = batch["position_ids"][1]
    real = batch["attention_mask"][1].bool()
    assert (text_row[1:, real] == text_row[0, real]).all()


def test_a_text_only_batch_is_unchanged(seen: VisionSession, vision: VisionModel) -> None:
    [_, text_only] = samples(seen)
    batch = assemble([text_only])
    assert add_images(batch.clone(), [text_only], {}, vision)["position_ids"].shape == (
        batch["position_ids"].shape
    )


def test_a_prompt_cut_through_an_image_is_refused_and_one_cut_off_is_left_out(
    seen: VisionSession, vision: VisionModel
) -> None:
    [t, _] = samples(seen)
    first = t.images[0]
    through = AssemblySettings(max_prompt_len=t.prompt_len - first.offset - 2)
    with pytest.raises(BatchError, match=f"image {first.sha256[:12]} at tokens .* is cut"):
        add_images(assemble([t], through), [t], seen.images, vision)
    before = AssemblySettings(max_prompt_len=t.prompt_len - first.end)
    batch = add_images(assemble([t], before), [t], seen.images, vision)
    [kept] = non_tensor_values(batch, "multi_modal_inputs")
    assert kept["image_grid_thw"].tolist() == [[1, 6, 4]]  # the second image, in the response


def test_a_jagged_batch_with_images_is_refused(seen: VisionSession, vision: VisionModel) -> None:
    trajectories = samples(seen)
    with pytest.raises(BatchError, match="padded layout"):
        add_images(
            assemble(trajectories, AssemblySettings(layout="jagged")),
            trajectories,
            seen.images,
            vision,
        )


def test_placeholders_that_do_not_fit_their_image_are_refused(
    seen: VisionSession, vision: VisionModel
) -> None:
    [t, _] = samples(seen)
    [a, b] = t.images
    swapped = {a.sha256: seen.images[b.sha256], b.sha256: seen.images[a.sha256]}
    with pytest.raises(BatchError, match=r"8 placeholder tokens at offset .* expands this image"):
        add_images(assemble([t]), [t], swapped, vision)


class _Lacking:
    async def get(self, digest: str) -> bytes:
        raise ImageMissing(digest, "ts_images")


class _Listed:
    """A finite source of the given trajectories."""

    max_unacked = None
    unacked = 0

    def __init__(self, trajectories: Sequence[TrajectoryReady]) -> None:
        self._items: list[Received] | None = [Received(t) for t in trajectories]

    async def receive(self, max_items: int, wait_s: float) -> list[Received] | None:
        items, self._items = self._items, None
        return items

    async def ack(self, items: Sequence[Received]) -> None: ...

    async def nak(self, items: Sequence[Received]) -> None:
        self.handed_back = [item.trajectory.trajectory_id for item in items]

    async def close(self) -> None: ...


async def test_the_sink_reads_the_images_from_its_port_or_refuses_without_one(
    seen: VisionSession, vision: VisionModel, tmp_path: Path
) -> None:
    for digest, data in seen.images.items():
        (tmp_path / digest).write_bytes(data)
    trajectories = samples(seen)
    batching = BatchingSettings(policy="count", batch_size=2)
    sink = TrainerSink(
        _Listed(trajectories), batching, vision=SinkVision(vision, ImageDirectory(tmp_path))
    )
    [batch] = [b async for b in sink]
    assert batch.tensors["position_ids"].dim() == 3
    blind = TrainerSink(_Listed(trajectories), batching)
    with pytest.raises(BatchError, match="no vision="):
        [b async for b in blind]
    # A store that lacks an image: the error is the store's, the samples are handed back.
    lacking = _Listed(trajectories)
    missing = TrainerSink(lacking, batching, vision=SinkVision(vision, _Lacking()))
    with pytest.raises(ImageMissing):
        [b async for b in missing]
    assert lacking.handed_back == [t.trajectory_id for t in trajectories]
    (tmp_path / trajectories[0].images[0].sha256).write_bytes(b"other bytes")
    altered = TrainerSink(
        _Listed(trajectories), batching, vision=SinkVision(vision, ImageDirectory(tmp_path))
    )
    with pytest.raises(BatchError, match="holds other bytes"):
        [b async for b in altered]


def test_the_reference_trainers_log_probs_over_image_turns_are_the_recorded_ones(
    seen: VisionSession, vision: VisionModel, vl_dir: Path, tmp_path: Path
) -> None:
    """Two image turns sampled at temperature 0.8, top-p 0.9 by the local backend: the trainer's
    one padded forward pass (pixels from the batch, M-RoPE positions from the batch) gives every
    generated token the log-prob the backend recorded, in fp32 within 1e-4."""
    trajectories = samples(seen)  # the image session first, a text-only one beside it
    batch = add_images(assemble(trajectories), trajectories, seen.images, vision)
    trainer = ReferenceTrainer(
        ReferenceTrainerSettings(model_dir=vl_dir, checkpoint_dir=tmp_path, run="r")
    )
    with torch.no_grad():
        recomputed = response_log_probs(trainer.model, batch)[0]
    generated = batch["response_mask"][0].bool()
    assert int(generated.sum()) == 32  # both image turns' completions
    delta = (recomputed - batch["rollout_log_probs"][0]).abs()[generated]
    assert delta.max().item() <= 1e-4
    # Without its pixels the model reads other log-probs: the check above is not vacuous.
    plain = assemble([msgspec.structs.replace(trajectories[0], images=[])])
    with torch.no_grad():
        without = response_log_probs(trainer.model, plain)[0]
    blind = plain["response_mask"][0].bool()
    assert (without - plain["rollout_log_probs"][0]).abs()[blind].max() > 1e-3
    # And train_step itself reports the agreement (the text-only sample's log-probs are made
    # up by the test helper: it is left out).
    alone = add_images(assemble(trajectories[:1]), trajectories[:1], seen.images, vision)
    report = trainer.train_step(alone)
    assert report.agreement_samples == 1 and report.logprob_delta is not None
    assert report.logprob_delta <= 1e-4


async def test_an_offline_sink_spec_reads_image_rows_from_shards_and_bytes_from_a_directory(
    seen: VisionSession, vl_dir: Path, tmp_path: Path
) -> None:
    """Shards (the images column) -> OfflineSource -> the sink, as a Ray actor's spec builds it;
    an offline spec without a directory has no store to read from and says so."""
    images = tmp_path / "images"
    images.mkdir()
    for digest, data in seen.images.items():
        (images / digest).write_bytes(data)
    shards = tmp_path / "shards"
    (shards / "run=r").mkdir(parents=True)
    table = trajectories_to_table(list(enumerate(samples(seen), start=1)))
    pq.write_table(table, shards / "run=r" / "part-1.parquet")
    spec = SinkSpec(
        OfflineSpec(str(shards)),
        BatchingSettings(policy="count", batch_size=2),
        images=ImagesSpec(str(vl_dir), directory=str(images)),
    )
    sink = await spec.open()
    [batch] = [b async for b in sink]
    inputs = non_tensor_values(batch.tensors, "multi_modal_inputs")
    assert [sorted(x) for x in inputs] == [["image_grid_thw", "images_seqlens", "pixel_values"], []]
    assert batch.tensors["position_ids"].dim() == 3
    blind = dataclasses.replace(spec, images=ImagesSpec(str(vl_dir)))
    with pytest.raises(ValueError, match="give an offline sink ImagesSpec"):
        await blind.open()
