"""A generation the backend aborts mid-turn continues (issue 37, DESIGN §4): the turn's prompt
plus its tokens so far go back to the backend once it takes work again, the client gets one
answer, and each token records the policy version that sampled it. The real turn core (engine,
serving, store) on the tiny model's template; the backend is scripted (a server paused for a
weight update is what it plays: vLLM's own is in tests/deploy/test_vllm_weight_update.py, the
local backend's in tests/unit/test_local_backend.py and tests/e2e/test_weight_update.py)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from gateway.backends.interface import GenerationChunk, Prompt, SamplingParams
from gateway.core.session_store import Session, SessionStore
from gateway.errors import BackendUnavailable, GenerationInterrupted
from gateway.http.app import create_app
from gateway.metrics import GatewayMetrics
from gateway.protocol import ChatCompletionRequest
from gateway.serving import ChatServing, SessionService, TurnEngine, TurnServing
from gateway.serving.generating import continued_seed
from gateway.templates import ChatTemplate
from gateway.tools import get_parser
from schemas.events import UNKNOWN_VERSION, TurnCompleted
from tests.unit.test_chat_stream import _create, _Publisher

REPLY = "The weather in Paris is sunny today."
WAIT = 30  # seconds before a test that would hang fails instead (never reached when it works)


class _PausedServer:
    """Generates ``ids`` a token per chunk. Its first ``aborts`` generations end with "abort"
    after ``abort_after`` tokens; each continuation waits for ``resumed`` (a server paused for
    a weight update queues what it is sent). ``said``: chunks carry the version (as the local
    backend's do), else none (as vLLM's)."""

    id, max_context = "paused", 4096

    def __init__(self, ids: list[int], *, abort_after: int, aborts: int = 1, said: bool) -> None:
        self.ids = ids
        self.abort_after = abort_after
        self.aborts = aborts
        self.said = said
        self.version = 1
        self.resumed = asyncio.Event()
        self.calls: list[tuple[list[int], SamplingParams]] = []
        self.refusals = 0  # resubmissions to refuse (a server that does not queue while paused)
        # A freeze (/pause?mode=keep): before the token at this index the server stops for a
        # while (``frozen`` set), and goes on with the next version's weights.
        self.freeze_at: int | None = None
        self.frozen = asyncio.Event()
        self.continued = asyncio.Event()  # a continuation was sent
        self.whole = False  # answer a non-streamed request with one chunk at its end (as vLLM)

    async def generate(
        self, prompt: Prompt, params: SamplingParams, *, session: str | None = None
    ) -> AsyncIterator[GenerationChunk]:
        chunks = self._tokens(prompt, params)
        if params.stream or not self.whole:
            async for chunk in chunks:
                yield chunk
            return
        parts = [chunk async for chunk in chunks]
        last = parts[-1]
        ids = [i for part in parts for i in part.token_ids]
        logprobs = [p for part in parts for p in part.logprobs]
        yield GenerationChunk(ids, logprobs, None, last.finish_reason, last.weight_version)

    async def _tokens(
        self, prompt: Prompt, params: SamplingParams
    ) -> AsyncIterator[GenerationChunk]:
        self.calls.append((prompt.tolist(), params))
        continuing = len(self.calls) > 1
        if continuing:
            self.continued.set()
            if self.refusals:
                self.refusals -= 1
                raise BackendUnavailable("paused for a weight update")
            await self.resumed.wait()
        done = len(prompt) - len(self.calls[0][0])  # the tokens it was sent of the reply
        for i in range(done, min(len(self.ids), done + params.max_tokens)):
            if i == self.freeze_at:
                self.frozen.set()
                await asyncio.sleep(1.0)
                self.version += 1
            version = self.version if self.said else None
            if self.aborts and i - done == self.abort_after:
                self.aborts -= 1
                yield GenerationChunk([], [], None, "abort", version)
                return
            last = i == len(self.ids) - 1 or i - done == params.max_tokens - 1
            finish = ("stop" if i == len(self.ids) - 1 else "length") if last else None
            yield GenerationChunk([self.ids[i]], [-0.1 * (i + 1)], None, finish, version)
            await asyncio.sleep(0)

    async def admit(self, params: SamplingParams) -> str | None:
        return None

    async def close(self) -> None:
        return None


async def served(
    model_dir: Path,
    *,
    said: bool = True,
    abort_after: int = 3,
    aborts: int = 1,
    reply: str = REPLY,
    **engine: Any,
) -> tuple[ChatServing, _PausedServer, _Publisher, Session, TurnEngine, list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    template = ChatTemplate(tokenizer)
    ids = [*tokenizer.encode(reply, add_special_tokens=False), *template.stop_token_ids[:1]]
    backend = _PausedServer(ids, abort_after=abort_after, aborts=aborts, said=said)
    publisher = _Publisher()
    core = TurnEngine(
        template=template,
        backend=backend,
        publisher=publisher,  # type: ignore[arg-type]
        parser=get_parser("hermes"),
        model_name="tiny",
        metrics=GatewayMetrics(),
        weight_version=lambda: backend.version if not said else 0,
        **engine,
    )
    store = SessionStore()
    session = await store.load(("run", "s"), _create)
    assert session is not None
    return ChatServing(TurnServing(core, store)), backend, publisher, session, core, ids


def request(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "weather?"}], "max_tokens": 64, **fields}
    )


async def resume_at(backend: _PausedServer, version: int) -> None:
    """The trainer: the servers paused (the abort), new weights in, resume."""
    await backend.continued.wait()
    backend.version = version
    backend.resumed.set()


@pytest.mark.parametrize("said", [True, False], ids=["backend says", "gateway attributes"])
async def test_an_aborted_turn_continues_into_one_answer_each_token_with_its_version(
    tiny_model_dir: Path, said: bool
) -> None:
    chat, backend, publisher, session, _, ids = await served(tiny_model_dir, said=said)
    asked = chat.complete(session, request(seed=7))
    reply, _ = await asyncio.wait_for(asyncio.gather(asked, resume_at(backend, 2)), WAIT)

    assert reply.choices[0].message.content == REPLY and reply.choices[0].finish_reason == "stop"
    (event,) = publisher.events
    assert isinstance(event, TurnCompleted)
    assert event.completion_ids.tolist() == ids, "the tokens before the abort are kept"
    assert event.version_spans == [(1, 3), (2, len(ids) - 3)]
    assert event.weight_version == 1  # the oldest
    assert event.token_versions().tolist() == [1, 1, 1] + [2] * (len(ids) - 3)
    # The continuation: the prompt plus the 3 tokens so far (ids), what is left of max_tokens,
    # a seed of its own (derived from the turn's, recorded for replay).
    (prompt, params), (again, rest) = backend.calls
    assert again == prompt + ids[:3]
    assert rest.max_tokens == params.max_tokens - 3 and params.max_tokens == 64
    assert rest.seed == continued_seed(7, 3) != params.seed
    assert event.sampling["continued"] == [{"at": 3, "seed": continued_seed(7, 3)}]
    assert event.timings["interrupted_ms"] > 0


async def test_a_streamed_client_sees_one_uninterrupted_stream(tiny_model_dir: Path) -> None:
    chat, backend, publisher, session, _, ids = await served(tiny_model_dir)
    stream = await chat.stream(session, request(stream=True, logprobs=True))

    async def read() -> list[bytes]:
        return [chunk async for chunk in stream]

    events, _ = await asyncio.wait_for(asyncio.gather(read(), resume_at(backend, 2)), WAIT)
    lines = [line for e in events for line in e.split(b"\n\n") if line.startswith(b"data: {")]
    chunks = [json.loads(line.removeprefix(b"data: ")) for line in lines]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert text == REPLY and finishes.count("stop") == 1 and "abort" not in finishes
    assert not any("error" in c for c in chunks)
    (event,) = publisher.events
    assert event.completion_ids.tolist() == ids
    assert event.version_spans == [(1, 3), (2, len(ids) - 3)]


async def test_a_stop_string_across_the_abort_applies_to_the_whole_turn(
    tiny_model_dir: Path,
) -> None:
    chat, backend, _, session, _, _ = await served(tiny_model_dir, abort_after=2)
    # "weather" starts before the abort (token 2) and ends after it.
    asked = chat.complete(session, request(stop=["Paris"]))
    reply, _ = await asyncio.wait_for(asyncio.gather(asked, resume_at(backend, 2)), WAIT)
    assert reply.choices[0].message.content == "The weather in "
    assert reply.choices[0].finish_reason == "stop"


async def test_a_tool_call_cut_by_the_abort_is_parsed_from_the_whole_turn(
    tiny_model_dir: Path,
) -> None:
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    chat, backend, publisher, session, _, _ = await served(
        tiny_model_dir, reply=call, abort_after=30
    )
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    asked = chat.complete(session, request(tools=tools))
    reply, _ = await asyncio.wait_for(asyncio.gather(asked, resume_at(backend, 2)), WAIT)
    (tool_call,) = reply.choices[0].message.tool_calls or []
    assert tool_call.function.name == "get_weather"
    assert json.loads(tool_call.function.arguments) == {"city": "Paris"}
    assert reply.choices[0].finish_reason == "tool_calls"
    assert publisher.events[0].version_spans[0] == (1, 30)


async def test_max_tokens_counts_the_whole_turn(tiny_model_dir: Path) -> None:
    chat, backend, publisher, session, _, ids = await served(tiny_model_dir)
    asked = chat.complete(session, request(max_tokens=5))
    reply, _ = await asyncio.wait_for(asyncio.gather(asked, resume_at(backend, 2)), WAIT)
    (event,) = publisher.events
    assert event.completion_ids.tolist() == ids[:5] and reply.choices[0].finish_reason == "length"
    assert backend.calls[1][1].max_tokens == 2


async def test_a_backend_that_never_takes_it_again_is_a_503_and_nothing_is_recorded(
    tiny_model_dir: Path,
) -> None:
    chat, _, publisher, session, core, _ = await served(tiny_model_dir, continue_wait_s=0.3)
    with pytest.raises(GenerationInterrupted) as caught:
        await asyncio.wait_for(chat.complete(session, request()), WAIT)
    assert "--continue-wait-s" in str(caught.value) and caught.value.retry_after_s >= 1
    assert publisher.events == [] and session.state.turns == 0
    gave_up = core.metrics.interruptions.labels("gave_up")._value.get()
    assert gave_up == 1


async def test_continue_wait_0_turns_continuing_off(tiny_model_dir: Path) -> None:
    chat, backend, publisher, session, _, _ = await served(tiny_model_dir, continue_wait_s=0)
    with pytest.raises(GenerationInterrupted):
        await asyncio.wait_for(chat.complete(session, request()), WAIT)
    assert len(backend.calls) == 1 and publisher.events == [], "never sent again"


async def test_a_server_that_refuses_while_paused_is_asked_again_in_time(
    tiny_model_dir: Path,
) -> None:
    chat, backend, publisher, session, _, ids = await served(tiny_model_dir)
    backend.refusals = 2
    backend.resumed.set()
    reply = await asyncio.wait_for(chat.complete(session, request()), WAIT)
    assert reply.choices[0].message.content == REPLY and len(backend.calls) == 4
    assert publisher.events[0].completion_ids.tolist() == ids


async def test_one_version_too_many_ends_the_turn_with_version_limit(
    tiny_model_dir: Path,
) -> None:
    chat, backend, publisher, session, core, ids = await served(
        tiny_model_dir, max_versions_per_turn=1
    )
    asked = chat.complete(session, request())
    reply, _ = await asyncio.wait_for(asyncio.gather(asked, resume_at(backend, 2)), WAIT)
    (event,) = publisher.events
    assert event.finish_reason == "version_limit" and event.completion_ids.tolist() == ids[:3]
    assert event.version_spans is None and event.weight_version == 1
    assert reply.choices[0].finish_reason == "length", "the client's API has no such reason"
    assert core.metrics.interruptions.labels("version_limit")._value.get() == 1


async def test_two_aborts_at_one_version_are_one_version(tiny_model_dir: Path) -> None:
    chat, backend, publisher, session, _, ids = await served(
        tiny_model_dir, aborts=2, abort_after=2, max_versions_per_turn=1
    )
    backend.resumed.set()  # /abort_requests without a pause: the same weights go on
    reply = await asyncio.wait_for(chat.complete(session, request()), WAIT)
    (event,) = publisher.events
    assert event.completion_ids.tolist() == ids and event.version_spans is None
    assert [c["at"] for c in event.sampling["continued"]] == [2, 4]
    assert reply.choices[0].finish_reason == "stop"


async def test_a_frozen_generation_across_a_swap_marks_its_later_tokens_unknown(
    tiny_model_dir: Path,
) -> None:
    """No abort: the server froze the generation (/pause?mode=keep), swapped the weights and
    resumed, and says nothing per token. Tokens that arrived once the new version was published
    cannot be attributed: null (unknown), never guessed."""
    chat, backend, publisher, session, core, ids = await served(
        tiny_model_dir, said=False, aborts=0
    )
    backend.freeze_at = 4

    async def trainer_and_watch() -> None:
        # The trainer publishes the new version while the generation is frozen, half a second
        # after the last token before the freeze (more than the clock margin); the policy watch
        # learns it with the log's time stamp.
        await backend.frozen.wait()
        await asyncio.sleep(0.5)
        core.generating.timeline.learned(2, time.time())

    asked = chat.complete(session, request())
    reply, _ = await asyncio.wait_for(asyncio.gather(asked, trainer_and_watch()), WAIT)
    (event,) = publisher.events
    assert reply.choices[0].message.content == REPLY and len(backend.calls) == 1
    assert event.version_spans == [(1, 4), (None, len(ids) - 4)]
    assert event.token_versions().tolist() == [1] * 4 + [UNKNOWN_VERSION] * (len(ids) - 4)


@pytest.mark.parametrize(
    ("path", "body", "error_type"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "server_error"),
        (
            "/v1/messages",
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 16},
            "overloaded_error",
        ),
    ],
)
async def test_the_503_tells_the_client_when_to_try_again(
    tiny_model_dir: Path, path: str, body: dict[str, Any], error_type: str
) -> None:
    """Over HTTP: a 503 in the API's own error body, with Retry-After, and the session is free
    for the request sent again (nothing was recorded)."""
    _, backend, publisher, _, core, _ = await served(tiny_model_dir, continue_wait_s=0.2)
    sessions = SessionService(store=SessionStore(), publisher=publisher, model_name="tiny")  # type: ignore[arg-type]
    app = create_app(engine=core, sessions=sessions, default_run="run")
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
        headers = {"X-Session-Id": "s-1", "anthropic-version": "2023-06-01"}
        answer = await http.post(path, json={"model": "tiny", **body}, headers=headers)
        assert answer.status_code == 503 and int(answer.headers["retry-after"]) >= 1
        error = answer.json()["error"]
        assert error["type"] == error_type and "--continue-wait-s" in error["message"]
        assert publisher.events == [] or all(
            not isinstance(e, TurnCompleted) for e in publisher.events
        )
        backend.aborts, backend.calls = 0, []  # the server is back: the retry is served
        again = await http.post(path, json={"model": "tiny", **body}, headers=headers)
        assert again.status_code == 200


async def test_a_backend_that_aborts_every_continuation_gives_up_in_the_end(
    tiny_model_dir: Path,
) -> None:
    chat, backend, publisher, session, _, _ = await served(
        tiny_model_dir, aborts=10**6, abort_after=0
    )
    backend.resumed.set()
    with pytest.raises(GenerationInterrupted, match="65 times"):
        await asyncio.wait_for(chat.complete(session, request()), WAIT)
    assert publisher.events == [] and len(backend.calls) == 65


async def test_a_frozen_generation_answered_whole_is_unknown_from_its_first_token(
    tiny_model_dir: Path,
) -> None:
    """The same freeze, for a client that does not stream: the backend answers once, after the
    swap (vLLM's non-streamed response). That the version changed on the way is all the gateway
    can know, so every token is unknown; the version current as the answer arrived (2) would be
    a guess, and a wrong one for the tokens before the freeze."""
    chat, backend, publisher, session, core, ids = await served(
        tiny_model_dir, said=False, aborts=0
    )
    backend.freeze_at, backend.whole = 4, True

    async def trainer_and_watch() -> None:
        await backend.frozen.wait()
        core.generating.timeline.learned(2, time.time())

    asked = chat.complete(session, request())
    reply, _ = await asyncio.wait_for(asyncio.gather(asked, trainer_and_watch()), WAIT)
    (event,) = publisher.events
    assert reply.choices[0].message.content == REPLY and len(backend.calls) == 1
    assert backend.calls[0][1].stream is False
    assert event.version_spans == [(None, len(ids))]
    assert event.token_versions().tolist() == [UNKNOWN_VERSION] * len(ids)
