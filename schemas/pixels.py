"""An image's bytes as a vision model reads them (PURE: no file I/O): the image processor's
tensors, and the check that a prompt's placeholder tokens are the ones those tensors fill.

Both sides of the log read images this one way: the gateway's local backend before it runs a
prompt with images, and a trainer rebuilding a turn's model inputs (verl's
``multi_modal_inputs``) from the bytes in the log's object store. Same bytes, same processor,
same ``pixel_values``: the log-probs recorded are the ones the trainer recomputes.

The processor is a Hugging Face image processor of the Qwen2-VL family, loaded by the caller
from the model's directory with ``AutoImageProcessor.from_pretrained(path,
backend=PROCESSOR_BACKEND)``: the PIL-backed class, which needs no torchvision (the
torchvision-backed one resizes with other kernels, so its pixels differ slightly). It expands
an image into ``grid_t * grid_h * grid_w`` patches, which the model merges ``merge_size**2`` at
a time into one embedding per placeholder token (``placeholder_count``).

>>> placeholder_count((1, 4, 8), 2)
8
>>> check_placeholders([1, 9, 9, 2], [(1, 2)], [2], image_token_id=9)
>>> check_placeholders([1, 9, 7, 2], [(1, 2)], [2], image_token_id=9)
Traceback (most recent call last):
ValueError: image 0: prompt ids 1..2 should all be the image token 9, found [9, 7]
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np

if TYPE_CHECKING:
    from PIL.Image import Image

__all__ = [
    "PROCESSOR_BACKEND",
    "ImageInputs",
    "ImageProcessor",
    "check_placeholders",
    "decode_rgb",
    "image_inputs",
    "placeholder_count",
    "placeholder_mask",
]

PROCESSOR_BACKEND = "pil"  # AutoImageProcessor's backend= for the processor both sides load


class ImageProcessor(Protocol):
    """What of a Hugging Face image processor (``Qwen2VLImageProcessorPil``) is used here."""

    merge_size: int

    def __call__(self, *, images: list[Image], return_tensors: str) -> Mapping[str, Any]: ...


class ImageInputs(NamedTuple):
    """A prompt's images as the model takes them, in the prompt's order."""

    pixel_values: np.ndarray  # (all images' patches, channels * temporal * patch * patch)
    grid_thw: np.ndarray  # (images, 3) int64: each image's (t, h, w) patch grid
    placeholders: tuple[int, ...]  # each image's placeholder tokens in the prompt


def decode_rgb(data: bytes | memoryview) -> Image:
    """An image file's bytes (PNG, JPEG, GIF, WebP, ...) as an RGB Pillow image (its first
    frame). Raises ValueError when they are not a decodable image."""
    from PIL import Image as PILImage
    from PIL import UnidentifiedImageError

    try:
        with PILImage.open(io.BytesIO(data)) as image:
            return image.convert("RGB")  # decodes it whole: a truncated file fails here
    except (UnidentifiedImageError, OSError, SyntaxError) as exc:
        raise ValueError(f"not a decodable image ({len(data)} bytes): {exc}") from exc


def placeholder_count(grid_thw: Sequence[int] | np.ndarray, merge_size: int) -> int:
    """How many placeholder tokens an image of this patch grid takes in a prompt."""
    t, h, w = (int(n) for n in grid_thw)
    return t * h * w // merge_size**2


def image_inputs(processor: ImageProcessor, images: Sequence[bytes | memoryview]) -> ImageInputs:
    """The processor's tensors for these image files, as numpy arrays (torch is the caller's
    choice: ``torch.from_numpy`` shares the memory)."""
    if not images:
        raise ValueError("no images: a text prompt has no image inputs")
    out = processor(images=[decode_rgb(data) for data in images], return_tensors="np")
    pixels = np.asarray(out["pixel_values"])
    grid = np.asarray(out["image_grid_thw"], dtype=np.int64).reshape(-1, 3)
    merge = int(processor.merge_size)
    return ImageInputs(pixels, grid, tuple(placeholder_count(g, merge) for g in grid))


def check_placeholders(
    ids: Sequence[int] | np.ndarray,
    spans: Sequence[tuple[int, int]],
    expected: Sequence[int],
    *,
    image_token_id: int,
) -> None:
    """Check that each image's span ``(offset, length)`` of ``ids`` is a run of exactly as many
    image tokens as the processor expands it to (``expected``, in order), that the spans come in
    order with a token between them (the model tells images apart by where runs break), and
    that no image token lies outside them (the model would put an image's embedding there).
    Raises ValueError naming the first image that is wrong, and what was found."""
    tokens = np.asarray(ids)
    if len(spans) != len(expected):
        raise ValueError(f"{len(spans)} placeholder spans for {len(expected)} images")
    end = -1
    for i, ((offset, length), want) in enumerate(zip(spans, expected, strict=True)):
        if length != want:
            raise ValueError(
                f"image {i}: {length} placeholder tokens at offset {offset}, but the model's "
                f"image processor expands this image to {want}"
            )
        if offset <= end:
            raise ValueError(
                f"image {i} at offset {offset} does not come after the previous image's "
                f"placeholders (which end before {end}) with a token between them"
            )
        run = tokens[offset : offset + length]
        if offset < 0 or len(run) != length or (run != image_token_id).any():
            raise ValueError(
                f"image {i}: prompt ids {offset}..{offset + length - 1} should all be the "
                f"image token {image_token_id}, found {run.tolist()[:8]}"
            )
        end = offset + length
    total = int((tokens == image_token_id).sum())
    if total != sum(expected):
        raise ValueError(
            f"the prompt holds {total} image tokens ({image_token_id}) but its images' "
            f"placeholders are {sum(expected)}: an image token outside an image's placeholders"
        )


def placeholder_mask(length: int, spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """``mm_token_type_ids`` of a prompt of ``length`` tokens: 1 on its images' placeholder
    tokens, 0 elsewhere (text; 2 would be video).

    >>> placeholder_mask(6, [(1, 2), (4, 1)]).tolist()
    [0, 1, 1, 0, 1, 0]
    """
    mask = np.zeros(length, dtype=np.int64)
    for offset, n in spans:
        mask[offset : offset + n] = 1
    return mask
