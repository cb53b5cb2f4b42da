"""A request's images, checked at the edge before its turn (every API the same way).

Each API's adapter names its image parts and where each sits in the request
(``messages[1].content[2].image_url``); ``check_images`` counts them against the limit, checks
each (``gateway.images.intake``: a 400 naming the part), keeps the result on the part for the
translation into the canonical conversation, and returns the bytes by digest
(``TurnRequest.images``). An agent resends its screenshots with every turn: the same source
text is checked once per request, and once per process while ``KeptImages`` remembers it (a
later request's copy costs a hash of its text, not a decode: the check is a pure function of
the text and the process's limits).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gateway.errors import InvalidRequest
from gateway.images.intake import (
    CheckedImage,
    check_image_count,
    image_from_base64,
    image_from_data_url,
    image_from_url,
)
from gateway.images.limits import ImageLimits
from gateway.protocol.images import Base64Data, ImageInput, URLSource
from schemas.images import image_parts, part_digest

__all__ = [
    "DEFAULT_KEPT_IMAGE_BYTES",
    "FoundImage",
    "ImageEdge",
    "KeptImages",
    "check_images",
    "content_parts",
]

JSON = dict[str, Any]
FoundImage = tuple[str, ImageInput]  # where the part is (as the client's request names it), it
# Checking costs ~10 ms per MB: a larger image is checked on a worker thread, off the loop.
_OFF_LOOP_CHARS = 256 * 1024
DEFAULT_KEPT_IMAGE_BYTES = 256 << 20  # ~128 distinct 2 MB screenshots


async def check_images(
    found: Iterable[FoundImage],
    *,
    limits: ImageLimits,
    where: str,
    kept: KeptImages | None = None,
) -> dict[str, bytes]:
    """Check the ``found`` image parts (``where``: what the count limit's refusal names) and
    keep each result on its part; the images' bytes by digest. ``kept``: the process's memory
    of checked images (read for a source checked before, and told each one checked)."""
    parts = list(found)
    if not parts:
        return {}
    check_image_count(len(parts), where=where, limits=limits)
    seen: dict[tuple[object, ...], CheckedImage] = {}
    images: dict[str, bytes] = {}
    for at, part in parts:
        source = part.image_source
        key = _source_key(source)
        image = seen.get(key) if key is not None else None
        name = _source_name(key) if image is None and kept is not None else None
        if name is not None and kept is not None:
            image = kept.checked(name)
        if image is None:
            image = await _checked(source, at, limits)
            if name is not None and kept is not None:
                kept.remember(name, image)
        if key is not None:
            seen[key] = image
        part.keep(image)
        images[image.digest] = image.data
    if kept is not None:
        kept.keep(images)  # a fetched one's too: a later request may continue this conversation
    return images


def _source_key(source: URLSource | Base64Data) -> tuple[str, ...] | None:
    """What makes two sources the same image (None: not comparable: refused when checked)."""
    if isinstance(source, URLSource):
        return ("url", source.url) if isinstance(source.url, str) else None
    if isinstance(source.data, str) and isinstance(source.media_type, str):
        return ("base64", source.media_type, source.data)
    return None


def _source_name(key: tuple[str, ...] | None) -> bytes | None:
    """A source's name across requests: the SHA-256 of its text (~1 ms a MB, a tenth of a
    check). None for a remote URL (what it serves may change) and a malformed source."""
    if key is None or (key[0] == "url" and key[1][:5].lower() != "data:"):
        return None
    return hashlib.sha256("\0".join(key).encode("utf-8", "surrogatepass")).digest()


async def _checked(source: URLSource | Base64Data, where: str, limits: ImageLimits) -> CheckedImage:
    if isinstance(source, Base64Data):
        data, media_type = source.data, source.media_type
        if isinstance(data, str) and len(data) > _OFF_LOOP_CHARS:
            return await asyncio.to_thread(
                image_from_base64, data, media_type, where=where, limits=limits
            )
        return image_from_base64(data, media_type, where=where, limits=limits)
    url = source.url
    if isinstance(url, str) and url[:5].lower() == "data:":
        if len(url) > _OFF_LOOP_CHARS:
            return await asyncio.to_thread(image_from_data_url, url, where=where, limits=limits)
        return image_from_data_url(url, where=where, limits=limits)
    return await image_from_url(url, where=where, limits=limits)  # refused unless listed


def content_parts(parts: Iterable[str | ImageInput]) -> str | list[JSON]:
    """A message's content from its texts and image parts, in order: the texts joined into one
    string where it holds no image (a text conversation is what it always was), else the
    canonical parts (``{"type": "text", ...}`` and image parts, ``schemas.images``).

    >>> content_parts(["a", "b"])
    'ab'
    """
    items = list(parts)
    if not any(isinstance(p, ImageInput) for p in items):
        return "".join(p for p in items if isinstance(p, str))
    return [p.part if isinstance(p, ImageInput) else {"type": "text", "text": p} for p in items]


class KeptImages:
    """The process's memory of recent images, up to ``max_bytes`` of them (the least recently
    used go first): their bytes by digest, and which source text (``_source_name``) was
    checked into which image.

    - A request continuing a response (``previous_response_id``) does not resend the earlier
      images: their parts come from the session's state, their bytes from here. A digest this
      memory forgot is a 400 that says to resend the conversation (the log's object store holds
      the bytes, but the turn core offers the adapters no read of it).
    - An agent resends its screenshots with every turn: a source text checked before is not
      decoded again.
    """

    def __init__(self, max_bytes: int = DEFAULT_KEPT_IMAGE_BYTES, max_sources: int = 4096) -> None:
        self.max_bytes = max_bytes
        self.max_sources = max_sources
        self._kept: OrderedDict[str, bytes] = OrderedDict()
        self._bytes = 0
        # source name -> (digest, mime, width, height): no bytes here, so the bound holds.
        self._sources: OrderedDict[bytes, tuple[str, str, int, int]] = OrderedDict()

    def keep(self, images: Mapping[str, bytes]) -> None:
        for digest, data in images.items():
            if digest in self._kept:
                self._kept.move_to_end(digest)
                continue
            self._kept[digest] = data
            self._bytes += len(data)
        while self._bytes > self.max_bytes and self._kept:
            _, dropped = self._kept.popitem(last=False)
            self._bytes -= len(dropped)

    def remember(self, name: bytes, image: CheckedImage) -> None:
        """``image`` is what the source named ``name`` checked into."""
        self._sources[name] = (image.digest, image.mime, image.width, image.height)
        self._sources.move_to_end(name)
        if len(self._sources) > self.max_sources:
            self._sources.popitem(last=False)
        self.keep({image.digest: image.data})

    def checked(self, name: bytes) -> CheckedImage | None:
        """The image the source named ``name`` checked into, if its bytes are still kept."""
        known = self._sources.get(name)
        if known is None:
            return None
        digest, mime, width, height = known
        data = self._kept.get(digest)
        if data is None:
            del self._sources[name]
            return None
        self._sources.move_to_end(name)
        self._kept.move_to_end(digest)
        return CheckedImage(digest, data, mime, width, height)

    def bytes_of(
        self, messages: Iterable[JSON], sent: Mapping[str, bytes], *, named: str, param: str
    ) -> dict[str, bytes]:
        """The bytes of the images of ``messages`` (a conversation ``named`` continues) that
        ``sent`` lacks; a 400 for one no longer kept."""
        out: dict[str, bytes] = {}
        for part in image_parts(messages):
            digest = part_digest(part)
            if digest is None or digest in sent or digest in out:
                continue
            data = self._kept.get(digest)
            if data is None:
                raise InvalidRequest(
                    f"{named}: its conversation shows image sha256:{digest[:16]}..., whose bytes "
                    f"the gateway no longer holds (it keeps the most recent images, "
                    f"{self.max_bytes:,} bytes, in memory): resend the full conversation as "
                    "input, its images included",
                    param=param,
                )
            self._kept.move_to_end(digest)
            out[digest] = data
        return out


@dataclass(frozen=True)
class ImageEdge:
    """What every API's adapter checks its images with: the gateway's limits, and the
    process's one memory of checked images (a conversation may change API)."""

    limits: ImageLimits = field(default_factory=ImageLimits)
    kept: KeptImages = field(default_factory=KeptImages)

    async def check(self, found: Iterable[FoundImage], *, where: str) -> dict[str, bytes]:
        """``check_images`` of ``found`` (``where``: what the count limit's refusal names)."""
        return await check_images(found, limits=self.limits, where=where, kept=self.kept)
