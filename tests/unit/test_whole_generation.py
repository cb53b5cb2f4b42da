"""A client that does not stream gets a backend generation asked for whole (one chunk); stop
strings keep the stream, so the backend stops at the first match; a streamed client's text
deltas, written from a template, are the chunks the models would serialize."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from gateway.backends.interface import GenerationChunk, SamplingParams
from gateway.core.aggregate import SessionState
from gateway.core.session_store import SessionStore
from gateway.metrics import GatewayMetrics
from gateway.protocol import ChatCompletionRequest
from gateway.protocol.chat import ChatCompletionChunk, ChunkChoice, Delta
from gateway.protocol.sse import sse
from gateway.serving import ChatServing, TurnEngine, TurnServing
from gateway.templates import ChatTemplate
from gateway.tools import get_parser
from schemas.events import TurnCompleted

REPLY = 'Line one.\nSTOP here "quoted" é, then more.'


class _Receipt:
    seq, duplicate = 1, False


class _Publisher:
    def __init__(self) -> None:
        self.events: list[Any] = []

    async def publish(self, event: Any) -> _Receipt:
        self.events.append(event)
        return _Receipt()


class _Backend:
    """Answers REPLY (then the end of turn): in one chunk when asked for the completion whole,
    else a chunk per token, as an HTTP backend would; records what it was asked."""

    id, max_context = "fake", 4096

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids
        self.params: list[SamplingParams] = []
        self.yielded = 0

    async def generate(
        self, prompt: Any, params: SamplingParams, *, session: str | None = None
    ) -> AsyncIterator[GenerationChunk]:
        self.params.append(params)
        logprobs = [-0.01 * (i + 1) for i in range(len(self.ids))]
        if not params.stream:
            self.yielded += len(self.ids)
            yield GenerationChunk(list(self.ids), logprobs, None, "stop")
            return
        for i, token in enumerate(self.ids):
            self.yielded += 1
            last = i == len(self.ids) - 1
            yield GenerationChunk([token], [logprobs[i]], None, "stop" if last else None)

    async def admit(self, params: SamplingParams) -> str | None:
        return None

    async def close(self) -> None:
        return None


async def _create() -> tuple[SessionState, int]:
    return SessionState(run="run", id="s"), 0


async def serving(tiny_model_dir: Path) -> tuple[ChatServing, _Backend, _Publisher, Any]:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    template = ChatTemplate(tokenizer)
    ids = [*tokenizer.encode(REPLY, add_special_tokens=False), *template.stop_token_ids[:1]]
    backend, publisher = _Backend(ids), _Publisher()
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
    return ChatServing(TurnServing(engine, store)), backend, publisher, session


def request(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 64, **fields}
    )


async def test_a_client_that_does_not_stream_gets_one_whole_generation(
    tiny_model_dir: Path,
) -> None:
    chat, backend, publisher, session = await serving(tiny_model_dir)
    reply = await chat.complete(session, request())
    [params] = backend.params
    assert params.stream is False
    [event] = publisher.events
    assert isinstance(event, TurnCompleted)
    assert event.completion_ids.tolist() == backend.ids
    assert reply.choices[0].message.content == REPLY
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens == len(backend.ids)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_stop_strings_keep_the_stream_and_end_it_at_the_first_match(
    tiny_model_dir: Path, stream: bool
) -> None:
    """The backend stops at the match (it would otherwise generate up to max_tokens); the
    recorded tokens are those sampled up to it, the text is cut before it."""
    chat, backend, publisher, session = await serving(tiny_model_dir)
    if stream:
        out = [c async for c in await chat.stream(session, request(stop=["STOP"], stream=True))]
        assert b'"finish_reason":"stop"' in b"".join(out)
    else:
        reply = await chat.complete(session, request(stop=["STOP"]))
        assert reply.choices[0].message.content == "Line one.\n"
        assert reply.choices[0].finish_reason == "stop"
    assert [p.stream for p in backend.params] == [True]
    [event] = publisher.events
    recorded = event.completion_ids.tolist()
    assert backend.yielded == len(recorded) < len(backend.ids)
    assert recorded == backend.ids[: len(recorded)]
    assert event.text == "Line one.\n"


async def test_streamed_text_deltas_are_the_chunks_the_models_serialize(
    tiny_model_dir: Path,
) -> None:
    chat, backend, _, session = await serving(tiny_model_dir)
    parts = [c async for c in await chat.stream(session, request(stream=True))]
    [params] = backend.params
    assert params.stream is True
    events = b"".join(parts).split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""]
    chunks = [json.loads(e.removeprefix(b"data: ")) for e in events[:-2]]
    # Every text delta, as the wire models would write it (pydantic), field for field.
    texts = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert "".join(c["choices"][0]["delta"]["content"] for c in texts) == REPLY
    for chunk in texts:
        model = ChatCompletionChunk.build(
            id=chunk["id"],
            created=chunk["created"],
            model="tiny",
            choices=[
                ChunkChoice.build(
                    delta=Delta.build(content=chunk["choices"][0]["delta"]["content"])
                )
            ],
        )
        assert chunk == json.loads(sse(model).removeprefix(b"data: "))


@pytest.mark.parametrize(
    ("tools", "empty"),
    [(False, False), (True, False), (False, True)],
    ids=["text", "tools", "empty"],
)
async def test_a_resent_request_gets_the_reply_the_turn_was_answered_with(
    tiny_model_dir: Path, tools: bool, empty: bool
) -> None:
    """One constructor (``TurnResult.of``) makes the live result and the recorded one: the
    reply to a resend is the first reply, field for field (its creation time aside), an empty
    one too (content "", not null)."""
    chat, backend, publisher, session = await serving(tiny_model_dir)
    if empty:
        backend.ids = backend.ids[-1:]  # the end of turn alone
    offered = {"type": "function", "function": {"name": "f", "parameters": {}}}
    asked = request(**({"tools": [offered]} if tools else {}))
    first = await chat.complete(session, asked)
    again = await chat.complete(session, asked)
    assert len(publisher.events) == 1 and len(backend.params) == 1  # one turn, one generation
    assert again.model_dump(exclude={"created"}) == first.model_dump(exclude={"created"})
    assert (first.choices[0].message.content == "") is empty
