"""Sessions whose turns show images, made without the gateway: each chosen turn's last new
message gets an image part (``schemas.images.image_part``) and the event an ``ImageRef`` on
its first new prompt token, as the gateway would record them; the bytes are Pillow-drawn PNGs,
put into the log's store by the test (``put_images``)."""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence

import msgspec
from PIL import Image, ImageDraw

from eventlog.objects import ImageStore
from schemas.events import SessionEvent, TurnCompleted
from schemas.images import ImageRef, content_digest, image_part

__all__ = ["png", "put_images", "with_images"]


def png(seed: int, width: int = 64, height: int = 48) -> bytes:
    """A small PNG unlike the others of another seed (a square drawn where the seed says)."""
    image = Image.new("RGB", (width, height), (seed * 37 % 256, 90, 160))
    ImageDraw.Draw(image).rectangle((seed % width, 4, seed % width + 8, 12), fill="white")
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def with_images(
    events: Sequence[SessionEvent], shown: Mapping[int, bytes], *, tokens: int = 1
) -> list[SessionEvent]:
    """``events`` with turn t (a key of ``shown``) showing ``shown[t]``: an image part first in
    its last new message, and its ref on the first ``tokens`` of its new prompt ids."""
    out: list[SessionEvent] = []
    for event in events:
        if isinstance(event, TurnCompleted) and event.turn in shown:
            data = shown[event.turn]
            with Image.open(io.BytesIO(data)) as image:
                width, height = image.size
            digest = content_digest(data)
            messages = [dict(m) for m in event.new_messages]
            last = messages[-1]
            text = last.get("content")
            last["content"] = [
                image_part(digest, width, height),
                *([{"type": "text", "text": text}] if isinstance(text, str) else []),
            ]
            ref = ImageRef(digest, event.prefix_len, tokens, width, height, mime="image/png")
            event = msgspec.structs.replace(event, new_messages=messages, images=[ref])
        out.append(event)
    return out


async def put_images(store: ImageStore, images: Sequence[bytes]) -> None:
    for data in images:
        await store.put(data)
