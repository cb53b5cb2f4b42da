"""How the served model sees an image in its prompt: its placeholder token, expanded as the model's
own processor expands it.

A vision chat template (Qwen2-VL's) renders each image part as ONE ``<|image_pad|>``; the
model's processor then replaces that token with as many copies as the image has merged patches,
``grid_t * grid_h * grid_w // merge_size**2`` (transformers' ``Qwen2VLProcessor`` and vLLM's
``qwen2_vl.py`` prompt replacement apply the same formula), the grid coming from the image
processor's ``smart_resize`` of the image's size. The gateway tokenizes prompts itself, so it
expands them itself, from the image processor in the model's directory
(``preprocessor_config.json``) through its own ``get_number_of_image_patches`` (the method vLLM
calls to count placeholders without the image): only the size is needed, not the pixels.

Where a turn continues a kept turn, the kept ids (their images expanded) are reused as they are,
and only the new messages' ids are expanded (``expand`` on the suffix: its placeholders are the
conversation's last images). ``locate`` then finds every image's run in the whole prompt.

>>> spec = VisionSpec(image_token_id=9, image_token="<P>", patch_size=14, merge_size=2,
...     min_pixels=784, max_pixels=784 * 64)
>>> spec.placeholders(100, 60)
(8, (1, 4, 8))
>>> part = {"type": "image", "image": "sha256:" + "ab" * 32, "width": 100, "height": 60}
>>> spec.expand([1, 9, 2], [part])
[1, 9, 9, 9, 9, 9, 9, 9, 9, 2]
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gateway.backends.interface import PromptImage
from gateway.errors import InvalidRequest
from schemas.images import ImageRef, part_digest, sniff_mime

__all__ = ["VisionSpec"]

JSON = dict[str, Any]
# The image processors whose placeholders follow Qwen2-VL's rule (merged patches of a
# smart-resized image): the Qwen2-VL family's, as their preprocessor_config.json names them.
_QWEN2_VL_PROCESSORS = frozenset(
    {"Qwen2VLImageProcessor", "Qwen2VLImageProcessorFast", "Qwen2VLImageProcessorPil"}
)


@dataclass(frozen=True)
class VisionSpec:
    """The served model's image placeholder and its processor's sizing rule."""

    image_token_id: int
    image_token: str  # its text, which no text a client sends may hold
    patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int
    temporal_patch_size: int = 2

    @classmethod
    def load(cls, model_dir: Path, image_token: str | None = None) -> VisionSpec | None:
        """The spec of the model in ``model_dir``; None for a model that takes no images (no
        ``preprocessor_config.json``). A processor of another family is a ValueError (the
        gateway refuses to start: it would expand that model's images wrongly)."""
        path = Path(model_dir) / "preprocessor_config.json"
        if not path.is_file():
            return None
        processor = json.loads(path.read_text("utf-8"))
        config = json.loads((Path(model_dir) / "config.json").read_text("utf-8"))
        kind = processor.get("image_processor_type")
        if kind not in _QWEN2_VL_PROCESSORS:
            raise ValueError(
                f"{model_dir}: image processor {kind!r} is not one this gateway expands "
                f"placeholders for ({', '.join(sorted(_QWEN2_VL_PROCESSORS))}: the Qwen2-VL "
                f"family); serve a Qwen2-VL-family model, or a text model"
            )
        token_id = config.get("image_token_id")
        if not isinstance(token_id, int):
            raise ValueError(f"{model_dir}/config.json names no image_token_id")
        size = processor.get("size") or {}
        return cls(
            image_token_id=token_id,
            image_token=image_token or "<|image_pad|>",
            patch_size=int(processor.get("patch_size", 14)),
            merge_size=int(processor.get("merge_size", 2)),
            min_pixels=int(size.get("shortest_edge", processor.get("min_pixels", 56 * 56))),
            max_pixels=int(size.get("longest_edge", processor.get("max_pixels", 28 * 28 * 1280))),
            temporal_patch_size=int(processor.get("temporal_patch_size", 2)),
        )

    def placeholders(self, width: int, height: int) -> tuple[int, tuple[int, int, int]]:
        """How many placeholder tokens an image of this size becomes, and its patch grid
        (t, h, w): Qwen2-VL's ``smart_resize`` (transformers' image_processing_qwen2_vl),
        ``tests/unit/test_vision.py`` holds it equal to the processor's own output."""
        h, w = _smart_resize(
            height, width, self.patch_size * self.merge_size, self.min_pixels, self.max_pixels
        )
        grid = (1, h // self.patch_size, w // self.patch_size)
        return grid[1] * grid[2] // self.merge_size**2, grid

    def expand(self, ids: Sequence[int], parts: Sequence[JSON]) -> list[int]:
        """``ids`` with each placeholder, in order, replaced by its image's run: the i-th
        placeholder is ``parts[i]``'s (image parts in the order the template rendered them).
        A count that differs is the request's fault: text holding the placeholder's token."""
        pad = self.image_token_id
        at = [i for i, t in enumerate(ids) if t == pad]
        if len(at) != len(parts):
            raise InvalidRequest(
                f"the prompt holds {len(at)} image placeholders ({self.image_token}) for "
                f"{len(parts)} images: a message's text holds the model's image token "
                f"{self.image_token!r}; remove it from the text",
                param="messages",
            )
        if not at:
            return list(ids)
        out: list[int] = []
        start = 0
        for i, part in zip(at, parts, strict=True):
            n, _ = self.placeholders(int(part["width"]), int(part["height"]))
            out.extend(ids[start:i])
            out.extend([pad] * n)
            start = i + 1
        out.extend(ids[start:])
        return out

    def locate(
        self, ids: np.ndarray, parts: Sequence[JSON], data: Mapping[str, bytes]
    ) -> tuple[PromptImage, ...]:
        """Each image of a whole (expanded) prompt, in order: its run of placeholders in
        ``ids``, its digest, size, grid and bytes (``data``: the request's, by digest)."""
        if not parts:
            return ()
        runs = np.flatnonzero(np.asarray(ids) == self.image_token_id)
        out: list[PromptImage] = []
        k = 0
        for part in parts:
            digest = part_digest(part)
            assert digest is not None  # image_parts yields canonical parts only
            width, height = int(part["width"]), int(part["height"])
            n, grid = self.placeholders(width, height)
            if k + n > len(runs) or runs[k + n - 1] - runs[k] != n - 1:
                raise InvalidRequest(
                    f"the prompt's image placeholders do not match its {len(parts)} images "
                    f"(image {len(out)}, {width}x{height}, needs {n}): a message's text holds "
                    f"the model's image token {self.image_token!r}; remove it from the text",
                    param="messages",
                )
            blob = data.get(digest)
            if blob is None:
                raise InvalidRequest(
                    f"image sha256:{digest[:16]}... is named but its bytes were not sent: send "
                    "each image of the conversation as data (a data URL or base64)",
                    param="messages",
                )
            ref = ImageRef(digest, int(runs[k]), n, width, height, sniff_mime(blob), grid)
            out.append(PromptImage(ref, blob))
            k += n
        if k != len(runs):
            raise InvalidRequest(
                f"the prompt holds {len(runs) - k} image placeholder tokens no image stands "
                f"for: a message's text holds the model's image token {self.image_token!r}; "
                "remove it from the text",
                param="messages",
            )
        return tuple(out)


def _smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """Qwen2-VL's ``smart_resize``, from the PIL processor's module (the other one imports
    torchvision, which cannot load beside this machine's CPU torch): both sides multiples of
    ``factor``, pixels within [min, max], aspect kept; an aspect ratio over 200 refused."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    try:
        h, w = smart_resize(height, width, factor, min_pixels=min_pixels, max_pixels=max_pixels)
    except ValueError as exc:
        raise InvalidRequest(
            f"an image of {width}x{height} pixels cannot be read by the model's processor "
            f"({exc}); crop or pad it",
            param="messages",
        ) from None
    return int(h), int(w)
