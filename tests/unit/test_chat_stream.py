"""A streamed turn's stream gives its session back however it ends: a replayed turn's hold is
released even if the client never pulled a chunk; a live turn's is its generation's (see
tests/unit/test_concurrent_turns.py)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from gateway.backends.interface import GenerationChunk, SamplingParams
from gateway.core.aggregate import SessionState
from gateway.core.session_store import Session, SessionStore
from gateway.errors import BackendError
from gateway.metrics import GatewayMetrics
from gateway.protocol import ChatCompletionRequest
from gateway.serving import ChatServing, TurnEngine, TurnServing, TurnStream
from gateway.templates import ChatTemplate
from gateway.tools import get_parser


async def replayed_session() -> tuple[TurnStream, Session]:
    store = SessionStore()
    session = await store.load(("run", "s"), _create)
    assert session is not None
    release_hold = store.hold(session)  # as TurnServing.stream does before a replay

    async def generate() -> AsyncIterator[bytes]:
        try:
            yield b"data: x\n\n"
        finally:
            release_hold()

    return TurnStream(generate(), release_hold), session


async def _create() -> tuple[SessionState, int]:
    return SessionState(run="run", id="s"), 0


async def test_a_stream_the_client_never_pulled_releases_the_session() -> None:
    stream, session = await replayed_session()

    await stream.ended()

    assert session.users == 0, "the session could never be evicted"


async def test_a_started_stream_releases_the_session_once() -> None:
    stream, session = await replayed_session()
    iterator = aiter(stream)
    assert await anext(iterator) == b"data: x\n\n"

    await iterator.aclose()  # type: ignore[attr-defined]
    await stream.ended()
    assert session.users == 0


class _Receipt:
    seq, duplicate = 1, False


class _Publisher:
    """Records what would be published (the log itself is tested in integration)."""

    def __init__(self) -> None:
        self.events: list[Any] = []

    async def publish(self, event: Any) -> _Receipt:
        self.events.append(event)
        return _Receipt()


class _FailingBackend:
    """A backend that fails after its first token (stands in for a replica that dies)."""

    id, max_context = "failing", 4096

    async def generate(
        self, prompt_ids: Any, params: Any, *, session: str | None = None
    ) -> AsyncIterator[GenerationChunk]:
        yield GenerationChunk([72], [-0.5])
        raise BackendError("replica died mid-generation")

    async def admit(self, params: SamplingParams) -> str | None:
        return None

    async def close(self) -> None:
        return None


async def test_a_backend_failure_mid_stream_ends_it_with_an_error_event(
    tiny_model_dir: Path,
) -> None:
    """Found by the contract run: the exception escaped after the status line was sent and
    the connection dropped. Now the stream ends with an OpenAI error event, the turn is not
    recorded (the client never got it whole), and the session is free for the next turn."""
    template = ChatTemplate(AutoTokenizer.from_pretrained(tiny_model_dir))
    publisher = _Publisher()
    engine = TurnEngine(
        template=template,
        backend=_FailingBackend(),
        publisher=publisher,  # type: ignore[arg-type]
        parser=get_parser("hermes"),
        model_name="tiny",
        metrics=GatewayMetrics(),
    )
    store = SessionStore()
    session = await store.load(("run", "s"), _create)
    assert session is not None
    request = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 8}
    )
    stream = await ChatServing(TurnServing(engine, store)).stream(session, request)
    events = [chunk async for chunk in stream]
    assert events[0].startswith(b"data: {")
    error = json.loads(events[-1].removeprefix(b"data: "))["error"]
    assert error["code"] == "backend_error" and "mid-generation" in error["message"]
    assert publisher.events == [] and session.state.turns == 0
    await stream.ended()
    assert not session.lock.locked() and session.users == 0
