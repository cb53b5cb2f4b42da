"""A sink batch with images in verl's own multimodal code (verl 0.9.1, tensordict 0.10).

The batch is a real image session of the tiny vision-language model (sampled by the local
backend), assembled by the sink with its images (``trainer_sink.vision``). verl's
``extract_multi_modal_inputs`` (what its FSDP engine joins a micro-batch's images with) reads its
``multi_modal_inputs``; verl's ``AgentLoopWorker._compute_position_ids`` (with a stand-in
processor, bound as ``verl.utils.tokenizer.hf_processor`` binds the model's ``get_rope_index``)
makes the same M-RoPE positions the sink made; and the model, given the batch as verl's engine
gives it (input ids, the 3-D positions, the joined images), gives the recorded log-probs.
"""

from __future__ import annotations

import asyncio
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel
from verl import DataProto
from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
from verl.utils.model import extract_multi_modal_inputs

from consumers import fold
from gateway.model.tiny_vl import ensure_tiny_vl_model
from schemas.events import TrajectoryReady
from tests.helpers.sessions import append_only, session_events
from tests.helpers.vision_turns import VisionSession, vision_session
from trainer_sink import VisionModel, add_images, assemble, to_dataproto


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_vl_model(tmp_path_factory.mktemp("tiny-vl"))


@pytest.fixture(scope="module")
def seen(vl_dir: Path) -> VisionSession:
    return asyncio.run(vision_session(vl_dir, temperature=1.0, max_tokens=10))


@pytest.fixture(scope="module")
def batch(seen: VisionSession, vl_dir: Path) -> tuple[DataProto, list[TrajectoryReady]]:
    [with_images] = fold(seen.events).trajectories
    [text_only] = fold(session_events(append_only(1), session="plain")).trajectories
    trajectories = [with_images, text_only]
    tensors = add_images(
        assemble(trajectories), trajectories, seen.images, VisionModel.load(vl_dir)
    )
    return to_dataproto(tensors), trajectories


def stand_in_processor(vl_dir: Path) -> Any:
    """What verl's hf_processor makes of a Qwen2-VL processor for positions: the model's
    get_rope_index (and the get_vision_position_ids it calls) bound to it, and its config."""
    config = AutoConfig.from_pretrained(vl_dir)
    processor = types.SimpleNamespace(
        config=config,
        image_token_id=config.image_token_id,
        video_token_id=config.video_token_id,
        tokenizer=AutoTokenizer.from_pretrained(vl_dir),
    )
    processor.get_rope_index = types.MethodType(Qwen2VLModel.get_rope_index, processor)
    processor.get_vision_position_ids = types.MethodType(
        Qwen2VLModel.get_vision_position_ids, processor
    )
    return processor


def test_multi_modal_inputs_are_an_object_array_of_dicts_verl_joins(
    batch: tuple[DataProto, list[TrajectoryReady]],
) -> None:
    data, _ = batch
    inputs = data.non_tensor_batch["multi_modal_inputs"]
    assert isinstance(inputs, np.ndarray) and inputs.dtype == object and inputs.shape == (2,)
    assert isinstance(inputs[0], dict) and inputs[1] == {}
    joined = extract_multi_modal_inputs(inputs)
    assert joined["image_grid_thw"].tolist() == [[1, 4, 8], [1, 6, 4]]
    assert joined["pixel_values"].shape == (56, 1176)
    assert joined["images_seqlens"].tolist() == [32, 24]
    # verl's trainer counts image tokens from images_seqlens of each dict with a grid
    # (trainer/ppo/ray_trainer.py): every dict that has one has the other.
    assert all(("image_grid_thw" in x) == ("images_seqlens" in x) for x in inputs)
    assert data.batch["position_ids"].shape == (2, 4, data.batch["input_ids"].shape[1])


def test_verls_own_positions_are_the_sinks(
    batch: tuple[DataProto, list[TrajectoryReady]], vl_dir: Path
) -> None:
    data, _ = batch
    worker = types.SimpleNamespace(processor=stand_in_processor(vl_dir))
    pad = worker.processor.image_token_id
    for i in range(2):
        ids = data.batch["input_ids"][i : i + 1]
        mask = data.batch["attention_mask"][i : i + 1]
        # verl's agent loop gets mm_token_type_ids from the processor and rebuilds it from the
        # ids; the sink leaves it out (the model needs no types once given positions).
        inputs = {**data.non_tensor_batch["multi_modal_inputs"][i], "mm_token_type_ids": ids == pad}
        positions = AgentLoopWorker._compute_position_ids(worker, ids, mask, inputs)
        assert torch.equal(positions[0], data.batch["position_ids"][i])


def test_the_model_given_the_batch_as_verls_engine_gives_it_reads_the_recorded_log_probs(
    batch: tuple[DataProto, list[TrajectoryReady]], vl_dir: Path
) -> None:
    """verl's engine: ``model_inputs.update(extract_multi_modal_inputs(...))`` beside the ids and
    3-D positions (taken [4, B, L]). The image sample's generated tokens get their recorded
    log-probs (temperature 1: the raw softmax)."""
    data, _ = batch
    model = AutoModelForImageTextToText.from_pretrained(vl_dir, dtype=torch.float32).eval()
    joined = extract_multi_modal_inputs(data.non_tensor_batch["multi_modal_inputs"])
    with torch.no_grad():
        logits = model(
            input_ids=data.batch["input_ids"],
            attention_mask=data.batch["attention_mask"],
            position_ids=data.batch["position_ids"].transpose(0, 1),
            **joined,
        ).logits
    width = data.batch["prompts"].shape[1]
    log_probs = torch.log_softmax(logits[:, width - 1 : -1].float(), dim=-1)
    taken = log_probs.gather(-1, data.batch["responses"].unsqueeze(-1)).squeeze(-1)
    generated = data.batch["response_mask"][0].bool()
    delta = (taken[0] - data.batch["rollout_log_probs"][0]).abs()[generated]
    assert int(generated.sum()) == 20 and delta.max().item() <= 1e-4
