"""Anthropic Messages: the request models, the translation into the canonical conversation, the
message and the stream events (gateway.protocol.anthropic, gateway.serving.anthropic_service)."""

from __future__ import annotations

import asyncio
import itertools
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import anthropic.types
import pytest
from pydantic import TypeAdapter, ValidationError

from gateway.core.conversation import message_key
from gateway.decoding import Detokenizer
from gateway.errors import BackendError
from gateway.protocol.anthropic import (
    CountTokensRequest,
    MessagesRequest,
)
from gateway.serving.anthropic_service import (
    AnthropicServing,
    _MessagesEncoder,
    messages_turn_request,
    stop_reason,
    stop_sequence,
    tool_input,
)
from gateway.serving.engine import TurnEngine
from gateway.serving.turn_data import TurnResult
from schemas.errors import EventLogUnavailable
from schemas.events import TurnCompleted

FIXTURES = Path(__file__).parents[1] / "fixtures" / "agents" / "claude_code"
USER = [{"role": "user", "content": "hi"}]
TOOL = {"name": "f", "description": "does f", "input_schema": {"type": "object"}}


def request(**body: Any) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "tiny", "max_tokens": 64, **body})


def claude_code(k: int) -> MessagesRequest:
    body = json.loads((FIXTURES / f"request_{k}.json").read_text())["body"]
    return MessagesRequest.model_validate(body)


def keys(messages: list[dict[str, Any]]) -> list[tuple[object, ...]]:
    return [message_key(m) for m in messages]


# -- Claude Code's real requests ---------------------------------------------------------


def test_claude_codes_requests_extend_each_other_canonically() -> None:
    turns = [messages_turn_request(claude_code(k)) for k in (1, 2, 3)]
    for earlier, later in itertools.pairwise(turns):
        # the continuation test of the turn core: the earlier conversation is a prefix
        assert keys(later.messages)[: len(earlier.messages)] == keys(earlier.messages)
        assert later.tools == earlier.tools  # compared with ==: cache_control must not leak
        assert later.record == earlier.record
    first = turns[0].messages
    assert [m["role"] for m in first] == ["system", "user", "system"]
    # Claude Code's billing block is a header in the body: recorded, not rendered (a sub-agent's
    # says cc_is_subagent=true; rendered, a fork would share nothing with its parent's turn)
    assert "x-anthropic-billing-header" not in first[0]["content"]
    assert turns[0].record["billing_header"].startswith("x-anthropic-billing-header: cc_version=")
    body = json.loads((FIXTURES / "request_1.json").read_text())["body"]
    body["system"][0]["text"] += " cc_is_subagent=true;"
    assert messages_turn_request(MessagesRequest.model_validate(body)).messages == first
    assert "</system-reminder>\nRead notes.txt" in first[1]["content"]  # blocks joined with ""
    assert first[2]["content"].startswith("# Environment")  # blocks in request 1, a string after
    assert [m["role"] for m in turns[2].messages] == [
        *("system", "user", "system"),
        *("assistant", "tool", "assistant", "tool"),
    ]
    tools = turns[0].tools or []
    assert len(tools) == 12 and all(t["type"] == "function" for t in tools)
    bash = next(t["function"] for t in tools if t["function"]["name"] == "Bash")
    assert set(bash) == {"name", "description", "parameters"}
    assert turns[0].record["thinking"] == {"type": "adaptive", "display": "updates"}
    assert turns[0].record["output_config"] == {"effort": "medium"}
    assert turns[0].record["max_tokens"] == 128000
    assert "unoffered_tools" not in turns[0].record and "stream" not in turns[0].record


def test_the_reply_claude_code_echoes_is_the_message_the_turn_recorded() -> None:
    later = messages_turn_request(claude_code(2)).messages
    echoed = next(m for m in later if m["role"] == "assistant")
    [call] = echoed["tool_calls"]
    arguments = '{"command":"cat notes.txt","description":"Run cat"}'  # the parsers' JSON
    recorded = {  # TurnCompleted.assistant_message of the turn that sent it
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": call["id"],
                "type": "function",
                "function": {"name": "Bash", "arguments": arguments},
            }
        ],
    }
    assert message_key(echoed) == message_key(recorded)
    assert call["function"]["arguments"] == arguments  # byte for byte, for a full re-render
    [result] = [m for m in later if m["role"] == "tool"]
    assert result == {
        "role": "tool",
        "tool_call_id": call["id"],
        "content": "turnstream-probe-7391",
    }


def test_a_message_returned_by_the_gateway_comes_back_as_recorded() -> None:
    result = turn_result(
        content="Let me look.",
        tool_calls=[call("call_1", "f", '{"x":[1,"é"]}'), call("call_2", "g", "{}")],
        finish="tool_calls",
    )
    sent = sent_message(result)
    echoed = messages_turn_request(
        request(messages=[*USER, {"role": "assistant", "content": sent["content"]}])
    ).messages[-1]
    recorded = {"role": "assistant", "content": result.content, "tool_calls": result.tool_calls}
    assert message_key(echoed) == message_key(recorded)


# -- translation rules ---------------------------------------------------------------------


TEXT_FORMS = [
    "ab",
    [{"type": "text", "text": "ab"}],
    [{"type": "text", "text": "a"}, {"type": "text", "text": "b", "cache_control": {"x": 1}}],
    [{"type": "text", "text": "ab", "citations": None, "cache_control": {"type": "ephemeral"}}],
]


@pytest.mark.parametrize("content", TEXT_FORMS, ids=["string", "block", "blocks", "decorated"])
@pytest.mark.parametrize("role", ["user", "assistant", "system"])
def test_text_is_the_same_message_as_a_string_or_as_blocks(role: str, content: Any) -> None:
    messages = messages_turn_request(request(messages=[{"role": role, "content": content}]))
    assert messages.messages == [{"role": role, "content": "ab"}]


@pytest.mark.parametrize("system", TEXT_FORMS, ids=["string", "block", "blocks", "decorated"])
def test_system_is_one_leading_system_message(system: Any) -> None:
    turn = messages_turn_request(request(system=system, messages=USER))
    assert turn.messages == [{"role": "system", "content": "ab"}, *USER]


@pytest.mark.parametrize("system", [None, "", []])
def test_an_empty_system_prompt_is_no_system_message(system: Any) -> None:
    assert messages_turn_request(request(system=system, messages=USER)).messages == USER


def test_tool_results_come_first_then_the_text_of_the_user_message() -> None:
    content = [
        {"type": "text", "text": "then "},
        {"type": "tool_result", "tool_use_id": "t1", "content": "42", "is_error": True},
        {"type": "tool_result", "tool_use_id": "t2", "content": [{"type": "text", "text": "o"}]},
        {"type": "tool_result", "tool_use_id": "t3", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "this"},
    ]
    turn = messages_turn_request(request(messages=[{"role": "user", "content": content}]))
    assert turn.messages == [
        {"role": "tool", "tool_call_id": "t1", "content": "42"},
        {"role": "tool", "tool_call_id": "t2", "content": "o"},
        {"role": "tool", "tool_call_id": "t3", "content": ""},
        {"role": "user", "content": "then this"},
    ]
    only_results = [{"type": "tool_result", "tool_use_id": "t1", "content": "42"}]
    turn = messages_turn_request(request(messages=[{"role": "user", "content": only_results}]))
    assert [m["role"] for m in turn.messages] == ["tool"]


def test_assistant_blocks_become_content_and_tool_calls_and_thinking_is_dropped() -> None:
    content = [
        {"type": "thinking", "thinking": "hmm", "signature": "s"},
        {"type": "redacted_thinking", "data": "x"},
        {"type": "text", "text": "Calling."},
        {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"b": 1, "a": "é"}},
    ]
    turn = messages_turn_request(request(messages=[{"role": "assistant", "content": content}]))
    assert turn.messages == [
        {
            "role": "assistant",
            "content": "Calling.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "f", "arguments": '{"b":1,"a":"é"}'},
                }
            ],
        }
    ]
    only_call = [content[3]]
    turn = messages_turn_request(request(messages=[{"role": "assistant", "content": only_call}]))
    assert turn.messages[0]["content"] is None


def test_custom_tools_are_offered_and_server_tools_recorded_as_sent() -> None:
    server = {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}
    custom = {**TOOL, "type": "custom", "cache_control": {"type": "ephemeral"}}
    deferred = {"name": "g", "input_schema": {"type": "object"}, "defer_loading": True}
    turn = messages_turn_request(request(messages=USER, tools=[server, custom, deferred]))
    assert turn.tools == [
        {
            "type": "function",
            "function": {"name": "f", "description": "does f", "parameters": {"type": "object"}},
        },
        {"type": "function", "function": {"name": "g", "parameters": {"type": "object"}}},
    ]
    assert turn.extras["unoffered_tools"] == [server]
    only_server = messages_turn_request(request(messages=USER, tools=[server]))
    assert only_server.tools is None


@pytest.mark.parametrize(
    ("choice", "canonical", "parallel"),
    [
        ({"type": "auto"}, "auto", True),
        ({"type": "any"}, "required", True),
        ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
        ({"type": "none"}, "none", True),
        ({"type": "tool", "name": "f"}, {"type": "function", "function": {"name": "f"}}, True),
        ({"type": "auto", "disable_parallel_tool_use": True}, "auto", False),
    ],
)
def test_tool_choice_maps_to_the_canonical_choice(
    choice: dict[str, Any], canonical: object, parallel: bool
) -> None:
    turn = messages_turn_request(request(messages=USER, tools=[TOOL], tool_choice=choice))
    assert turn.tool_choice == canonical
    assert turn.parallel_tool_calls is parallel


def test_sampling_and_recorded_parameters() -> None:
    body = {
        "messages": USER,
        "max_tokens": 128000,
        "temperature": 0.5,
        "top_p": 0.9,
        "stop_sequences": ["END", "\n\n"],
        "metadata": {"user_id": "u"},
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "context_management": {"edits": []},
        "output_config": {"effort": "low"},
    }
    ignored: dict[str, Any] = {
        "service_tier": "auto",
        "container": None,
        "mcp_servers": [],
        "top_k": None,
    }
    turn = messages_turn_request(request(**body, **ignored, stream=True))
    assert (turn.api, turn.max_tokens, turn.temperature, turn.top_p) == (
        "messages",
        128000,
        0.5,
        0.9,
    )
    assert list(turn.stop) == ["END", "\n\n"]
    assert turn.extras == {
        "metadata": {"user_id": "u"},
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "context_management": {"edits": []},
        "output_config": {"effort": "low"},
    }
    # a retry, streamed or not, is the same request: the resent turn is found by its record
    assert messages_turn_request(request(**body)).record == turn.record


# -- refused by rule ---------------------------------------------------------------------


def user(*blocks: Any) -> dict[str, Any]:
    return {"role": "user", "content": list(blocks)}


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ({"messages": [user({"type": "image", "source": {}})]}, "image.source"),
        (
            {"messages": [user({"type": "image", "source": {"type": "file", "file_id": "f"}})]},
            "Files API, which this gateway does not have",
        ),
        (
            {"messages": [{"role": "assistant", "content": [{"type": "image", "source": {}}]}]},
            "images are taken in user messages and tool_result content only",
        ),
        (
            {
                "messages": [
                    user(
                        {
                            "type": "tool_result",
                            "tool_use_id": "t",
                            "content": [{"type": "document"}],
                        }
                    )
                ]
            },
            "'document': not supported by this gateway; send its content as text",
        ),
        ({"messages": USER, "system": [{"type": "image"}]}, "system block 0 has type 'image'"),
        ({"messages": [user({"type": "server_tool_use"})]}, "'server_tool_use'"),
        (
            {"messages": [{"role": "assistant", "content": [{"type": "web_search_tool_result"}]}]},
            "'web_search_tool_result'",
        ),
        (
            {"messages": [user({"type": "tool_use", "id": "a", "name": "b", "input": {}})]},
            "'tool_use'",
        ),
        (
            {
                "messages": [
                    {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "x"}]}
                ]
            },
            "'tool_result'",
        ),
        ({"messages": [user({"type": "tool_use_id"})]}, "tool_use_id"),
        ({"messages": [user(5)]}, "valid dictionary"),
        ({"messages": [{"role": "user", "content": 5}]}, "content.blocks"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "'robot'"),
        ({"messages": []}, "messages"),
        ({"messages": USER, "top_k": 40}, "top_k is not supported"),
        ({"messages": USER, "temperature": 1.5}, "temperature"),
        ({"messages": USER, "top_p": 0}, "top_p"),
        ({"messages": USER, "max_tokens": 0}, "max_tokens"),
        ({"messages": USER, "max_tokens": 2**40}, "max_tokens"),
        ({"messages": USER, "max_tokens": None}, "max_tokens"),
        ({"messages": USER, "logit_bias": {}}, "'logit_bias' is not supported"),
        ({"messages": USER, "output_format": {"type": "json_schema"}}, "'output_format'"),
        ({"messages": USER, "mcp_servers": [{"url": "x"}]}, "mcp_servers is not supported"),
        ({"messages": USER, "output_config": {"format": {"type": "json_schema"}}}, "structured"),
        ({"messages": USER, "tools": [{"name": "f"}]}, "input_schema"),
        ({"messages": USER, "tools": [{"type": "custom", "input_schema": {}}]}, "name"),
        ({"messages": USER, "tools": [5]}, "tools.0"),
        ({"messages": USER, "tools": [TOOL], "tool_choice": {"type": "tool", "name": "g"}}, "'g'"),
        ({"messages": USER, "tool_choice": {"type": "tool", "name": "g"}}, "'g'"),
        ({"messages": USER, "tool_choice": {"type": "sometimes"}}, "sometimes"),
        ({"messages": USER, "tool_choice": "auto"}, "tool_choice"),
        ({"messages": USER, "stop_sequences": ["x"] * 17}, "stop_sequences"),
        ({"messages": USER, "metadata": "me"}, "metadata"),
        ({"messages": [user({"type": "text", "text": 5})]}, "text"),
        ({"messages": [user({"type": "tool_result", "tool_use_id": ""})]}, "tool_use_id"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_hostile_requests_are_refused_naming_what_is_wrong(
    body: dict[str, Any], error: str
) -> None:
    with pytest.raises(ValidationError, match=error):
        MessagesRequest.model_validate({"model": "tiny", "max_tokens": 8, **body})


def test_model_is_required() -> None:
    with pytest.raises(ValidationError, match="model"):
        MessagesRequest.model_validate({"max_tokens": 8, "messages": USER})


def test_count_tokens_takes_the_prompt_fields_only() -> None:
    CountTokensRequest.model_validate({"model": "m", "messages": USER, "tools": [TOOL]})
    with pytest.raises(ValidationError, match="'max_tokens' is not supported"):
        CountTokensRequest.model_validate({"model": "m", "messages": USER, "max_tokens": 3})


def test_the_schema_closes_the_top_level_and_documents_unset_only_fields() -> None:
    schema = MessagesRequest.model_json_schema()
    assert schema["additionalProperties"] is False
    assert schema["properties"]["top_k"]["type"] == "null"
    assert schema["properties"]["mcp_servers"]["maxItems"] == 0
    assert {"model", "max_tokens", "messages"} <= set(schema["required"])


# -- the reply -------------------------------------------------------------------------------


def decode(ids: Any, skip_special_tokens: bool = True) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


ENGINE = cast(
    TurnEngine,
    SimpleNamespace(
        model_name="tiny",
        template=SimpleNamespace(decode=decode),
        backend=SimpleNamespace(max_context=64),
    ),
)


def call(cid: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": arguments}}


REPLY = "9f3a0c17e2b4"  # the turn's reply id (TurnCompleted.reply_id): its ids derive from it


def turn_result(
    content: str | None = "Hello.",
    tool_calls: list[dict[str, Any]] | None = None,
    finish: str = "stop",
    text: str | None = None,
) -> TurnResult:
    text = text if text is not None else content or ""
    ids = list(text.encode())
    detok = Detokenizer(decode)
    detok.add(ids, [0.0] * len(ids))
    detok.finish()
    event = TurnCompleted(
        run="r",
        session="s",
        turn=3,
        prompt_ids=[],
        completion_ids=ids,
        logprobs=[0.0] * len(ids),
        reply_id=REPLY,
    )
    return TurnResult(
        reply=REPLY,
        completion_id=f"chatcmpl-s-{REPLY}",
        text=text,
        content=content,
        tool_calls=tool_calls or [],
        finish_reason=finish,
        completion_ids=ids,
        detok=detok,
        prompt_tokens=11,
        weight_version=0,
        event=event,
    )


def sent_message(result: TurnResult, stops: list[str] | None = None) -> dict[str, Any]:
    """The non-streamed message for ``result``, as the SDK parses it."""

    class Turns:
        engine = ENGINE

        async def complete(self, session: Any, req: Any) -> TurnResult:
            return result

    serving = AnthropicServing(cast(Any, Turns()))
    session = cast(Any, SimpleNamespace(state=SimpleNamespace(id="s")))
    body = request(messages=USER, stop_sequences=stops or None)
    message = asyncio.run(serving.complete(session, body))
    parsed = anthropic.types.Message.model_validate_json(message.json_bytes())
    assert parsed.id == f"msg_s_{REPLY}" and parsed.model == "tiny"
    return cast(dict[str, Any], json.loads(message.json_bytes()))


def test_a_message_has_text_then_tool_use_blocks() -> None:
    result = turn_result(
        content="Sure.", tool_calls=[call("call_a", "f", '{"x":1}')], finish="tool_calls"
    )
    message = sent_message(result)
    assert message["content"] == [
        {"type": "text", "text": "Sure."},
        {"type": "tool_use", "id": "call_a", "name": "f", "input": {"x": 1}},
    ]
    assert message["stop_reason"] == "tool_use" and message["stop_sequence"] is None
    assert message["usage"]["input_tokens"] == 11
    assert message["usage"]["output_tokens"] == len(result.completion_ids)


def test_a_reply_without_text_has_no_text_block() -> None:
    message = sent_message(turn_result(content=None, text="", finish="stop"))
    assert message["content"] == [] and message["stop_reason"] == "end_turn"


@pytest.mark.parametrize(
    ("finish", "text", "content", "stops", "reason", "sequence"),
    [
        ("stop", "Hi.", "Hi.", [], "end_turn", None),
        ("length", "Hi", "Hi", ["x"], "max_tokens", None),
        ("stop", "Hi. END more", "Hi. ", ["more", "END"], "stop_sequence", "END"),
        ("stop", "Hi.", "Hi.", ["END"], "end_turn", None),  # stopped on the EOS token
        # 11 prompt tokens + 53 = the fake model's context of 64: the cap was lowered to fit
        ("length", "x" * 53, "x" * 53, [], "model_context_window_exceeded", None),
    ],
)
def test_stop_reason_and_the_stop_sequence_that_ended_the_turn(
    finish: str, text: str, content: str, stops: list[str], reason: str, sequence: str | None
) -> None:
    result = turn_result(content=content, text=text, finish=finish)
    found = stop_sequence(ENGINE, result, stops)
    assert (stop_reason(ENGINE, result, found), found) == (reason, sequence)
    message = sent_message(result, stops)
    assert (message["stop_reason"], message["stop_sequence"]) == (reason, sequence)


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [('{"a":1}', {"a": 1}), ("[1]", {"arguments": [1]}), ("not json", {"arguments": "not json"})],
)
def test_tool_input_is_always_an_object(arguments: str, expected: dict[str, Any]) -> None:
    assert tool_input(arguments) == expected


# -- the stream --------------------------------------------------------------------------------

EVENT = TypeAdapter(anthropic.types.RawMessageStreamEvent)


def events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    """``event: NAME`` / ``data: {...}`` pairs; each payload must parse as the SDK's event."""
    out = []
    for frame in raw.decode().split("\n\n"):
        if not frame:
            continue
        name_line, data_line = frame.split("\n")
        name, data = name_line.removeprefix("event: "), json.loads(data_line.removeprefix("data: "))
        assert data["type"] == name
        if name != "error":
            EVENT.validate_python(data)
        out.append((name, data))
    return out


def streamed(
    result: TurnResult, pieces: list[str], rest: str, stops: list[str] | None = None
) -> bytes:
    turn = messages_turn_request(request(messages=USER, stop_sequences=stops or None))
    encoder = _MessagesEncoder(ENGINE, f"msg_s_{REPLY}", turn, result.prompt_tokens)
    detok = result.detok
    raw = encoder.opening()
    for piece in pieces:
        raw += encoder.text(piece, detok, range(0))
    return raw + encoder.closing(result, rest, detok, range(0))


def test_a_streamed_reply_is_anthropics_event_sequence() -> None:
    result = turn_result(
        content="Hello there.", tool_calls=[call("call_a", "f", '{"x":1}')], finish="tool_calls"
    )
    seen = events(streamed(result, ["Hel", "lo"], " there."))
    assert [name for name, _ in seen] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = seen[0][1]["message"]
    assert start["content"] == [] and start["id"] == f"msg_s_{REPLY}"
    assert start["stop_reason"] is None
    assert start["usage"]["input_tokens"] == 11  # the prompt's length, from the first event
    text = "".join(
        d["delta"]["text"] for n, d in seen if d.get("delta", {}).get("type") == "text_delta"
    )
    assert text == "Hello there."
    assert seen[6][1] == {
        "type": "content_block_start",
        "index": 1,
        "content_block": {"type": "tool_use", "id": "call_a", "name": "f", "input": {}},
    }
    assert seen[7][1]["delta"] == {"type": "input_json_delta", "partial_json": '{"x":1}'}
    delta = seen[9][1]
    assert delta["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert delta["usage"] == {"output_tokens": len(result.completion_ids), "input_tokens": 11}


def test_a_streamed_tool_call_without_text_opens_no_text_block() -> None:
    result = turn_result(
        content=None,
        tool_calls=[call("call_a", "f", "{}")],
        finish="tool_calls",
        text="<tool_call>",
    )
    seen = events(streamed(result, [], ""))
    starts = [d for n, d in seen if n == "content_block_start"]
    assert [s["content_block"]["type"] for s in starts] == ["tool_use"]
    assert starts[0]["index"] == 0


def test_a_stream_ended_by_a_stop_sequence_says_which() -> None:
    result = turn_result(content="ab", text="abXYc", finish="stop")
    seen = events(streamed(result, ["ab"], "", stops=["XY"]))
    assert seen[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "XY"}


@pytest.mark.parametrize(
    ("error", "kind"),
    [(EventLogUnavailable("log down"), "overloaded_error"), (BackendError("boom"), "api_error")],
)
def test_a_failure_after_the_start_is_an_error_event(error: Exception, kind: str) -> None:
    turn = messages_turn_request(request(messages=USER))
    raw = _MessagesEncoder(ENGINE, f"msg_s_{REPLY}", turn, 11).failure(error)
    [(name, data)] = events(raw)
    assert name == "error" and data["error"]["type"] == kind and data["error"]["message"]
