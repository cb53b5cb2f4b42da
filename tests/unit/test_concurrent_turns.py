"""Turns of one session are served concurrently (issue 35): generation holds no session-wide
lock, only the append is one at a time; a same-agent retry of a request in flight waits for it,
two agents' identical requests are two turns; a streamed turn whose client went away is still
recorded, flagged ``client_gone``. The real turn core (engine, serving, store) on the tiny
model's template, a backend that waits for what the test says."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from gateway.backends.interface import GenerationChunk, SamplingParams
from gateway.core.agents import AgentIdentity
from gateway.core.session_store import Session, SessionStore
from gateway.errors import BackendError, SessionClosed
from gateway.metrics import GatewayMetrics
from gateway.protocol import ChatCompletionRequest
from gateway.serving import ChatServing, TurnEngine, TurnServing
from gateway.templates import ChatTemplate
from gateway.tools import get_parser
from schemas.events import SessionClosed as Closed
from schemas.events import TurnCompleted
from tests.unit.test_chat_stream import _create, _Publisher

REPLY = "Hello there."
WAIT = 30  # seconds before a test that would hang fails instead (never reached when it works)


class _GatedBackend:
    """Generates ``ids`` one token at a time after its first token, each request waiting at
    ``gate`` (opened by the test, or once ``together`` requests are generating at once)."""

    id, max_context = "gated", 4096

    def __init__(self, ids: list[int], together: int = 0) -> None:
        self.ids = ids
        self.together = together
        self.gate = asyncio.Event()
        self.first_sent = asyncio.Event()
        self.in_flight = 0
        self.most_in_flight = 0
        self.calls = 0
        self.fail_next = False

    async def generate(
        self, prompt: Any, params: SamplingParams, *, session: str | None = None
    ) -> AsyncIterator[GenerationChunk]:
        self.calls += 1
        fail, self.fail_next = self.fail_next, False
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        if self.together and self.in_flight >= self.together:
            self.gate.set()
        try:
            yield GenerationChunk(self.ids[:1], [-0.5])
            self.first_sent.set()
            await self.gate.wait()
            if fail:
                raise BackendError("replica died mid-generation")
            for i, token in enumerate(self.ids[1:], 1):
                last = i == len(self.ids) - 1
                yield GenerationChunk([token], [-0.5], None, "stop" if last else None)
        finally:
            self.in_flight -= 1

    async def admit(self, params: SamplingParams) -> str | None:
        return None

    async def close(self) -> None:
        return None


async def served(
    model_dir: Path, together: int = 0
) -> tuple[ChatServing, _GatedBackend, _Publisher, Session, TurnEngine]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    template = ChatTemplate(tokenizer)
    ids = [*tokenizer.encode(REPLY, add_special_tokens=False), *template.stop_token_ids[:1]]
    backend, publisher = _GatedBackend(ids, together), _Publisher()
    engine = TurnEngine(
        template=template,
        backend=backend,
        publisher=publisher,  # type: ignore[arg-type]
        parser=get_parser("hermes"),
        model_name="tiny",
        metrics=GatewayMetrics(),
    )
    store = SessionStore()
    session = await store.load(("run", "s"), _create)
    assert session is not None
    return ChatServing(TurnServing(engine, store)), backend, publisher, session, engine


def request(content: str = "hi", **fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": content}], "max_tokens": 64, **fields}
    )


async def test_conversations_of_one_session_generate_together(tiny_model_dir: Path) -> None:
    """Four conversations of one session: the backend holds every generation until all four
    are in flight, so with a session-wide lock across generation this would never finish."""
    chat, backend, publisher, session, _ = await served(tiny_model_dir, together=4)
    asks = [chat.complete(session, request(f"task {i}")) for i in range(4)]
    replies = await asyncio.wait_for(asyncio.gather(*asks), WAIT)
    assert backend.most_in_flight == 4
    assert sorted(e.turn for e in publisher.events) == [0, 1, 2, 3]  # indices at the append
    assert session.state.turns == 4
    ids = {r.id for r in replies}
    assert ids == {f"chatcmpl-s-{e.reply_id}" for e in publisher.events} and len(ids) == 4
    seeds = [e.sampling["seed"] for e in publisher.events]
    assert len(set(seeds)) == 4, "requests in flight together never share a derived seed"


async def test_a_retry_of_a_request_in_flight_gets_its_answer(tiny_model_dir: Path) -> None:
    chat, backend, publisher, session, _ = await served(tiny_model_dir)
    main = AgentIdentity("main")
    first = asyncio.create_task(chat.complete(session, request(), main))
    await asyncio.wait_for(backend.first_sent.wait(), WAIT)
    retry = asyncio.create_task(chat.complete(session, request(), main))
    await asyncio.sleep(0)
    backend.gate.set()
    answers = await asyncio.wait_for(asyncio.gather(first, retry), WAIT)
    assert backend.calls == 1 and len(publisher.events) == 1, "one model call, one turn"
    assert answers[0].id == answers[1].id == f"chatcmpl-s-{publisher.events[0].reply_id}"
    assert answers[1].choices[0].message.content == REPLY


async def test_a_retry_runs_itself_when_the_request_in_flight_fails(tiny_model_dir: Path) -> None:
    chat, backend, publisher, session, _ = await served(tiny_model_dir)
    backend.fail_next = True
    first = asyncio.create_task(chat.complete(session, request()))
    await asyncio.wait_for(backend.first_sent.wait(), WAIT)
    retry = asyncio.create_task(chat.complete(session, request()))
    await asyncio.sleep(0)
    backend.gate.set()
    with pytest.raises(BackendError):
        await asyncio.wait_for(first, WAIT)
    answer = await asyncio.wait_for(retry, WAIT)
    assert backend.calls == 2 and [e.turn for e in publisher.events] == [0]
    assert answer.choices[0].message.content == REPLY


async def test_two_agents_identical_requests_are_two_turns(tiny_model_dir: Path) -> None:
    """A fan-out of identical sub-agents: each samples its own answer, in flight or after."""
    chat, backend, publisher, session, _ = await served(tiny_model_dir)
    backend.gate.set()
    one = AgentIdentity("a1", parent="main", kind="fresh")
    two = AgentIdentity("a2", parent="main", kind="fresh")
    answers = await asyncio.gather(
        chat.complete(session, request("explore"), one),
        chat.complete(session, request("explore"), two),
    )
    again = await chat.complete(session, request("explore"), one)  # a1's retry: from the log
    assert backend.calls == 2 and len(publisher.events) == 2
    assert answers[0].id != answers[1].id and again.id == answers[0].id
    assert {e.agent["id"] for e in publisher.events} == {"a1", "a2"}
    assert all(e.agent["resolved_kind"] == "fresh" for e in publisher.events)


async def test_without_identity_a_second_identical_request_is_a_resend(
    tiny_model_dir: Path,
) -> None:
    chat, backend, publisher, session, _ = await served(tiny_model_dir)
    backend.gate.set()
    first = await chat.complete(session, request())
    again = await chat.complete(session, request())
    assert again.id == first.id and backend.calls == 1 and len(publisher.events) == 1
    assert publisher.events[0].agent == {}


async def test_a_session_closed_while_a_turn_generates_records_nothing(
    tiny_model_dir: Path,
) -> None:
    chat, backend, publisher, session, _ = await served(tiny_model_dir)
    asked = asyncio.create_task(chat.complete(session, request()))
    await asyncio.wait_for(backend.first_sent.wait(), WAIT)
    session.apply(Closed(run="run", session="s", status="done", num_turns=0))
    backend.gate.set()
    with pytest.raises(SessionClosed):
        await asyncio.wait_for(asked, WAIT)
    assert publisher.events == [] and session.state.turns == 0


async def _recorded(publisher: _Publisher) -> TurnCompleted:
    for _ in range(WAIT * 100):
        if publisher.events:
            return publisher.events[-1]
        await asyncio.sleep(0.01)
    raise AssertionError("the turn was never recorded")


async def test_a_stream_whose_client_left_is_recorded_whole_as_client_gone(
    tiny_model_dir: Path,
) -> None:
    chat, backend, publisher, session, _ = await served(tiny_model_dir)
    stream = await chat.stream(session, request(stream=True))
    chunks = aiter(stream)
    assert (await anext(chunks)).startswith(b"data: {")  # the role
    await anext(chunks)  # the first token's text
    await chunks.aclose()  # type: ignore[attr-defined]  # the client went away
    await stream.ended()
    assert not publisher.events and session.users == 1  # still generating, still held
    backend.gate.set()
    event = await _recorded(publisher)
    assert event.client_gone and event.text == REPLY
    assert event.completion_ids.tolist() == backend.ids
    assert session.users == 0 and session.state.turns == 1


async def test_a_stream_never_pulled_still_records_its_turn(tiny_model_dir: Path) -> None:
    """The client left before the first event: the response never ran the generator."""
    chat, backend, publisher, session, _ = await served(tiny_model_dir)
    backend.gate.set()
    stream = await chat.stream(session, request(stream=True))
    await stream.ended()
    event = await _recorded(publisher)
    assert event.client_gone and event.text == REPLY and session.users == 0


async def test_a_stream_read_to_its_end_is_not_client_gone(tiny_model_dir: Path) -> None:
    chat, backend, publisher, session, _ = await served(tiny_model_dir)
    backend.gate.set()
    stream = await chat.stream(session, request(stream=True))
    chunks = [chunk async for chunk in stream]
    await stream.ended()
    [event] = publisher.events
    assert not event.client_gone and chunks[-1].endswith(b"data: [DONE]\n\n")
    assert f"chatcmpl-s-{event.reply_id}".encode() in chunks[0]
    assert session.users == 0


async def test_a_retry_joining_a_stream_whose_client_left_is_what_the_client_sees(
    tiny_model_dir: Path,
) -> None:
    """The client timed out, closed its stream and sent the request again: the retry waits for
    the turn in flight and gets it, so the turn is not recorded as unseen."""
    chat, backend, publisher, session, _ = await served(tiny_model_dir)
    main = AgentIdentity("main")
    stream = await chat.stream(session, request(stream=True), main)
    chunks = aiter(stream)
    await anext(chunks)
    await chunks.aclose()  # type: ignore[attr-defined]
    await stream.ended()
    retry = asyncio.create_task(chat.complete(session, request(), main))
    await asyncio.sleep(0)
    backend.gate.set()
    answer = await asyncio.wait_for(retry, WAIT)
    [event] = publisher.events
    assert not event.client_gone and answer.id == f"chatcmpl-s-{event.reply_id}"
    assert backend.calls == 1


async def test_a_gateway_stopping_cancels_turns_still_generating(tiny_model_dir: Path) -> None:
    chat, backend, publisher, session, engine = await served(tiny_model_dir)
    stream = await chat.stream(session, request(stream=True))
    await stream.ended()  # the client left; the backend never finishes
    await asyncio.wait_for(backend.first_sent.wait(), WAIT)
    await asyncio.wait_for(engine.close(), WAIT)
    assert publisher.events == [] and session.users == 0 and backend.in_flight == 0
