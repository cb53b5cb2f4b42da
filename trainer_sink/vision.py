"""Images in the sink's batches: what verl's multimodal path reads, for samples with images.

A trajectory names its images (``TrajectoryReady.images``: digest, placeholder run in its ids,
patch grid, fold v8); their bytes are in the log's image store. The sink fetches them through an
``ImageBytes`` port (live: the log's store, ``eventlog.JetStreamImageStore``; offline: the same
store, or an ``ImageDirectory`` of files named by digest), and ``add_images`` (pure: bytes in,
tensors out) puts into a padded batch, as verl 0.9.1's agent loop builds them
(``verl/experimental/agent_loop/agent_loop.py``, ``_compute_multi_modal_inputs`` and
``_compute_position_ids``):

    multi_modal_inputs  per sample, a dict of tensors: ``pixel_values`` (patches, C*T*P*P)
                        float32, ``image_grid_thw`` (images, 3) int64 and ``images_seqlens``
                        (``repeat_interleave(h * w, t)``, what verl's trainer counts), from the
                        model's image processor (``schemas.pixels``, the reading the gateway's
                        local backend does); {} for a sample without images
    position_ids        [B, 4, P+R] int64: row 0 the text positions (verl's: 0, 1, ... on the
                        real tokens, 1 on padding), rows 1-3 the M-RoPE (t, h, w) positions of
                        the model's ``get_rope_index`` on the padded row and its attention mask

A batch without images is left as it is (``position_ids`` [B, P+R]). A prompt cut by
``max_prompt_len`` keeps only whole images: a cut through one is a ``BatchError``.
"""

from __future__ import annotations

import asyncio
import types
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from schemas.events import TrajectoryReady
from schemas.images import ImageRef, content_digest
from schemas.pixels import (
    PROCESSOR_BACKEND,
    ImageProcessor,
    check_placeholders,
    image_inputs,
)
from trainer_sink.errors import BatchError

__all__ = ["ImageBytes", "ImageDirectory", "SinkVision", "VisionModel", "add_images"]


class ImageBytes(Protocol):
    """Image bytes by digest: the log's image store (``eventlog.ImageStore``) is one."""

    async def get(self, digest: str) -> bytes:
        """The bytes named ``digest``; raises when they are missing or not what it names."""
        ...


class ImageDirectory:
    """``ImageBytes`` from files named by their digest in ``root`` (an export of the store),
    each checked against its name."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)

    async def get(self, digest: str) -> bytes:
        path = self.root / digest
        try:
            data = await asyncio.to_thread(path.read_bytes)
        except OSError as exc:
            raise BatchError(f"image sha256:{digest}: cannot read {path}: {exc}") from exc
        if content_digest(data) != digest:
            raise BatchError(f"image sha256:{digest}: {path} holds other bytes")
        return data


@dataclass(frozen=True)
class VisionModel:
    """What of a vision-language model the batches need: its image processor, its image
    token, and its M-RoPE position function (``get_rope_index``, bound to its config the way
    verl's ``hf_processor`` binds it: no weights are loaded)."""

    processor: ImageProcessor
    image_token_id: int
    rope: Any  # a namespace with the model class's get_rope_index bound to it

    @classmethod
    def load(cls, model_dir: Path | str) -> VisionModel:
        """The model directory's processor (``preprocessor_config.json``) and config. Raises
        ValueError for a model without M-RoPE (``get_rope_index``: Qwen2-VL and its kin)."""
        from transformers import MODEL_MAPPING, AutoConfig, AutoImageProcessor

        config = AutoConfig.from_pretrained(model_dir)
        token = getattr(config, "image_token_id", None)
        model_class = MODEL_MAPPING.get(type(config), None)
        get_rope_index = getattr(model_class, "get_rope_index", None)
        if not isinstance(token, int) or get_rope_index is None:
            raise ValueError(
                f"{model_dir}: not a vision-language model with M-RoPE positions (its config "
                f"names no image_token_id, or {type(config).__name__}'s model has no "
                f"get_rope_index); the sink builds multi_modal_inputs for Qwen2-VL and its kin"
            )
        rope = types.SimpleNamespace(config=config)
        rope.get_rope_index = types.MethodType(get_rope_index, rope)
        vision_positions = getattr(model_class, "get_vision_position_ids", None)
        if vision_positions is not None:  # get_rope_index calls it on its self
            rope.get_vision_position_ids = types.MethodType(vision_positions, rope)
        processor: ImageProcessor = AutoImageProcessor.from_pretrained(  # type: ignore[no-untyped-call]
            model_dir, backend=PROCESSOR_BACKEND
        )
        return cls(processor, token, rope)

    def positions(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, grid: torch.Tensor | None
    ) -> torch.Tensor:
        """The (4, L) positions of one padded row (``input_ids`` and ``attention_mask``
        (1, L)), as verl's ``AgentLoopWorker._compute_position_ids`` makes them."""
        token_types = (input_ids == self.image_token_id).long()
        with torch.inference_mode():
            vision, _ = self.rope.get_rope_index(
                input_ids=input_ids,
                attention_mask=attention_mask,
                image_grid_thw=grid,
                mm_token_type_ids=token_types,
            )
        valid = attention_mask[0].bool()
        text = torch.ones(input_ids.shape[1], dtype=torch.long)
        text[valid] = torch.arange(int(valid.sum()))
        return torch.cat((text.view(1, -1), vision[:, 0, :].to(torch.long)), dim=0)


@dataclass(frozen=True)
class SinkVision:
    """What a sink needs for batches with images: the model's side and the bytes' port."""

    model: VisionModel
    images: ImageBytes

    async def fetch(self, trajectories: Iterable[TrajectoryReady]) -> dict[str, bytes]:
        """The bytes of every image the trajectories name, each read once."""
        digests = sorted({ref.sha256 for t in trajectories for ref in t.images})
        found = await asyncio.gather(*(self.images.get(d) for d in digests))
        return dict(zip(digests, found, strict=True))

    async def add(self, batch: TensorDict, trajectories: Sequence[TrajectoryReady]) -> TensorDict:
        """``add_images`` with the bytes fetched; off the event loop (decoding, resizing)."""
        if not any(t.images for t in trajectories):
            return batch
        data = await self.fetch(trajectories)
        return await asyncio.to_thread(add_images, batch, trajectories, data, self.model)


def add_images(
    batch: TensorDict,
    trajectories: Sequence[TrajectoryReady],
    images: Mapping[str, bytes],
    model: VisionModel,
) -> TensorDict:
    """``batch`` (padded, assembled from ``trajectories``) with ``multi_modal_inputs`` and 3-D
    ``position_ids`` (see the module docstring); unchanged when no trajectory has images.
    Raises BatchError for a jagged batch with images, a prompt cut through an image, or
    placeholders that are not what the processor expands the image to."""
    if not any(t.images for t in trajectories):
        return batch
    input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]
    if input_ids.is_nested:
        raise BatchError(
            "samples with images need the padded layout (AssemblySettings(layout='padded')): "
            "their M-RoPE positions are built on verl's padded rows"
        )
    width_p = batch["prompts"].shape[1]
    inputs: list[dict[str, torch.Tensor]] = []
    rows: list[torch.Tensor] = []
    for i, t in enumerate(trajectories):
        ids, mask = input_ids[i : i + 1], attention_mask[i : i + 1]
        # Token j of the sample sits in column j - prompt_len + P (prompts are left-padded).
        shift = width_p - t.prompt_len
        kept = _kept_images(t, shift, int(mask[0, :width_p].sum()), int(mask[0, width_p:].sum()))
        sample_inputs, grid = _sample_inputs(t, kept, shift, ids, images, model)
        inputs.append(sample_inputs)
        rows.append(model.positions(ids, mask, grid))
    batch["position_ids"] = torch.stack(rows)
    batch["multi_modal_inputs"] = NonTensorStack(*(NonTensorData(x) for x in inputs))
    return batch


def _kept_images(
    t: TrajectoryReady, shift: int, prompt_kept: int, response_kept: int
) -> list[ImageRef]:
    """The sample's images inside its kept tokens; BatchError for one the cut goes through."""
    first, end = t.prompt_len - prompt_kept, t.prompt_len + response_kept
    kept = []
    for ref in t.images:
        if first <= ref.offset and ref.end <= end:
            kept.append(ref)
        elif ref.offset < end and ref.end > first:
            raise BatchError(
                f"trajectory {t.trajectory_id}: image {ref.sha256[:12]} at tokens "
                f"{ref.offset}..{ref.end} is cut by max_prompt_len/max_response_len (tokens "
                f"{first}..{end} kept); raise the limits so that images are kept whole"
            )
    return kept


def _sample_inputs(
    t: TrajectoryReady,
    kept: list[ImageRef],
    shift: int,
    ids: torch.Tensor,
    images: Mapping[str, bytes],
    model: VisionModel,
) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """One sample's ``multi_modal_inputs`` and its image grid (None: no images kept)."""
    if not kept:
        return {}, None
    try:
        pixels = image_inputs(model.processor, [images[ref.sha256] for ref in kept])
        spans = [(ref.offset + shift, ref.length) for ref in kept]
        check_placeholders(
            ids[0].numpy(), spans, pixels.placeholders, image_token_id=model.image_token_id
        )
    except (KeyError, ValueError) as exc:
        raise BatchError(
            f"trajectory {t.trajectory_id}: its images cannot be read as the model reads "
            f"them: {type(exc).__name__}: {exc}"
        ) from exc
    grid = torch.from_numpy(np.ascontiguousarray(pixels.grid_thw, dtype=np.int64))
    return {
        "pixel_values": torch.from_numpy(np.ascontiguousarray(pixels.pixel_values)),
        "image_grid_thw": grid,
        "images_seqlens": torch.repeat_interleave(grid[:, 1] * grid[:, 2], grid[:, 0]),
    }, grid
