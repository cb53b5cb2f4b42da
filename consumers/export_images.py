"""Images in a ``messages`` export (issue 39): laid out as Hugging Face vision chat datasets are.

Events and shards name an image by its digest, in a content part
``{"type": "image", "image": "sha256:<hex>", "width": W, "height": H}`` (``schemas.images``).
A dataset for fine-tuning a vision model (TRL's vision SFT, the ``messages`` + ``images``
layout of ``HuggingFaceH4/llava-instruct-mix-vsft``) instead holds the pictures themselves, in
an ``images`` column of ``datasets.Image()`` values in order of appearance, and leaves in the
messages a bare ``{"type": "image"}`` where each sits: the processor's chat template renders
that as the model's image placeholder, and the collator takes the row's images in order. So
an export whose rows hold images writes (``with_images``)::

    messages: list<struct<role, content: list<struct<type, text>>, tool_calls, tool_call_id, name>>
    images:   list<struct<bytes: binary, path: string>>     (datasets.Image(), the card says so)

Every content is a list of parts there (text as ``{"type": "text", "text": ...}``, as in those
datasets), since one column has one type. ``bytes`` are the image's bytes as the client sent
them, read from the log's image store (``ImageSource``) and checked against the digest;
``path`` is ``sha256:<hex>``, the name the log knows it by (``datasets`` decodes from the
bytes). An export whose rows hold no image keeps the text layout (``content`` a string).

>>> digest = "ab" * 32
>>> message = {"role": "user", "content": [
...     {"type": "image", "image": f"sha256:{digest}", "width": 8, "height": 6},
...     {"type": "text", "text": "what is this?"}]}
>>> parts = image_parts_of(message["content"], Counter())
>>> parts.exported, parts.digests == [digest]
([{'type': 'image', 'text': None}, {'type': 'text', 'text': 'what is this?'}], True)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import pyarrow as pa

from schemas.images import IMAGE_PART, part_digest

__all__ = [
    "IMAGE_MENTION",
    "IMAGE_TYPE",
    "PART_TYPE",
    "ContentParts",
    "ImageSource",
    "image_parts_of",
    "images_column",
    "with_images",
]

JSON = dict[str, Any]
_S = pa.string()
IMAGE_TYPE = pa.struct([("bytes", pa.binary()), ("path", _S)])
"""The storage of ``datasets.Image()``: the dataset card's features name it ``image``."""
PART_TYPE = pa.struct([("type", _S), ("text", _S)])
IMAGE_MENTION = '"type":"image"'
"""How an image part begins in the shards' compact JSON messages: the rows that may hold one."""


class ImageSource(Protocol):
    """The log's images, by digest, for a thread that may block (``turnstream export``'s
    ``LogImages``)."""

    def get(self, digest: str) -> bytes:
        """The bytes named ``digest``, checked; raises when the log does not hold them."""
        ...


@dataclass
class ContentParts:
    """A message's content as the export writes it, as the chat template is checked against
    it (the canonical image parts kept: their sizes decide the placeholders), and the
    digests of its images in order."""

    exported: list[JSON] = field(default_factory=list)
    checked: list[JSON] = field(default_factory=list)
    digests: list[str] = field(default_factory=list)


def image_parts_of(content: object, dropped: Counter[str]) -> ContentParts:
    """``content`` (a string, parts, or None) as parts; other parts counted in ``dropped``."""
    parts = ContentParts()
    if content is None:
        return parts
    items = [{"type": "text", "text": content}] if isinstance(content, str) else content
    if not isinstance(items, list):
        dropped["content.<not text or parts>"] += 1
        return parts
    for part in items:
        digest = part_digest(part)
        if digest is not None:
            parts.exported.append({"type": IMAGE_PART, "text": None})
            parts.checked.append(part)
            parts.digests.append(digest)
        elif isinstance(part, dict) and isinstance(part.get("text"), str):
            text = {"type": "text", "text": part["text"]}
            parts.exported.append(text)
            parts.checked.append(text)
        else:
            dropped[f"content.{part.get('type') if isinstance(part, dict) else '?'}"] += 1
    return parts


def with_images(schema: pa.Schema) -> pa.Schema:
    """The ``messages`` schema of an export whose rows hold images: content as parts, and the
    ``images`` column after ``messages``."""
    messages = schema.field("messages")
    message: pa.StructType = messages.type.value_type
    fields = [f.with_type(pa.list_(PART_TYPE)) if f.name == "content" else f for f in message]
    out = schema.set(
        schema.get_field_index("messages"), messages.with_type(pa.list_(pa.struct(fields)))
    )
    at = out.get_field_index("messages") + 1
    return out.insert(at, pa.field("images", pa.list_(IMAGE_TYPE), nullable=False))


def images_column(rows: Sequence[Sequence[str]], source: ImageSource) -> pa.Array:
    """Each row's images (digests in order) as ``datasets.Image()`` values; a digest repeated
    across rows (a screenshot resent every turn) is read once per batch."""
    read: dict[str, bytes] = {}
    values = []
    for digests in rows:
        row = []
        for digest in digests:
            if digest not in read:
                read[digest] = source.get(digest)
            row.append({"bytes": read[digest], "path": f"sha256:{digest}"})
        values.append(row)
    return pa.array(values, pa.list_(IMAGE_TYPE))
