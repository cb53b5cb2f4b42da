"""The OpenAI Responses adapter (gateway.protocol.responses, gateway.serving.responses_service):
what the requests translate into, and the response and events a turn becomes.

The canonical conversation must not depend on how a client sends its history: Codex's
captured requests must extend each other message for message, and the output items of a
response, echoed back verbatim or re-serialized, must be exactly the reply the turn recorded.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai.types.responses import Response as SDKResponse
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter, ValidationError
from transformers import AutoTokenizer

from gateway.backends.interface import GenerationChunk, SamplingParams
from gateway.core.aggregate import Kept, SessionState, TurnDraft, apply, turn_event
from gateway.core.conversation import TurnRequest, message_key
from gateway.core.session_store import Session, SessionStore
from gateway.errors import BackendError, InvalidRequest
from gateway.metrics import GatewayMetrics
from gateway.protocol.responses import (
    ResponsesRequest,
)
from gateway.protocol.responses_reply import (
    InputTokensDetails,
    LifecycleEvent,
    OutputTokensDetails,
    ResponseUsage,
)
from gateway.protocol.sse import sse_event
from gateway.protocol.validated_once import KEPT_MEMO, new_memo
from gateway.serving import TurnEngine, TurnServing
from gateway.serving.responses_input import (
    parse_response_id,
    previous_conversation,
    response_id,
    responses_turn_request,
)
from gateway.serving.responses_service import ResponsesServing, _Frame
from gateway.templates import ChatTemplate
from gateway.tools import get_parser
from schemas.events import SessionOpened

FIXTURES = Path(__file__).parents[1] / "fixtures" / "agents" / "codex"
TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    "strict": False,
}
CALL = {
    "type": "function_call",
    "id": "fc_1",
    "call_id": "call_1",
    "name": "get_weather",
    "arguments": '{"city": "Paris"}',
    "status": "completed",
}


def canonical(body: dict[str, Any], previous: Sequence[dict[str, Any]] = ()) -> TurnRequest:
    return responses_turn_request(ResponsesRequest.model_validate(body), previous)


def keys(messages: Sequence[dict[str, Any]]) -> list[tuple[object, ...]]:
    return [message_key(m) for m in messages]


# -- Codex's captured requests ----------------------------------------------------------------


def codex_bodies() -> list[dict[str, Any]]:
    return [json.loads((FIXTURES / f"request_{k}.json").read_text())["body"] for k in (1, 2, 3)]


def test_codexs_requests_extend_each_other_and_record_the_same_parameters() -> None:
    first, second, third = [canonical(body) for body in codex_bodies()]
    for earlier, later in ((first, second), (second, third)):
        assert keys(later.messages[: len(earlier.messages)]) == keys(earlier.messages)
        assert later.record == earlier.record, "a retry must be recognized as one"
        assert later.tools == earlier.tools
    assert [m["role"] for m in third.messages] == [
        *("developer", "developer", "user", "user"),
        *("assistant", "tool", "assistant", "tool"),
    ]
    # The reply the fake server wrote comes back as one assistant message with the call.
    reply = second.messages[4]
    assert message_key(reply) == message_key(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_88f3557c2bb64dec8563",
                    "type": "function",
                    "function": {"name": "exec_command", "arguments": '{"cmd":"cat notes.txt"}'},
                }
            ],
        }
    )
    assert second.messages[5]["tool_call_id"] == "call_88f3557c2bb64dec8563"


def test_codexs_tools_offer_the_functions_and_record_the_rest() -> None:
    request = canonical(codex_bodies()[0])
    names = [t["function"]["name"] for t in request.tools or ()]
    # 7 function tools, and multi_agent_v1's 5 flattened (tests/unit/test_responses_namespaces.py)
    assert "exec_command" in names and "multi_agent_v1__spawn_agent" in names
    assert len(names) == 12
    assert all(set(t) == {"type", "function"} for t in request.tools or ())
    assert [t["type"] for t in request.extras["unoffered_tools"]] == ["web_search"]
    assert request.tool_choice == "auto" and request.parallel_tool_calls
    assert request.extras["reasoning"] == {"summary": "auto"}
    assert request.extras["include"] == ["reasoning.encrypted_content"]
    assert request.extras["store"] is False and "prompt_cache_key" in request.extras
    assert request.extras["client_metadata"]["turn_id"] == "01a2138a-c2db-7f61-a349-257ff5ac5a88"
    assert "stream" not in request.record


# -- translation table ------------------------------------------------------------------------

USER = {"role": "user", "content": "hi"}


@pytest.mark.parametrize(
    ("input", "messages"),
    [
        ("hi", [USER]),
        ([{"type": "message", "role": "user", "content": "hi"}], [USER]),
        (
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "h"},
                        {"type": "input_text", "text": "i"},
                    ],
                }
            ],
            [USER],
        ),
        (
            [
                {
                    "role": "developer",
                    "id": "msg_9",
                    "content": [{"type": "input_text", "text": "x"}],
                }
            ],
            [{"role": "developer", "content": "x"}],
        ),
        (  # our own reply echoed: text + calls are one assistant message
            [
                USER,
                {
                    "type": "message",
                    "role": "assistant",
                    "id": "msg_s_0",
                    "status": "completed",
                    "content": [
                        {"type": "output_text", "text": "ok", "annotations": [], "logprobs": []}
                    ],
                },
                {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "xx"},
                CALL,
                {**CALL, "call_id": "call_2", "arguments": '{"city":"Rome"}'},
                {"type": "function_call_output", "call_id": "call_1", "output": "18C"},
                {
                    "type": "function_call_output",
                    "call_id": "call_2",
                    "output": [
                        {"type": "input_text", "text": "2"},
                        {"type": "input_text", "text": "0C"},
                    ],
                },
            ],
            [
                USER,
                {
                    "role": "assistant",
                    "content": "ok",
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                        },
                        {
                            "id": "call_2",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'},
                        },
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
                {"role": "tool", "tool_call_id": "call_2", "content": "20C"},
            ],
        ),
        (  # a call without text; reasoning alone is dropped
            [USER, {"type": "reasoning", "summary": []}, CALL],
            [
                USER,
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                        }
                    ],
                },
            ],
        ),
        (  # two assistant message items are one message; text after calls is the next one
            [
                {"role": "assistant", "content": "a"},
                {"role": "assistant", "content": [{"type": "output_text", "text": "b"}]},
                CALL,
                {"role": "assistant", "content": "c"},
            ],
            [
                {
                    "role": "assistant",
                    "content": "ab",
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                        }
                    ],
                },
                {"role": "assistant", "content": "c"},
            ],
        ),
    ],
    ids=["string", "item", "parts", "developer", "echo", "call-only", "assistant-runs"],
)
def test_input_items_become_chat_messages(input: Any, messages: list[dict[str, Any]]) -> None:
    assert canonical({"input": input}).messages == messages


def test_instructions_lead_and_replace_a_previous_responses_instructions() -> None:
    assert canonical({"input": "hi", "instructions": "be brief"}).messages == [
        {"role": "system", "content": "be brief"},
        USER,
    ]
    previous = [{"role": "system", "content": "old"}, USER, {"role": "assistant", "content": "x"}]
    follow = canonical({"input": "more", "instructions": "new"}, previous)
    assert [m["content"] for m in follow.messages] == ["new", "hi", "x", "more"]
    assert [m["content"] for m in canonical({"input": "more"}, previous).messages] == [
        "old",
        "hi",
        "x",
        "more",
    ]


def test_tools_and_tool_choice_take_the_chat_shape() -> None:
    request = canonical(
        {
            "input": "hi",
            "tools": [TOOL, {"type": "web_search"}],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "parallel_tool_calls": False,
            "max_output_tokens": 64,
            "temperature": 0,
            "top_p": 0.5,
            "include": ["message.output_text.logprobs", "reasoning.encrypted_content"],
            "top_logprobs": 2,
            "metadata": {"k": "v"},
            "client_metadata": {"turn_id": "t-1"},
            "user": "u",
            "service_tier": "auto",
            "text": {"format": {"type": "text"}, "verbosity": "low"},
            "truncation": "auto",
            "previous_response_id": "resp_s_0",
        }
    )
    assert request.tools == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Current weather in a city.",
                "parameters": TOOL["parameters"],
            },
        }
    ]
    assert request.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert (request.max_tokens, request.temperature, request.top_p) == (64, 0, 0.5)
    assert request.logprobs and request.top_logprobs == 2
    assert not request.parallel_tool_calls
    assert request.extras == {
        "include": ["message.output_text.logprobs", "reasoning.encrypted_content"],
        "metadata": {"k": "v"},
        "client_metadata": {"turn_id": "t-1"},
        "previous_response_id": "resp_s_0",
        "unoffered_tools": [{"type": "web_search"}],
    }


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"input": 5}, "input", "string or a list"),
        ({"input": [5]}, "input", ""),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input", "item_reference"),
        ({"input": [{"type": "custom_tool_call", "id": "x"}]}, "input", "function_call"),
        ({"input": [{"type": "web_search_call"}]}, "input", "only function tools"),
        ({"input": [{"type": "compaction"}]}, "input", "'compaction' is not supported"),
        # Codex's default model's code-mode tools: the fix is naming the served model in Codex.
        ({"input": [{"type": "additional_tools", "tools": []}]}, "input", "`model` in Codex"),
        ({"input": [{"type": 7}]}, "input", "not supported"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input", "role"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input", "image_url"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
            "input",
            "no file uploads",
        ),
        # A part's type that is an object or a list: a 400, not a TypeError (schemathesis).
        ({"input": [{"role": "user", "content": [{"type": {"a": 1}}]}]}, "input", "not supported"),
        ({"input": [{"role": "user", "content": [{"type": [1]}]}]}, "input", "not supported"),
        ({"input": [{"content": [{"x": {"": 1}}]}]}, "input", "not supported"),
        ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input", "text"),
        ({"input": [{"role": "user", "content": [{"type": "refusal"}]}]}, "input", "refusal"),
        (
            {
                "input": [
                    {
                        "type": "function_call_output",
                        "call_id": "c",
                        "output": [{"type": "input_file"}],
                    }
                ]
            },
            "input",
            "input_file",
        ),
        ({"input": [{**CALL, "call_id": ""}]}, "input", "call_id"),
        ({"input": [{**CALL, "arguments": {"city": "Paris"}}]}, "input", "arguments"),
        ({"tools": [5]}, "tools", "type"),
        ({"tools": [{"name": "f"}]}, "tools", "type"),
        ({"tools": [{"type": "function"}]}, "tools", "name"),
        ({"tools": [{**TOOL, "parameters": {"type": "nope"}}]}, "tools", "JSON schema"),
        ({"tool_choice": {"type": "web_search"}}, "tool_choice", ""),
        ({"tool_choice": "sometimes"}, "tool_choice", ""),
        (
            {"tool_choice": {"type": "function", "name": "f"}, "tools": [TOOL]},
            "tool_choice",
            "not among",
        ),
        ({"tool_choice": "required", "tools": [{"type": "web_search"}]}, "tool_choice", "needs"),
        ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text", "structured"),
        ({"text": {"other": 1}}, "text", ""),
        ({"truncation": "sometimes"}, "truncation", ""),
        ({"max_output_tokens": 0}, "max_output_tokens", ""),
        ({"top_logprobs": 21}, "top_logprobs", ""),
        ({"temperature": float("nan")}, "temperature", ""),
        ({"metadata": {"k": 1}}, "metadata", ""),
        ({"include": "reasoning.encrypted_content"}, "include", ""),
        ({"previous_response_id": "resp_s_9999999999999"}, "previous_response_id", ""),
        ({"previous_response_id": "msg_s_0"}, "previous_response_id", ""),
        ({"conversation": "conv_1"}, "conversation", "not supported"),
        ({"background": True}, "background", "not supported"),
        ({"\u202eé" * 50: 1}, "", "not supported"),
    ],
)
def test_bad_requests_name_the_field(body: dict[str, Any], param: str, words: str) -> None:
    with pytest.raises(ValidationError) as refused:
        ResponsesRequest.model_validate({"input": "hi", **body})
    first = refused.value.errors()[0]
    assert str(first["loc"][0]).startswith(param) if param else True
    assert words in str(refused.value)


def test_a_request_with_no_message_is_refused() -> None:
    with pytest.raises(InvalidRequest) as refused:
        canonical({"input": [{"type": "reasoning"}]})
    assert refused.value.param == "input"


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)
ITEM_KEYS = st.sampled_from(
    ["type", "role", "content", "call_id", "name", "arguments", "output", "text", "id"]
)
ITEM_TYPES = st.sampled_from(
    ["message", "function_call", "function_call_output", "reasoning", "input_text", "x"]
)
ITEMS = st.dictionaries(ITEM_KEYS, JSON_VALUES | ITEM_TYPES, max_size=6)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    items=st.lists(ITEMS, max_size=5),
    other=st.dictionaries(
        st.sampled_from(["tools", "tool_choice", "text", "instructions", "include", "zzz"]),
        JSON_VALUES,
        max_size=3,
    ),
)
def test_any_input_is_translated_or_refused_by_rule(
    items: list[dict[str, Any]], other: dict[str, Any]
) -> None:
    """Hostile input never escapes as another exception (a 5xx): a ValidationError or an
    InvalidRequest (both 400s), or a turn request."""
    try:
        request = canonical({"input": items, **other})
    except (ValidationError, InvalidRequest):
        return
    assert request.messages
    for message in request.messages:
        assert isinstance(message.get("content") or "", str)


# -- response ids and previous_response_id ------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "parsed"),
    [
        ("resp_s_9f3a0c17e2b4", ("s", "9f3a0c17e2b4")),  # a reply id
        ("resp_s_0", ("s", "0")),  # older ids: the turn index
        ("resp_a_b-c_12", ("a_b-c", "12")),
        ("resp_a__3", ("a_", "3")),
    ],
)
def test_a_response_id_names_its_session_and_reply(value: str, parsed: tuple[str, str]) -> None:
    assert parse_response_id(value) == parsed
    assert response_id(*parsed) == value


@pytest.mark.parametrize(
    "value",
    ["resp_", "resp_s", "resp_s_", "resp__1", "resp_s_x", "s_1", "resp_s_9F3A", "resp_s_g1"],
)
def test_a_malformed_response_id_is_a_400_naming_the_field(value: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        parse_response_id(value)
    assert refused.value.param == "previous_response_id"


def take_turn(state: SessionState, messages: list[dict[str, Any]], request: TurnRequest) -> Any:
    draft = TurnDraft(
        prompt_ids=[1, 2],
        messages=messages,
        tools=None,
        completion_ids=[3],
        logprobs=[-0.5],
        text=f"reply {state.turns}",
        request=request.record,
    )
    return apply(state, turn_event(state, draft))


def session_with_two_turns(turns_kept: int = 64) -> tuple[SessionState, dict[str, Any]]:
    state = apply(
        None, SessionOpened(run="r", session="s", group=None), kept=Kept(turns=turns_kept)
    )
    assert state is not None
    first = canonical({"input": "hi"})
    state = take_turn(state, first.messages, first)
    follow = {"input": "more", "previous_response_id": "resp_s_0"}
    second = canonical(follow, previous_conversation(state, ResponsesRequest(**follow)))
    state = take_turn(state, second.messages, second)
    return state, follow


def test_previous_response_id_continues_the_last_turns_conversation() -> None:
    state, _ = session_with_two_turns()
    req = ResponsesRequest(input="again", previous_response_id="resp_s_1")
    base = previous_conversation(state, req)
    assert [m["content"] for m in base] == ["hi", "reply 0", "more", "reply 1"]


def test_a_resent_previous_response_request_rebuilds_the_same_conversation() -> None:
    """The retry names the response before the last turn, which is the retried request's."""
    state, follow = session_with_two_turns()
    req = ResponsesRequest(**follow)
    again = canonical(follow, previous_conversation(state, req))
    assert keys(again.messages) == keys(state.conversation[:-1])
    assert again.record == state.last_turn.request  # type: ignore[union-attr]


def test_previous_response_id_may_name_an_earlier_kept_response() -> None:
    """Another input after an earlier response: a branch of the session's tree."""
    state, _ = session_with_two_turns()
    req = ResponsesRequest(input="something else", previous_response_id="resp_s_0")
    assert [m["content"] for m in previous_conversation(state, req)] == ["hi", "reply 0"]


def test_previous_response_id_names_a_reply_id_not_a_turn_index() -> None:
    """Ids derive from the request's reply id (made before its turn index is known); the turn
    is found by it, and its index is not an id of it."""
    state, _ = session_with_two_turns()
    asked = canonical({"input": "third"})
    draft = TurnDraft(
        prompt_ids=[7],
        messages=asked.messages,
        tools=None,
        completion_ids=[8],
        logprobs=[-0.1],
        text="reply 2",
        request=asked.record,
        reply_id="9f3a0c17e2b4",
    )
    state = apply(state, turn_event(state, draft))
    req = ResponsesRequest(input="x", previous_response_id="resp_s_9f3a0c17e2b4")
    assert [m["content"] for m in previous_conversation(state, req)] == ["third", "reply 2"]
    with pytest.raises(InvalidRequest, match="holds no such response"):
        previous_conversation(state, ResponsesRequest(input="x", previous_response_id="resp_s_2"))


def test_a_response_no_longer_kept_is_a_400_asking_for_the_full_input() -> None:
    state, _ = session_with_two_turns(turns_kept=1)
    req = ResponsesRequest(input="something else", previous_response_id="resp_s_0")
    with pytest.raises(InvalidRequest, match=r"holds no such response.*resend the full conv"):
        previous_conversation(state, req)
    assert previous_conversation(
        state, ResponsesRequest(input="x", previous_response_id="resp_s_1")
    )


@pytest.mark.parametrize(
    ("previous", "words"),
    [
        ("resp_s_2", "holds no such response"),
        ("resp_other_1", "of session 'other'"),
    ],
)
def test_previous_response_id_of_another_session_or_turn_is_a_400(
    previous: str, words: str
) -> None:
    state, _ = session_with_two_turns()
    req = ResponsesRequest(input="something else", previous_response_id=previous)
    with pytest.raises(InvalidRequest, match=words) as refused:
        previous_conversation(state, req)
    assert refused.value.param == "previous_response_id"


# -- the response and its events, through the turn core ----------------------------------------


class _Receipt:
    seq, duplicate = 1, False


class _Publisher:
    def __init__(self) -> None:
        self.events: list[Any] = []

    async def publish(self, event: Any) -> _Receipt:
        self.events.append(event)
        return _Receipt()


class _ScriptedBackend:
    """Generates the given text, byte token by byte token, then the stop token."""

    id, max_context = "scripted", 4096

    def __init__(self, template: ChatTemplate, text: str, fail: bool = False) -> None:
        self.ids = template.encode(text)
        self.stop = template.stop_token_ids[0]
        self.fail = fail

    async def generate(
        self, prompt_ids: Any, params: Any, *, session: str | None = None
    ) -> AsyncIterator[GenerationChunk]:
        for n, token in enumerate(self.ids, 1):
            if n == params.max_tokens:
                yield GenerationChunk([token], [-0.25], finish_reason="length")
                return
            yield GenerationChunk([token], [-0.25])
        if self.fail:
            raise BackendError("replica died mid-generation")
        yield GenerationChunk([self.stop], [-0.1], finish_reason="stop")

    async def admit(self, params: SamplingParams) -> str | None:
        return None

    async def close(self) -> None:
        return None


REPLY = (
    'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    "</tool_call>"
)
EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)


async def serving_for(
    model_dir: Path, text: str, fail: bool = False
) -> tuple[ResponsesServing, Session, _Publisher]:
    template = ChatTemplate(AutoTokenizer.from_pretrained(model_dir))
    publisher = _Publisher()
    engine = TurnEngine(
        template=template,
        backend=_ScriptedBackend(template, text, fail),
        publisher=publisher,  # type: ignore[arg-type]
        parser=get_parser("hermes"),
        model_name="tiny",
        metrics=GatewayMetrics(),
    )
    store = SessionStore()

    async def create() -> tuple[SessionState, int]:
        return SessionState(run="run", id="s"), 0

    session = await store.load(("run", "s"), create)
    assert session is not None
    return ResponsesServing(TurnServing(engine, store)), session, publisher


def parse_sse(chunks: list[bytes]) -> list[dict[str, Any]]:
    events = []
    for block in b"".join(chunks).decode().split("\n\n"):
        if not block:
            continue
        name, data = block.split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert name == f"event: {payload['type']}"
        events.append(payload)
    return events


ASK = {"input": "weather?", "tools": [TOOL], "include": ["message.output_text.logprobs"]}


async def test_a_response_echoed_back_is_the_reply_the_turn_recorded(tiny_model_dir: Path) -> None:
    serving, session, publisher = await serving_for(tiny_model_dir, REPLY)
    response = await serving.complete(session, ResponsesRequest(**ASK))
    parsed = SDKResponse.model_validate_json(response.json_bytes())
    [event] = publisher.events
    assert re.fullmatch("[0-9a-f]{12}", event.reply_id), "a per-request id, not the turn index"
    assert parsed.id == f"resp_s_{event.reply_id}" and parsed.status == "completed"
    assert parsed.output[0].id == f"msg_s_{event.reply_id}"
    assert [item.type for item in parsed.output] == ["message", "function_call"]
    assert parsed.output_text == "Let me check."
    assert parsed.usage is not None and parsed.usage.output_tokens == len(event.completion_ids)
    message = parsed.output[0]
    assert message.type == "message" and len(message.content[0].logprobs or []) == len(  # type: ignore[union-attr]
        event.completion_ids
    )
    for echo in (
        json.loads(response.json_bytes())["output"],  # verbatim
        [item.model_dump(exclude_none=True) for item in parsed.output],  # re-serialized
    ):
        [reply] = canonical({"input": echo}).messages
        assert message_key(reply) == message_key(event.assistant_message)
    assert event.request["api"] == "responses"


async def test_a_streamed_response_is_typed_events_ending_in_the_response(
    tiny_model_dir: Path,
) -> None:
    serving, session, publisher = await serving_for(tiny_model_dir, REPLY)
    stream = await serving.stream(session, ResponsesRequest(**ASK, stream=True))
    events = parse_sse([chunk async for chunk in stream])
    for event in events:
        EVENTS.validate_python(event)  # the openai SDK's own event models
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-8:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == "Let me check."
    final = SDKResponse.model_validate(events[-1]["response"])
    [event] = publisher.events
    assert final.output_text == text and final.id == f"resp_s_{event.reply_id}"
    assert final.output[1].type == "function_call" and final.output[1].name == "get_weather"
    assert final.output[1].call_id == event.tool_calls[0]["id"]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    [reply] = canonical({"input": done}).messages
    assert message_key(reply) == message_key(event.assistant_message)
    logprobs = [
        lp for e in events if e["type"] == "response.output_text.delta" for lp in e["logprobs"]
    ]
    assert np.allclose([lp["logprob"] for lp in logprobs], -0.25)

    # The same request again is a retry: the recorded turn, under the same ids.
    again = await serving.stream(session, ResponsesRequest(**ASK, stream=True))
    replayed = parse_sse([chunk async for chunk in again])
    assert replayed[-1]["response"]["id"] == f"resp_s_{event.reply_id}"
    # (a replay's one text delta carries all the turn's logprobs: compare the items)
    assert (
        canonical({"input": replayed[-1]["response"]["output"]}).messages
        == canonical({"input": events[-1]["response"]["output"]}).messages
    )
    assert len(publisher.events) == 1


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"tools": None},
        # what a client sends that looks like the place the tools are written back in
        {
            "metadata": {"tools": "[]", "text": "x"},
            "reasoning": {"tools": [], "text": {"format": {"type": "text"}}},
            "instructions": '"tools":[],"text":{"format":{"type":"text"}}}}\n\n',
        },
    ],
)
def test_a_streamed_responses_tools_are_written_as_the_response_object_writes_them(
    extra: dict[str, Any],
) -> None:
    """The lifecycle events are serialized without the tools and get them written back in
    (``_Frame.spliced``, issue 40): byte for byte the event serialized with them."""
    tool = {
        **TOOL,
        "description": 'Wetter \u2603 "quoted" </script>',
        "parameters": {"type": "object", "properties": {"n": {"minimum": 1.0, "maximum": 10}}},
    }
    body = {**ASK, "tools": [tool, {**tool, "name": "other", "strict": True}], **extra}

    class _Engine:
        model_name = "tiny"

    # As a session's turns come: the tools list decoded once, its models validated once
    # (validated_once), their echo written once (_tools_echo); and without the memo.
    memo = new_memo()
    requests = [ResponsesRequest.model_validate(body, context={KEPT_MEMO: memo}) for _ in "ab"]
    assert requests[0].tools is requests[1].tools
    requests.append(ResponsesRequest.model_validate(body))
    output: list[Any] = []
    for req, status in itertools.product(requests, ("in_progress", "completed", "incomplete")):
        frame = _Frame(_Engine(), req)  # type: ignore[arg-type]
        assert frame.echo["tools"] == [t.model_dump(exclude_none=True) for t in req.tools or ()]

        def event(echo_tools: bool, status: str = status, frame: _Frame = frame) -> bytes:
            response = frame.response("resp_s_1", status, output, echo_tools=echo_tools)
            kind = f"response.{status}"
            return sse_event(
                kind, LifecycleEvent.build(type=kind, sequence_number=3, response=response)
            )

        assert frame.spliced(event(echo_tools=False)) == event(echo_tools=True)
        # Not streamed: the whole response, written with the kept JSON of its tools.
        usage = ResponseUsage.build(
            input_tokens=3,
            input_tokens_details=InputTokensDetails.build(),
            output_tokens=2,
            output_tokens_details=OutputTokensDetails.build(),
            total_tokens=5,
        )
        whole = frame.whole("resp_s_1", status, output, usage)
        plain = frame.response("resp_s_1", status, output, usage)
        assert whole.json_bytes() == plain.json_bytes() and whole.tools == plain.tools


async def test_a_cut_reply_is_an_incomplete_response(tiny_model_dir: Path) -> None:
    serving, session, _ = await serving_for(tiny_model_dir, "x" * 50)
    response = await serving.complete(session, ResponsesRequest(input="hi", max_output_tokens=5))
    parsed = SDKResponse.model_validate_json(response.json_bytes())
    assert parsed.status == "incomplete"
    assert parsed.incomplete_details is not None
    assert parsed.incomplete_details.reason == "max_output_tokens"
    stream = await serving.stream(
        session, ResponsesRequest(input="hi", max_output_tokens=5, stream=True)
    )
    events = parse_sse([chunk async for chunk in stream])
    assert events[-1]["type"] == "response.incomplete"


async def test_a_backend_failure_mid_stream_ends_it_with_an_error_event(
    tiny_model_dir: Path,
) -> None:
    serving, session, publisher = await serving_for(tiny_model_dir, "Hello", fail=True)
    stream = await serving.stream(session, ResponsesRequest(input="hi", stream=True))
    events = parse_sse([chunk async for chunk in stream])
    EVENTS.validate_python(events[-1])
    assert events[-1]["type"] == "error" and events[-1]["code"] == "backend_error"
    assert events[-1]["sequence_number"] == len(events) - 1
    assert "response.completed" not in [e["type"] for e in events]
    assert publisher.events == [] and not session.lock.locked()
