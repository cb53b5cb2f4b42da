"""A real two-turn session with images on the tiny vision-language model, for the trainer's side.

The turns go through the gateway's turn core (``tests.helpers.image_turns.ImageTurns``: the
chat template with the model's ``VisionSpec``, each image's placeholder expanded as its
processor expands it, continued turns token-exact) to the local backend, which reads the
pixels itself and records each sampled token's log-prob. The user shows a Pillow-drawn picture
each turn (two sizes: grids of 4x8 and 6x4 patches); the events are what the gateway publishes,
the bytes what its image store holds.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw

from gateway.backends.local import LocalBackend
from gateway.images import VisionSpec
from gateway.templates import ChatTemplate, load_tokenizer
from schemas.events import SessionClosed, SessionEvent
from schemas.images import content_digest
from tests.helpers.image_turns import ImageTurns, user

__all__ = ["VisionSession", "drawn_png", "vision_session"]


def drawn_png(width: int, height: int, colour: str) -> bytes:
    """A drawn picture (its patches differ, unlike a flat colour's), as PNG bytes."""
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    draw.ellipse((width // 8, height // 8, width // 2, height // 2), fill=colour)
    draw.rectangle((width // 2, height // 3, width - 4, height - 4), outline="black", width=3)
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


@dataclass(frozen=True)
class VisionSession:
    events: list[SessionEvent]  # run "run", session "s", closed with reward 1
    images: dict[str, bytes]  # digest -> bytes, as the log's image store holds them


async def vision_session(
    model_dir: Path, *, temperature: float = 1.0, top_p: float = 1.0, max_tokens: int = 12
) -> VisionSession:
    """Two turns, each showing a new picture, sampled with ``temperature`` / ``top_p``."""
    template = ChatTemplate(load_tokenizer(model_dir), vision=VisionSpec.load(model_dir))
    backend = LocalBackend.load(model_dir)
    turns = ImageTurns(template, backend)
    pictures = [drawn_png(100, 60, "red"), drawn_png(57, 90, "green")]
    try:
        session = await turns.session()
        messages = []
        for i, text in enumerate(["What is this?", "And this?"]):
            messages.append(user(text, pictures[i]))
            reply = await turns.turn(
                session,
                messages,
                pictures[: i + 1],
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=top_p,
                seed=3 + i,
            )
            messages.append(reply)
    finally:
        await backend.close()
    events: list[SessionEvent] = [*turns.events]
    events.append(SessionClosed(run="run", session="s", reward=1.0, num_turns=len(events)))
    return VisionSession(events, {content_digest(p): p for p in pictures})
