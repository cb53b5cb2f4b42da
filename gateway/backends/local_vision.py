"""The local backend's images: a vision-language model's inputs for a prompt with images.

A prompt's ids come with their image placeholders already expanded (``Prompt.images``: each
image's run of image tokens and its bytes). The image processor turns the bytes into
``pixel_values`` (``schemas.pixels``, the one reading the trainer shares), the counts are checked
against the runs, and the M-RoPE positions (Qwen2-VL: an image's tokens take (t, h, w) positions
of its patch grid, the text after it continues from the largest) are computed once, here.

Every forward pass of a generation with images is given its positions explicitly. The model
could work them out itself, but it keeps the offset between positions and token indices
(``rope_deltas``) on its own instance between the prefill and the decode steps, and the local
backend decodes several generations at once on threads sharing one model: one generation's
prefill would move another's positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoImageProcessor, PreTrainedModel

from gateway.backends.interface import Prompt
from gateway.errors import InvalidRequest
from schemas.pixels import (
    PROCESSOR_BACKEND,
    ImageProcessor,
    check_placeholders,
    image_inputs,
    placeholder_mask,
)

__all__ = ["ImagePrompt", "VisionReader", "is_vision_config"]


def is_vision_config(config: object) -> bool:
    """Whether a model's config is a vision-language model's (it has a vision tower)."""
    return getattr(config, "vision_config", None) is not None


@dataclass(frozen=True)
class ImagePrompt:
    """A prompt's images as the model takes them, on the model's device."""

    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor
    mm_token_type_ids: torch.Tensor  # (1, prompt length): 1 on image tokens
    position_ids: torch.Tensor  # (3, 1, prompt length): the prompt's M-RoPE positions
    rope_delta: int  # a token after the prompt at index i has position i + rope_delta (all rows)

    def prefill(self) -> dict[str, object]:
        """The keyword arguments of the forward pass that reads the whole prompt."""
        return {
            "pixel_values": self.pixel_values,
            "image_grid_thw": self.image_grid_thw,
            "mm_token_type_ids": self.mm_token_type_ids,
            "position_ids": self.position_ids,
        }

    def after(self, index: int, count: int = 1) -> dict[str, object]:
        """The keyword arguments of a forward pass reading ``count`` generated tokens from
        token index ``index`` on (text: one position, the same on the three rows)."""
        positions = torch.arange(
            index + self.rope_delta,
            index + self.rope_delta + count,
            device=self.position_ids.device,
        )
        return {"position_ids": positions.view(1, 1, -1).expand(3, 1, -1)}


class VisionReader:
    """A vision-language model's image processor and image token, for a backend's prompts."""

    def __init__(self, processor: ImageProcessor, image_token_id: int, backend_id: str) -> None:
        self._processor = processor
        self._image_token_id = image_token_id
        self._backend_id = backend_id

    @classmethod
    def load(cls, path: Path, model: PreTrainedModel, backend_id: str) -> VisionReader:
        """The image processor of the model directory ``path`` (its preprocessor_config.json),
        for ``model`` loaded from it. Raises ValueError for a model whose positions this
        backend cannot compute (it knows Qwen2-VL's ``get_rope_index``)."""
        if not callable(getattr(getattr(model, "model", None), "get_rope_index", None)):
            raise ValueError(
                f"{path}: the local backend runs vision-language models that compute M-RoPE "
                f"positions with get_rope_index (Qwen2-VL), not {type(model).__name__}"
            )
        image_token_id = getattr(model.config, "image_token_id", None)
        if not isinstance(image_token_id, int):
            raise ValueError(f"{path}: the model's config names no image_token_id")
        processor: ImageProcessor = AutoImageProcessor.from_pretrained(  # type: ignore[no-untyped-call]
            path, backend=PROCESSOR_BACKEND
        )
        return cls(processor, image_token_id, backend_id)

    def read(self, prompt: Prompt, model: PreTrainedModel) -> ImagePrompt:
        """``prompt``'s images as ``model`` takes them. Raises InvalidRequest when an image
        cannot be decoded or its placeholders are not the ones its processor expands it to.
        Blocking (decoding, resizing): run it off the event loop."""
        spans = [(image.ref.offset, image.ref.length) for image in prompt.images]
        try:
            inputs = image_inputs(self._processor, [image.data for image in prompt.images])
            check_placeholders(
                prompt.ids, spans, inputs.placeholders, image_token_id=self._image_token_id
            )
        except ValueError as exc:
            raise InvalidRequest(
                f"backend {self._backend_id} cannot read the prompt's images: {exc}"
            ) from exc
        device = model.device
        ids = torch.from_numpy(prompt.ids).to(device=device, dtype=torch.long).view(1, -1)
        token_types = torch.from_numpy(placeholder_mask(len(prompt.ids), spans)).to(device)
        grid = torch.from_numpy(inputs.grid_thw).to(device)
        language: Any = model.model  # Qwen2VLModel: get_rope_index is pure
        with torch.inference_mode():
            positions, deltas = language.get_rope_index(
                ids, mm_token_type_ids=token_types.view(1, -1), image_grid_thw=grid
            )
        return ImagePrompt(
            pixel_values=torch.from_numpy(inputs.pixel_values).to(device=device, dtype=model.dtype),
            image_grid_thw=grid,
            mm_token_type_ids=token_types.view(1, -1),
            position_ids=positions,
            rope_delta=int(deltas.view(-1)[0]),
        )
