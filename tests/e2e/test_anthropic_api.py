"""The Anthropic Messages API as Claude Code and the ``anthropic`` SDK use it: a real gateway
process, the real SDK, the tiny model fitted to call ``get_weather``, a real nats-server.

The SDK appends ``/v1/messages`` to its base URL: a session's Anthropic base URL is
``<gateway>/sessions/<sid>``, or the gateway itself with Claude Code's session header.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest

from eventlog.server import NatsServer
from schemas import SessionOpened, TurnCompleted
from tests.e2e.test_gateway import FAST_PUBLISH, events_of, full_prompts, turns_of
from tests.helpers.gateway_process import GatewayProcess
from tests.helpers.tiny_model import WEATHER_QUESTION, WEATHER_RESULT, WEATHER_TOOLS

pytestmark = pytest.mark.integration

# The fitted model's tool, as Anthropic tools: the same function tool once translated.
TOOLS: list[Any] = [
    {
        "name": t["function"]["name"],
        "description": t["function"]["description"],
        "input_schema": t["function"]["parameters"],
    }
    for t in WEATHER_TOOLS
]
QUESTION: list[Any] = [dict(m) for m in WEATHER_QUESTION]
GET_WEATHER: Any = {"type": "tool", "name": "get_weather"}
# anthropic 2.x's create() has no temperature parameter (Anthropic's newest models take none);
# the gateway takes it (0..1) and Claude Code may send it: extra_body carries it.
GREEDY: dict[str, Any] = {
    "model": "tiny",
    "max_tokens": 96,
    "tools": TOOLS,
    "extra_body": {"temperature": 0},
}


@pytest.fixture(scope="module")
def gateway(
    nats_server: NatsServer, tool_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    process = GatewayProcess(
        nats_server.url, tool_model_dir, tmp_path_factory.mktemp("gateway"), *FAST_PUBLISH
    )
    yield process
    process.stop()


def session_client(gateway: GatewayProcess) -> tuple[anthropic.Anthropic, str]:
    sid = str(gateway.session()["session_id"])
    client = anthropic.Anthropic(
        base_url=f"{gateway.url}/sessions/{sid}", api_key="unused", max_retries=0
    )
    return client, sid


def header_client(gateway: GatewayProcess, sid: str) -> anthropic.Anthropic:
    """As Claude Code: ANTHROPIC_BASE_URL=<gateway>, its own session header."""
    return anthropic.Anthropic(
        base_url=gateway.url,
        api_key="unused",
        max_retries=0,
        default_headers={"X-Claude-Code-Session-Id": sid},
    )


def answered(reply: anthropic.types.Message) -> list[Any]:
    """The reply as the agent sends it back, then the tool's result for each call."""
    assistant = {"role": "assistant", "content": [b.model_dump() for b in reply.content]}
    results = [
        {"type": "tool_result", "tool_use_id": b.id, "content": WEATHER_RESULT, "is_error": False}
        for b in reply.content
        if b.type == "tool_use"
    ]
    return [assistant, {"role": "user", "content": results}]


def only_call(reply: anthropic.types.Message) -> anthropic.types.ToolUseBlock:
    [call] = [b for b in reply.content if b.type == "tool_use"]
    return call


def error_of(exc: anthropic.APIStatusError) -> str:
    """The error type of an Anthropic error body (and that the body is one)."""
    body = exc.body
    assert isinstance(body, dict) and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"} and body["error"]["message"]
    return str(body["error"]["type"])


def assert_extends(turns: list[TurnCompleted]) -> None:
    """Tokens in, tokens out: each turn continues the previous one (no fork)."""
    prompts = full_prompts(turns)
    for t in range(1, len(turns)):
        assert turns[t].prefix_len == len(prompts[t - 1]) + len(turns[t - 1].completion_ids)


def test_a_tool_call_and_its_result_are_two_turns_of_one_trajectory(
    gateway: GatewayProcess, nats_server: NatsServer
) -> None:
    client, sid = session_client(gateway)
    ask = GREEDY
    first = client.messages.create(**ask, messages=QUESTION, tool_choice={"type": "any"})
    assert first.stop_reason == "tool_use" and first.stop_sequence is None
    call = only_call(first)
    assert (call.name, call.input) == ("get_weather", {"city": "Paris"})

    again = client.messages.create(**ask, messages=QUESTION, tool_choice={"type": "any"})
    assert again == first, "a resent request gets the recorded message back"
    assert len(turns_of(events_of(nats_server, sid))) == 1

    messages = [*QUESTION, *answered(first)]
    second = client.messages.create(**ask, messages=messages)
    assert second.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in second.content] == ["text"]

    turns = turns_of(events_of(nats_server, sid))
    assert [t.turn for t in turns] == [0, 1]
    assert_extends(turns)
    assert turns[1].prefix_len > 0
    assert [m["role"] for m in turns[1].new_messages] == ["tool"]
    assert turns[1].new_messages[0]["tool_call_id"] == call.id == turns[0].tool_calls[0]["id"]
    assert turns[0].request["api"] == "messages"
    assert turns[0].sampling["tool_choice"] == "required"
    for reply, turn in zip((first, second), turns, strict=True):
        assert reply.usage.output_tokens == len(turn.completion_ids)
        assert reply.usage.input_tokens == turn.prefix_len + len(turn.prompt_ids)
    assert second.content[0].type == "text" and second.content[0].text == turns[1].text
    assert first.id != second.id


def test_streams_through_the_global_route_with_claude_codes_session_header(
    gateway: GatewayProcess, nats_server: NatsServer
) -> None:
    sid = "claude-code-6c2e0d1a-5b0f-4a57-9d62-3a1f0e2b7c44"
    client = header_client(gateway, sid)
    ask = GREEDY
    with client.messages.stream(**ask, messages=QUESTION, tool_choice=GET_WEATHER) as stream:
        streamed_text = "".join(stream.text_stream)
        first = stream.get_final_message()
    assert first.stop_reason == "tool_use" and streamed_text == ""
    assert [b.type for b in first.content] == ["tool_use"]
    assert only_call(first).input == {"city": "Paris"}

    messages = [*QUESTION, *answered(first)]
    with client.messages.stream(**ask, messages=messages) as stream:
        streamed_text = "".join(stream.text_stream)
        second = stream.get_final_message()
    assert second.stop_reason in ("end_turn", "max_tokens")
    assert streamed_text and second.content[0].type == "text"
    assert second.content[0].text == streamed_text

    # the same request again (a retry after a cut stream): the recorded turn, streamed again
    with client.messages.stream(**ask, messages=messages) as stream:
        replayed = stream.get_final_message()
    assert replayed == second

    events = events_of(nats_server, sid)
    assert isinstance(events[0], SessionOpened)
    turns = turns_of(events)
    assert len(turns) == 2
    assert_extends(turns)
    assert turns[1].text == streamed_text
    assert second.usage.output_tokens == len(turns[1].completion_ids)
    assert second.usage.input_tokens == turns[1].prefix_len + len(turns[1].prompt_ids)
    assert first.content[0].type == "tool_use"
    assert first.content[0].id == turns[0].tool_calls[0]["id"]


def test_a_stop_sequence_ends_the_reply_and_is_named(
    gateway: GatewayProcess, nats_server: NatsServer
) -> None:
    ask = GREEDY
    client, _ = session_client(gateway)
    first = client.messages.create(**ask, messages=QUESTION, tool_choice=GET_WEATHER)
    messages = [*QUESTION, *answered(first)]
    answer = client.messages.create(**ask, messages=messages)
    text = answer.content[0].text if answer.content[0].type == "text" else ""
    assert len(text) > 8
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = text[: text.find(stop)]

    other, sid = session_client(gateway)
    other.messages.create(**ask, messages=QUESTION, tool_choice=GET_WEATHER)
    stopped = other.messages.create(**ask, messages=messages, stop_sequences=["never", stop])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)
    assert stopped.content[0].type == "text" and stopped.content[0].text == cut
    with other.messages.stream(**ask, messages=messages, stop_sequences=["never", stop]) as s:
        replayed = s.get_final_message()
    assert (replayed.stop_reason, replayed.stop_sequence) == ("stop_sequence", stop)
    assert len(turns_of(events_of(nats_server, sid))) == 2


def test_count_tokens_is_the_rendered_prompt(
    gateway: GatewayProcess, nats_server: NatsServer
) -> None:
    client, sid = session_client(gateway)
    counted = client.messages.count_tokens(model="tiny", messages=QUESTION, tools=TOOLS)
    client.messages.create(model="tiny", max_tokens=4, messages=QUESTION, tools=TOOLS)
    [turn] = turns_of(events_of(nats_server, sid))
    assert counted.input_tokens == len(turn.prompt_ids) > 0
    anywhere = anthropic.Anthropic(base_url=gateway.url, api_key="x", max_retries=0)
    assert anywhere.messages.count_tokens(model="tiny", messages=QUESTION, tools=TOOLS) == counted


# -- errors ----------------------------------------------------------------------------------


def test_errors_are_anthropic_bodies_and_the_sdks_typed_errors(gateway: GatewayProcess) -> None:
    client, sid = session_client(gateway)
    ok: dict[str, Any] = {"model": "tiny", "max_tokens": 4, "messages": QUESTION}

    image = [
        {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}
    ]
    with pytest.raises(anthropic.BadRequestError, match="not an image URL the gateway") as bad:
        client.messages.create(**{**ok, "messages": image})
    assert bad.value.status_code == 400
    assert error_of(bad.value) == "invalid_request_error"
    png = (  # one red pixel
        "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC"
    )
    source = {"type": "base64", "media_type": "image/png", "data": png}
    shown = [{"role": "user", "content": [{"type": "image", "source": source}]}]
    with pytest.raises(anthropic.BadRequestError, match="takes no images"):  # a text model
        client.messages.create(**{**ok, "messages": shown})
    with pytest.raises(anthropic.BadRequestError, match="top_k"):
        client.messages.create(**ok, extra_body={"top_k": 5})
    with pytest.raises(anthropic.BadRequestError, match="server_tool_use"):
        client.messages.create(
            **{**ok, "messages": [{"role": "assistant", "content": [{"type": "server_tool_use"}]}]}
        )

    with pytest.raises(anthropic.NotFoundError, match="claude-opus") as unknown:
        client.messages.create(**{**ok, "model": "claude-opus-5-5"})
    assert error_of(unknown.value) == "not_found_error"
    with pytest.raises(anthropic.NotFoundError, match="claude-opus"):
        header_client(gateway, "never-opened").messages.create(**{**ok, "model": "claude-opus-5-5"})
    missing = anthropic.Anthropic(
        base_url=f"{gateway.url}/sessions/nope", api_key="x", max_retries=0
    )
    with pytest.raises(anthropic.NotFoundError, match="no session 'nope'"):
        missing.messages.create(**ok)

    too_long = [{"role": "user", "content": "x" * 5000}]
    # Anthropic's answer to a prompt over the context (Claude Code compacts when it reads it)
    with pytest.raises(anthropic.BadRequestError, match=r"prompt is too long: .*context") as big:
        client.messages.create(**{**ok, "messages": too_long})
    assert big.value.status_code == 400
    assert error_of(big.value) == "invalid_request_error"

    no_header = httpx.post(f"{gateway.url}/v1/messages?beta=true", json=ok)
    assert no_header.status_code == 400
    assert no_header.json()["type"] == "error"
    assert "X-Claude-Code-Session-Id" in no_header.json()["error"]["message"]
    malformed = httpx.post(
        f"{gateway.url}/sessions/{sid}/v1/messages",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert malformed.status_code == 400 and malformed.json()["type"] == "error"

    assert httpx.post(f"{gateway.url}/v1/sessions/{sid}/close").status_code == 200
    with pytest.raises(anthropic.ConflictError, match="is closed"):
        client.messages.create(**ok)


def test_the_openapi_schema_documents_anthropic_error_bodies(gateway: GatewayProcess) -> None:
    schema = httpx.get(f"{gateway.url}/openapi.json").json()
    for path in ("/v1/messages", "/sessions/{session_id}/v1/messages"):
        responses = schema["paths"][path]["post"]["responses"]
        for status in ("400", "401", "404", "503"):
            ref = responses[status]["content"]["application/json"]["schema"]["$ref"]
            assert ref.endswith("/AnthropicErrorResponse"), (path, status)


def test_api_keys_come_as_x_api_key(
    nats_server: NatsServer, tool_model_dir: Path, tmp_path: Path
) -> None:
    process = GatewayProcess(nats_server.url, tool_model_dir, tmp_path, "--api-keys", '["k1"]')
    try:
        ok: dict[str, Any] = {"model": "tiny", "max_tokens": 4, "messages": QUESTION}
        headers = {"X-Claude-Code-Session-Id": "keyed-1"}
        wrong = anthropic.Anthropic(
            base_url=process.url, api_key="nope", max_retries=0, default_headers=headers
        )
        with pytest.raises(anthropic.AuthenticationError) as denied:
            wrong.messages.create(**ok)
        assert error_of(denied.value) == "authentication_error"
        right = anthropic.Anthropic(
            base_url=process.url, api_key="k1", max_retries=0, default_headers=headers
        )
        assert right.messages.create(**ok).type == "message"
    finally:
        process.stop()
