"""The gateway as agents use it: a real `turnstream gateway` process, the real `openai` SDK,
the tiny local model (overfit to call a tool), and a real nats-server holding the events.

What the client received is compared, token for token, with what the log recorded.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from transformers import AutoTokenizer

from eventlog import connect, read_session
from eventlog.server import NatsServer
from schemas import SessionClosed, SessionEvent, SessionOpened, TurnCompleted
from tests.helpers.gateway_process import GatewayProcess
from tests.helpers.tiny_model import TOOLS, WEATHER_QUESTION, WEATHER_RESULT

pytestmark = pytest.mark.integration

FAST_PUBLISH = ("--publisher.ack-timeout-s", "1", "--publisher.max-attempts", "3")


@pytest.fixture(scope="module")
def gateway(
    nats_server: NatsServer, tool_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    process = GatewayProcess(
        nats_server.url, tool_model_dir, tmp_path_factory.mktemp("gateway"), *FAST_PUBLISH
    )
    yield process
    process.stop()


@pytest.fixture(scope="module")
def tokenizer(tool_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tool_model_dir)


async def read_events(server: NatsServer, session: str, run: str = "e2e") -> list[SessionEvent]:
    nc = await connect(server.url)
    try:
        return await read_session(nc.jetstream(), run, session)
    finally:
        await nc.close()


def events_of(server: NatsServer, session: str, run: str = "e2e") -> list[SessionEvent]:
    return asyncio.run(read_events(server, session, run))


def turns_of(events: list[SessionEvent]) -> list[TurnCompleted]:
    return sorted((e for e in events if isinstance(e, TurnCompleted)), key=lambda e: e.turn)


def full_prompts(turns: list[TurnCompleted]) -> list[list[int]]:
    prompts: list[list[int]] = []
    context: list[int] = []
    for turn in turns:
        prompt = context[: turn.prefix_len] + turn.prompt_ids.tolist()
        prompts.append(prompt)
        context = prompt + turn.completion_ids.tolist()
    return prompts


def client_for(session: dict[str, Any]) -> openai.OpenAI:
    return openai.OpenAI(base_url=str(session["base_url"]), api_key="unused", max_retries=0)


def assistant_turn(message: Any) -> dict[str, Any]:
    """The reply as an agent sends it back next turn."""
    return dict(message.model_dump(exclude_none=True))


def answered(messages: list[dict[str, Any]], message: Any, ask: str) -> None:
    """The agent's next request: the reply, then the tool results it asked for, else ``ask``."""
    messages.append(assistant_turn(message))
    if message.tool_calls:
        messages += [
            {"role": "tool", "tool_call_id": c.id, "content": WEATHER_RESULT}
            for c in message.tool_calls
        ]
    else:
        messages.append({"role": "user", "content": ask})


def test_a_four_turn_session_is_recorded_token_for_token(
    gateway: GatewayProcess, nats_server: NatsServer, tokenizer: Any
) -> None:
    session = gateway.session(group="weather-1", metadata={"task": "weather"})
    client = client_for(session)
    messages: list[dict[str, Any]] = [*WEATHER_QUESTION]
    replies = []
    for t in range(4):
        reply = client.chat.completions.create(
            model="tiny",
            messages=messages,
            tools=TOOLS,
            temperature=0,
            max_tokens=96,
            logprobs=True,
            top_logprobs=2,
        )
        replies.append(reply)
        answered(messages, reply.choices[0].message, f"And on day {t + 1}?")
    closed = httpx.post(f"{gateway.url}/v1/sessions/{session['session_id']}/close", json={})
    assert closed.status_code == 200 and closed.json()["status"] == "completed"

    events = events_of(nats_server, str(session["session_id"]))
    turns = turns_of(events)
    assert isinstance(events[0], SessionOpened) and events[0].group == "weather-1"
    assert isinstance(events[-1], SessionClosed) and events[-1].num_turns == 4
    assert [t.turn for t in turns] == [0, 1, 2, 3]
    prompts = full_prompts(turns)
    for t in range(1, 4):
        # tokens in, tokens out: the prompt extends the previous prompt + sampled completion
        previous = prompts[t - 1] + turns[t - 1].completion_ids.tolist()
        assert prompts[t][: len(previous)] == previous
        assert turns[t].prefix_len == len(previous)
        # only what the agent added: the reply is already in the previous turn's conversation
        assert [m["role"] for m in turns[t].new_messages] in (["tool"], ["user"])
    for reply, turn in zip(replies, turns, strict=True):
        choice = reply.choices[0]
        assert reply.usage is not None
        assert reply.usage.completion_tokens == len(turn.completion_ids)
        assert reply.usage.prompt_tokens == turn.prefix_len + len(turn.prompt_ids)
        assert choice.logprobs is not None and choice.logprobs.content is not None
        assert np.allclose([c.logprob for c in choice.logprobs.content], turn.logprobs, atol=1e-6)
        text = tokenizer.decode(turn.completion_ids.tolist(), skip_special_tokens=True)
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            assert "<tool_call>" in text
        else:
            assert choice.message.content == text
    first = replies[0].choices[0]
    assert first.finish_reason == "tool_calls", "the overfit model calls its tool on turn 0"
    assert first.message.tool_calls is not None
    assert first.message.tool_calls[0].function.name == "get_weather"
    assert turns[0].tool_calls[0]["function"]["name"] == "get_weather"


async def test_async_streaming_records_exactly_the_streamed_tokens(
    gateway: GatewayProcess, nats_server: NatsServer, tokenizer: Any
) -> None:
    session = gateway.session()
    client = openai.AsyncOpenAI(base_url=str(session["base_url"]), api_key="x", max_retries=0)
    messages: list[dict[str, Any]] = [*WEATHER_QUESTION]
    streamed: list[tuple[str, list[Any], str | None, Any]] = []
    for _ in range(2):
        stream = await client.chat.completions.create(
            model="tiny",
            messages=messages,
            tools=TOOLS,
            temperature=0,
            max_tokens=96,
            stream=True,
            stream_options={"include_usage": True},
        )
        content, calls, finish, usage = "", [], None, None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                content += choice.delta.content or ""
                calls += choice.delta.tool_calls or []
                finish = choice.finish_reason or finish
        streamed.append((content, calls, finish, usage))
        reply: dict[str, Any] = {"role": "assistant", "content": content or None}
        if calls:
            reply["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": c.function.arguments},
                }
                for c in calls
            ]
        messages.append(reply)
        messages += [
            {"role": "tool", "tool_call_id": c.id, "content": WEATHER_RESULT} for c in calls
        ]
        if not calls:
            messages.append({"role": "user", "content": "Thanks. Tomorrow?"})
    await client.close()

    turns = turns_of(await read_events(nats_server, str(session["session_id"])))
    assert len(turns) == 2
    for (content, calls, finish, usage), turn in zip(streamed, turns, strict=True):
        assert usage is not None and usage.completion_tokens == len(turn.completion_ids)
        assert finish == turn.finish_reason
        assert content == (turn.text or "")
        assert [c.function.name for c in calls] == [c["function"]["name"] for c in turn.tool_calls]
    assert streamed[0][2] == "tool_calls"
    assert turns[1].prefix_len == len(full_prompts(turns)[0]) + len(turns[0].completion_ids)


def test_x_session_id_header_opens_the_session_implicitly(
    gateway: GatewayProcess, nats_server: NatsServer
) -> None:
    client = openai.OpenAI(
        base_url=f"{gateway.url}/v1",
        api_key="x",
        max_retries=0,
        default_headers={"X-Session-Id": "hdr-session-1"},
    )
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=8, seed=3
    )
    assert reply.choices[0].finish_reason in ("stop", "length")
    events = events_of(nats_server, "hdr-session-1")
    assert isinstance(events[0], SessionOpened)
    assert [type(e) for e in events[1:]] == [TurnCompleted]
    models = client.models.list()
    assert [m.id for m in models.data] == [reply.model]


def test_completions_take_token_ids_and_record_them(
    gateway: GatewayProcess, nats_server: NatsServer
) -> None:
    session = gateway.session()
    client = client_for(session)
    ids = [72, 101, 108, 108, 111]
    reply = client.completions.create(
        model="tiny", prompt=ids, max_tokens=6, temperature=0, logprobs=1
    )
    [turn] = turns_of(events_of(nats_server, str(session["session_id"])))
    assert turn.prompt_ids.tolist() == ids
    assert reply.usage is not None and reply.usage.completion_tokens == len(turn.completion_ids)
    assert reply.choices[0].logprobs is not None
    assert np.allclose(reply.choices[0].logprobs.token_logprobs or [], turn.logprobs, atol=1e-6)


# -- errors --------------------------------------------------------------------------------------


def test_every_error_has_its_status_and_an_openai_body(gateway: GatewayProcess) -> None:
    session = gateway.session()
    chat = f"{session['base_url']}/chat/completions"
    ok_body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

    malformed = httpx.post(chat, content=b"{not json", headers={"content-type": "application/json"})
    assert malformed.status_code == 400
    assert malformed.json()["error"]["type"] == "invalid_request_error"

    client = client_for(session)
    with pytest.raises(openai.BadRequestError, match="temperature") as bad:
        client.chat.completions.create(model="tiny", messages=ok_body["messages"], temperature=7)
    assert bad.value.status_code == 400

    missing = openai.OpenAI(base_url=f"{gateway.url}/sessions/nope/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError, match="no session 'nope'"):
        missing.chat.completions.create(model="tiny", messages=ok_body["messages"])

    too_long = [{"role": "user", "content": "x" * 5000}]
    with pytest.raises(openai.APIStatusError, match=r"model's context length") as big:
        client.chat.completions.create(model="tiny", messages=too_long)
    assert big.value.status_code == 413

    for bad_id in ("a*b", "a.b", "x" * 65):
        wildcard = httpx.post(f"{gateway.url}/sessions/{bad_id}/v1/chat/completions", json=ok_body)
        assert wildcard.status_code == 400, wildcard.text
        assert "session_id" in wildcard.json()["error"]["message"]
        header = httpx.post(
            f"{gateway.url}/v1/chat/completions", json=ok_body, headers={"X-Session-Id": bad_id}
        )
        assert header.status_code == 400, header.text

    no_header = httpx.post(f"{gateway.url}/v1/chat/completions", json=ok_body)
    assert no_header.status_code == 400 and "X-Session-Id" in no_header.json()["error"]["message"]

    assert httpx.post(f"{gateway.url}/v1/sessions/{session['session_id']}/close").status_code == 200
    with pytest.raises(openai.ConflictError, match="is closed") as closed:
        client.chat.completions.create(model="tiny", messages=ok_body["messages"])
    assert closed.value.status_code == 409
    reward = httpx.post(
        f"{gateway.url}/v1/sessions/{session['session_id']}/reward", json={"value": 1}
    )
    assert reward.status_code == 409

    metrics = httpx.get(f"{gateway.url}/metrics").text
    assert 'turnstream_gateway_errors_total{code="413"}' in metrics
    # The event loop's lag probe runs in every gateway (gateway.loop_lag).
    wakes = re.search(r"^turnstream_gateway_event_loop_lag_seconds_count (\S+)$", metrics, re.M)
    assert wakes is not None and float(wakes.group(1)) > 0
    assert "turnstream_gateway_event_loop_lag_max_seconds " in metrics


def test_bearer_keys_guard_the_api(
    nats_server: NatsServer, tool_model_dir: Path, tmp_path: Path
) -> None:
    process = GatewayProcess(nats_server.url, tool_model_dir, tmp_path, "--api-keys", '["k1"]')
    try:
        assert httpx.get(f"{process.url}/health").status_code == 200  # open for probes
        wrong = openai.OpenAI(base_url=f"{process.url}/v1", api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
        right = openai.OpenAI(base_url=f"{process.url}/v1", api_key="k1", max_retries=0)
        assert right.models.list().data
        # Anthropic clients send their key as x-api-key
        assert httpx.get(f"{process.url}/v1/models", headers={"x-api-key": "k1"}).is_success
        refused = httpx.get(f"{process.url}/v1/models", headers={"x-api-key": "nope"})
        assert refused.status_code == 401 and "x-api-key" in refused.json()["error"]["message"]
    finally:
        process.stop()


def test_a_paused_log_delays_the_answer_and_loses_nothing(
    gateway: GatewayProcess, nats_server: NatsServer
) -> None:
    session = gateway.session()
    client = client_for(session)
    ask = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    results: list[Any] = []

    nats_server.pause()
    worker = threading.Thread(
        target=lambda: results.append(_outcome(lambda: client.chat.completions.create(**ask)))
    )
    worker.start()
    threading.Event().wait(1.5)
    nats_server.resume()
    worker.join(60)

    [outcome] = results
    turns = turns_of(events_of(nats_server, str(session["session_id"])))
    if isinstance(outcome, openai.APIStatusError):
        assert outcome.status_code == 503  # told to retry: then nothing may be recorded as received
    else:
        assert [t.turn for t in turns] == [0], "a turn the client received must be in the log"
        assert outcome.usage.completion_tokens == len(turns[0].completion_ids)


def test_an_unreachable_log_answers_503_and_the_session_goes_on(
    gateway: GatewayProcess, nats_server: NatsServer
) -> None:
    session = gateway.session()
    client = client_for(session)
    ask = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    nats_server.kill()
    try:
        with pytest.raises(openai.APIStatusError, match="did not acknowledge") as down:
            client.chat.completions.create(**ask)
        assert down.value.status_code == 503
    finally:
        nats_server.restart()
    reply = client.chat.completions.create(**ask)  # the publisher reconnects
    turns = turns_of(events_of(nats_server, str(session["session_id"])))
    # The 503'd attempt may reach the log after all (nats-py flushes what it buffered while
    # disconnected): then it keeps turn 0 and the reply is turn 1. Either way the log's last
    # turn is exactly what the client received.
    assert [t.turn for t in turns] in ([0], [0, 1])
    assert reply.usage is not None and reply.choices[0].message.content is not None
    assert turns[-1].text == reply.choices[0].message.content
    assert len(turns[-1].completion_ids) == reply.usage.completion_tokens


def _outcome(call: Any) -> Any:
    try:
        return call()
    except openai.APIStatusError as exc:
        return exc


@pytest.mark.parametrize(
    "choice",
    ["required", {"type": "function", "function": {"name": "get_weather"}}],
    ids=["required", "named"],
)
def test_tool_choice_forces_a_call_with_the_forced_tokens_in_the_prompt(
    gateway: GatewayProcess, nats_server: NatsServer, tokenizer: Any, choice: Any
) -> None:
    session = gateway.session()
    reply = client_for(session).chat.completions.create(
        model="tiny",
        messages=WEATHER_QUESTION,
        tools=TOOLS,
        tool_choice=choice,
        temperature=0,
        max_tokens=96,
    )
    assert reply.choices[0].finish_reason == "tool_calls"
    [call] = reply.choices[0].message.tool_calls or []
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    [turn] = turns_of(events_of(nats_server, str(session["session_id"])))
    prompt = tokenizer.decode(turn.prompt_ids.tolist(), skip_special_tokens=False)
    forced = "<tool_call>\n" + (
        "" if choice == "required" else '{"name": "get_weather", "arguments": '
    )
    # the call's opening is the gateway's doing: prompt tokens (loss mask 0), not sampled ones
    assert prompt.endswith("<|im_start|>assistant\n" + forced)
    assert turn.sampling["tool_choice"] == choice


def test_a_policy_update_in_the_log_reloads_the_served_weights(
    gateway: GatewayProcess, nats_server: NatsServer, tool_model_dir: Path
) -> None:
    async def publish_policy(version: int) -> None:
        nc = await connect(nats_server.url)
        try:
            kv = await nc.jetstream().key_value("ts_policy")
            checkpoint = str(tool_model_dir / "model.safetensors")
            await kv.put("e2e", json.dumps({"version": version, "checkpoint": checkpoint}).encode())
        finally:
            await nc.close()

    asyncio.run(publish_policy(7))
    deadline = time.monotonic() + 30
    while httpx.get(f"{gateway.url}/health").json()["weight_version"] != 7:
        assert time.monotonic() < deadline, "the gateway did not load version 7"
        time.sleep(0.1)
    session = gateway.session()
    client_for(session).chat.completions.create(
        model="tiny", messages=WEATHER_QUESTION, max_tokens=4
    )
    [turn] = turns_of(events_of(nats_server, str(session["session_id"])))
    assert turn.weight_version == 7


def test_a_restarted_gateway_continues_a_session_from_the_log(
    gateway: GatewayProcess, nats_server: NatsServer, tool_model_dir: Path, tmp_path: Path
) -> None:
    session = gateway.session()
    messages: list[dict[str, Any]] = [*WEATHER_QUESTION]
    first = client_for(session).chat.completions.create(
        model="tiny", messages=messages, tools=TOOLS, temperature=0, max_tokens=96
    )
    messages.append(assistant_turn(first.choices[0].message))
    messages += [
        {"role": "tool", "tool_call_id": c.id, "content": WEATHER_RESULT}
        for c in first.choices[0].message.tool_calls or []
    ]

    # Another gateway process (a restart, or a second replica) has none of it in memory.
    other = GatewayProcess(nats_server.url, tool_model_dir, tmp_path, *FAST_PUBLISH)
    try:
        again = openai.OpenAI(
            base_url=f"{other.url}/v1",
            api_key="x",
            max_retries=0,
            default_headers={"X-Session-Id": str(session["session_id"])},
        )
        again.chat.completions.create(
            model="tiny", messages=messages, tools=TOOLS, temperature=0, max_tokens=40
        )
        described = httpx.get(f"{other.url}/v1/sessions/{session['session_id']}").json()
    finally:
        other.stop()

    assert described["turns"] == 2
    turns = turns_of(events_of(nats_server, str(session["session_id"])))
    assert [t.turn for t in turns] == [0, 1], "turn 1 must not reuse turn 0's Msg-Id"
    context = full_prompts(turns)[0] + turns[0].completion_ids.tolist()
    assert turns[1].prefix_len == len(context)  # still tokens in, tokens out
    assert [m["role"] for m in turns[1].new_messages] == ["tool"]


def test_max_tokens_is_a_cap_lowered_to_the_room_left(
    gateway: GatewayProcess, nats_server: NatsServer
) -> None:
    """Agents ask for 32k-64k tokens whatever the model (DESIGN §4): served, not refused."""
    session = gateway.session()
    reply = client_for(session).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=1_000_000, stop="a"
    )
    assert reply.choices[0].finish_reason in ("stop", "length")
    (turn,) = turns_of(events_of(nats_server, str(session["session_id"])))
    room = 4096 - (turn.prefix_len + len(turn.prompt_ids))
    assert turn.sampling["max_tokens"] == room
    assert turn.sampling["max_tokens_requested"] == 1_000_000


# -- the turn core's rules on Chat Completions (issue 17) -------------------------------------


def test_a_resent_request_gets_the_recorded_turn_and_adds_none(
    gateway: GatewayProcess, nats_server: NatsServer
) -> None:
    """A client's retry (after a 5xx, a cut stream, a lost reply) is the same request again:
    it is answered with the turn the log holds, streamed or not, and is not a turn of its own."""
    session = gateway.session()
    client = client_for(session)
    ask: dict[str, Any] = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 12,
        "temperature": 1.0,
        "logprobs": True,
    }
    first = client.chat.completions.create(**ask)
    again = client.chat.completions.create(**ask)
    assert again.id == first.id
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage == first.usage
    assert [t.logprob for t in again.choices[0].logprobs.content] == pytest.approx(  # type: ignore[union-attr]
        [t.logprob for t in first.choices[0].logprobs.content]  # type: ignore[union-attr]
    )
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in client.chat.completions.create(**ask, stream=True)
        if chunk.choices
    )
    assert streamed == first.choices[0].message.content
    # Another temperature is another request: a new turn (which re-renders: a fork).
    other = client.chat.completions.create(**{**ask, "temperature": 0.5})
    assert other.id != first.id
    turns = turns_of(events_of(nats_server, str(session["session_id"])))
    assert [t.turn for t in turns] == [0, 1]
    assert turns[0].request["api"] == "chat.completions"
    assert turns[0].request["temperature"] == 1.0 and turns[1].request["temperature"] == 0.5
    metrics = httpx.get(f"{gateway.url}/metrics").text
    assert 'turnstream_gateway_resent_requests_total{kind="chat.completions"}' in metrics


def test_parallel_tool_calls_false_keeps_one_call_and_is_recorded(
    gateway: GatewayProcess, nats_server: NatsServer
) -> None:
    session = gateway.session()
    reply = client_for(session).chat.completions.create(
        model="tiny",
        messages=WEATHER_QUESTION,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=96,
    )
    assert len(reply.choices[0].message.tool_calls or []) == 1
    [turn] = turns_of(events_of(nats_server, str(session["session_id"])))
    assert turn.request["parallel_tool_calls"] is False
    assert len(turn.tool_calls) == 1


def test_tool_choice_required_without_tools_is_a_400(gateway: GatewayProcess) -> None:
    session = gateway.session()
    for body in (
        {"tool_choice": "required"},
        {"tool_choice": "required", "tools": []},
        {"tool_choice": {"type": "function", "function": {"name": "f"}}, "tools": []},
    ):
        response = httpx.post(
            f"{session['base_url']}/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], **body},
        )
        assert response.status_code == 400, body
        assert response.json()["error"]["param"] == "tool_choice", response.json()


@pytest.mark.parametrize("header", ["X-Claude-Code-Session-Id", "session-id"])
def test_a_clients_own_session_header_names_the_session(
    gateway: GatewayProcess, nats_server: NatsServer, header: str
) -> None:
    sid = f"own-header-{header.lower()}"
    client = openai.OpenAI(
        base_url=f"{gateway.url}/v1", api_key="x", max_retries=0, default_headers={header: sid}
    )
    client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=4
    )
    assert [type(e) for e in events_of(nats_server, sid)] == [SessionOpened, TurnCompleted]
    bad = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        headers={header: "no spaces allowed"},
        json={"messages": [{"role": "user", "content": "hi"}]},
    )
    assert bad.status_code == 400 and header in bad.json()["error"]["message"]


def test_the_root_answers_a_probe(gateway: GatewayProcess) -> None:
    assert httpx.head(f"{gateway.url}/").status_code == 200
    assert httpx.get(f"{gateway.url}/").json()["service"] == "turnstream gateway"


def test_a_long_body_resent_each_turn_is_decoded_once_and_recorded_as_sent(
    gateway: GatewayProcess, nats_server: NatsServer
) -> None:
    """Bodies of 64 KiB or more: the messages a request resends of its client session's
    previous body are not decoded again (the metric counts it); what is recorded is what was
    sent, also when the client edits its history (a branch, not a stale kept message)."""

    def reused() -> float:
        for line in httpx.get(f"{gateway.url}/metrics").text.splitlines():
            if line.startswith('turnstream_gateway_kept_bodies_total{decoded="reused"}'):
                return float(line.split()[-1])
        return 0.0

    session = gateway.session()
    client = client_for(session)
    # An ignored field makes the body long while the conversation fits the tiny context.
    pad = {"metadata": {"note": "é\n" * 40_000}}
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hello — again"}]
    before = reused()
    for _ in range(3):
        reply = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=8, extra_body=pad
        )
        messages += [assistant_turn(reply.choices[0].message), {"role": "user", "content": "go"}]
    assert reused() - before == 2
    edited = [{"role": "user", "content": "hello — edited"}, *messages[1:]]
    client.chat.completions.create(model="tiny", messages=edited, max_tokens=8, extra_body=pad)
    turns = turns_of(events_of(nats_server, str(session["session_id"])))
    assert [t.turn for t in turns] == [0, 1, 2, 3]
    for t in (1, 2):
        previous = turns[t - 1]
        assert [m["content"] for m in turns[t].new_messages] == ["go"]
        assert turns[t].prefix_len == (
            previous.prefix_len + len(previous.prompt_ids) + len(previous.completion_ids)
        )
    assert turns[3].message_prefix_len == 0
    assert turns[3].new_messages[0]["content"] == "hello — edited"
