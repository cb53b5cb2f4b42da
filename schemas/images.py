"""Images in turns (PURE): how a conversation names an image, and how an event places one in its
prompt's token ids.

An image is named by the SHA-256 of its bytes, everywhere after the API edge: the gateway
decodes the client's image (a data URL, an Anthropic base64 block, a Responses input_image),
checks it, stores its bytes once in the log's object store under that digest, and puts in the
canonical conversation an image part::

    {"type": "image", "image": "sha256:<64 hex>", "width": 640, "height": 480}

(HF chat templates of vision models render a part of type "image" as the model's image
placeholder; the width and height decide how many placeholder tokens the model's processor
expands it to). Events hold these parts in their messages, and ``ImageRef``s in
``TurnCompleted.images``: where each image's placeholder tokens sit in the prompt ids.

>>> part = image_part("ab" * 32, 64, 48)
>>> part["image"][:11], part_digest(part) == "ab" * 32
('sha256:abab', True)
>>> ref = ImageRef(sha256="ab" * 32, offset=5, length=4, width=64, height=48)
>>> [r.offset for r in prompt_images([ref], 9, [ImageRef("cd" * 32, 12, 2, 8, 8)])]
[5, 12]
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import msgspec

__all__ = [
    "IMAGE_PART",
    "ImageRef",
    "content_digest",
    "image_part",
    "image_parts",
    "part_digest",
    "prompt_images",
    "sniff_mime",
]

JSON = dict[str, Any]
IMAGE_PART = "image"  # the canonical content part's type
_DIGEST = re.compile(r"[0-9a-f]{64}")
_PREFIX = "sha256:"


def content_digest(data: bytes | memoryview) -> str:
    """The name of an image's bytes: their SHA-256, 64 lowercase hex digits."""
    return hashlib.sha256(data).hexdigest()


_MAGIC = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
)


def sniff_mime(data: bytes | memoryview) -> str:
    """The media type of an image's bytes by their signature ("" for none known): PNG, JPEG,
    GIF, WebP (the formats the gateway takes)."""
    head = bytes(data[:12])
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "image/webp"
    return next((mime for magic, mime in _MAGIC if head.startswith(magic)), "")


def image_part(digest: str, width: int, height: int) -> JSON:
    """The canonical content part of an image (see the module docstring)."""
    return {"type": IMAGE_PART, "image": _PREFIX + digest, "width": width, "height": height}


def part_digest(part: object) -> str | None:
    """The digest an image part names (None: not a canonical image part)."""
    if not isinstance(part, Mapping) or part.get("type") != IMAGE_PART:
        return None
    name = part.get("image")
    if isinstance(name, str) and name.startswith(_PREFIX) and _DIGEST.fullmatch(name[7:]):
        return name[7:]
    return None


def image_parts(messages: Iterable[Mapping[str, Any]]) -> Iterator[JSON]:
    """The image parts of ``messages``, in the order a chat template renders them."""
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            for part in content:
                if part_digest(part) is not None:
                    yield part


class ImageRef(msgspec.Struct, frozen=True):
    """One image of a prompt: its digest, and the run of placeholder tokens that stands for it in
    the prompt's full token ids (``offset``: index of the first, ``length``: how many, as the
    model's processor expands it), with what the processor needs to read it again."""

    sha256: str
    offset: int
    length: int
    width: int
    height: int
    mime: str = ""
    # The processor's patch grid (t, h, w) where the model has one (Qwen2-VL: image_grid_thw).
    grid: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not _DIGEST.fullmatch(self.sha256):
            raise ValueError(f"image sha256 {self.sha256[:80]!r} is not 64 lowercase hex digits")
        if self.offset < 0 or self.length < 1 or self.width < 1 or self.height < 1:
            raise ValueError(
                f"image {self.sha256[:12]}: offset {self.offset}, length {self.length}, "
                f"size {self.width}x{self.height}: offset >= 0, length and size >= 1"
            )

    @property
    def end(self) -> int:
        return self.offset + self.length


def prompt_images(
    parent: Sequence[ImageRef], prefix_len: int, own: Sequence[ImageRef]
) -> list[ImageRef]:
    """A turn's full prompt images from its parent's and its own (``TurnCompleted.images``:
    those at or after its ``prefix_len``): the parent's images inside the shared prefix, then
    its own."""
    return [ref for ref in parent if ref.end <= prefix_len] + list(own)
