"""A request's images, checked at the edge before its turn (every API the same way).

Each API's adapter names its image parts and where each sits in the request
(``messages[1].content[2].image_url``); ``check_images`` counts them against the limit, checks
each (``gateway.images.intake``: a 400 naming the part), keeps the result on the part for the
translation into the canonical conversation, and returns the bytes by digest
(``TurnRequest.images``). An agent resends its screenshots with every turn: the same source
text is checked once per request.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Iterable, Mapping
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

__all__ = ["DEFAULT_KEPT_IMAGE_BYTES", "FoundImage", "KeptImages", "check_images", "content_parts"]

JSON = dict[str, Any]
FoundImage = tuple[str, ImageInput]  # where the part is (as the client's request names it), it
# Checking costs ~10 ms per MB: a larger image is checked on a worker thread, off the loop.
_OFF_LOOP_CHARS = 256 * 1024
DEFAULT_KEPT_IMAGE_BYTES = 256 << 20  # ~128 distinct 2 MB screenshots


async def check_images(
    found: Iterable[FoundImage], *, limits: ImageLimits, where: str
) -> dict[str, bytes]:
    """Check the ``found`` image parts (``where``: what the count limit's refusal names) and
    keep each result on its part; the images' bytes by digest."""
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
        if image is None:
            image = await _checked(source, at, limits)
            if key is not None:
                seen[key] = image
        part.keep(image)
        images[image.digest] = image.data
    return images


def _source_key(source: URLSource | Base64Data) -> tuple[object, ...] | None:
    """What makes two sources the same image within a request (None: not comparable)."""
    if isinstance(source, URLSource):
        return ("url", source.url) if isinstance(source.url, str) else None
    if isinstance(source.data, str) and isinstance(source.media_type, str):
        return ("base64", source.data, source.media_type)
    return None


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
    """The bytes of the images of recent requests, by digest, up to ``max_bytes`` (the least
    recently used go first): what a Responses request continuing a response with
    ``previous_response_id`` does not resend. The session's state keeps that conversation's
    image parts, the log's object store their bytes; a digest this memory forgot is a 400 that
    says to resend the conversation (the turn core offers no read of the object store)."""

    def __init__(self, max_bytes: int = DEFAULT_KEPT_IMAGE_BYTES) -> None:
        self.max_bytes = max_bytes
        self._kept: OrderedDict[str, bytes] = OrderedDict()
        self._bytes = 0

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
