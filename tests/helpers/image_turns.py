"""Image turns through the turn core (``TurnServing``) on a given backend, the events kept in
memory (``MemoryLog``): what tests/unit/test_vllm_images.py (a stand-in of vLLM) and
tests/deploy/test_vllm_images.py (the real one) drive. Requests are ``TurnRequest``s carrying
the images' bytes, as the API adapters make them."""

from __future__ import annotations

import io
from typing import Any

from PIL import Image

from gateway.backends.interface import Backend
from gateway.core.aggregate import SessionState
from gateway.core.conversation import TurnRequest
from gateway.core.session_store import Session, SessionStore
from gateway.metrics import GatewayMetrics
from gateway.serving import TurnEngine, TurnServing
from gateway.templates import ChatTemplate
from gateway.tools import get_parser
from schemas.events import TurnCompleted
from schemas.images import content_digest, image_part
from tests.helpers.memory_log import MemoryLog

__all__ = ["ImageTurns", "full_prompts", "png", "user"]

JSON = dict[str, Any]


def png(width: int, height: int, colour: str = "red") -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(out, format="PNG")
    return out.getvalue()


def user(text: str, *images: bytes) -> JSON:
    """A user message of ``text`` then ``images``, as canonical parts (schemas.images)."""
    parts: list[JSON] = [{"type": "text", "text": text}]
    for data in images:
        with Image.open(io.BytesIO(data)) as img:
            parts.append(image_part(content_digest(data), *img.size))
    return {"role": "user", "content": parts}


class ImageTurns:
    """One session's turns on ``backend``; ``events``: what the log would hold."""

    def __init__(self, template: ChatTemplate, backend: Backend) -> None:
        self.log = MemoryLog()
        self.metrics = GatewayMetrics()
        engine = TurnEngine(
            template=template,
            backend=backend,
            publisher=self.log,
            parser=get_parser("hermes"),
            model_name="tiny-vl",
            metrics=self.metrics,
        )
        self.store = SessionStore()
        self.serving = TurnServing(engine, self.store)

    @property
    def events(self) -> list[TurnCompleted]:
        return [e for e in self.log.events("run", "s") if isinstance(e, TurnCompleted)]

    async def session(self) -> Session:
        async def create() -> tuple[SessionState, int]:
            return SessionState(run="run", id="s"), 0

        session = await self.store.load(("run", "s"), create)
        assert session is not None
        return session

    async def turn(
        self,
        session: Session,
        messages: list[JSON],
        data: list[bytes],
        max_tokens: int = 16,
        **request: Any,
    ) -> JSON:
        """One turn of ``messages`` (``data``: the bytes of their images; ``request``: more
        ``TurnRequest`` fields, e.g. sampling); the reply."""
        turn_request = TurnRequest(
            api="chat.completions",
            messages=messages,
            max_tokens=max_tokens,
            images={content_digest(d): d for d in data},
            **request,
        )
        result = await self.serving.complete(session, turn_request)
        return {"role": "assistant", "content": result.content}


def full_prompts(events: list[TurnCompleted]) -> list[list[int]]:
    """Each turn's whole prompt, rebuilt from the delta-encoded events."""
    contexts: dict[int, list[int]] = {}
    prompts = []
    for event in events:
        head = contexts.get(event.parent_turn if event.parent_turn is not None else -1, [])
        prompt = head[: event.prefix_len] + event.prompt_ids.tolist()
        prompts.append(prompt)
        contexts[event.turn] = prompt + event.completion_ids.tolist()
    return prompts
