"""The turn core's API-independent rules (issue 17): what a turn records of how it was asked
for, when a request is a resend of the last turn, and one error body per API."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.core.aggregate import SessionState, TurnDraft, apply, turn_event
from gateway.core.branches import resent_turn
from gateway.core.conversation import TurnRequest, same_messages
from gateway.errors import (
    BackendUnavailable,
    ContextLengthExceeded,
    InvalidRequest,
    ModelNotFound,
    RequestTooLarge,
    SessionClosed,
    Unauthorized,
    anthropic_error_body,
    anthropic_status,
)
from gateway.serving.turn_service import named_tool_choice

USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}


def test_the_record_keeps_what_was_asked_and_leaves_out_what_was_not() -> None:
    assert TurnRequest(api="messages", messages=USER).record == {
        "api": "messages",
        "parallel_tool_calls": True,
    }
    asked = TurnRequest(
        api="responses",
        messages=USER,
        tool_choice="auto",
        parallel_tool_calls=False,
        max_tokens=64000,
        temperature=0.0,
        stop=("END",),
        extras={"reasoning": {"summary": "auto"}},
    ).record
    assert asked == {
        "api": "responses",
        "tool_choice": "auto",
        "max_tokens": 64000,
        "temperature": 0.0,
        "stop": ["END"],
        "parallel_tool_calls": False,
        "reasoning": {"summary": "auto"},
    }


def _state_after_one_turn(request: TurnRequest, tool_calls: list[Any]) -> SessionState:
    state = SessionState(run="r", id="s")
    draft = TurnDraft(
        prompt_ids=[1, 2],
        messages=request.messages,
        tools=request.tools,
        completion_ids=[3],
        logprobs=[-0.5],
        text="",
        tool_calls=tool_calls,
        request=request.record,
    )
    after = apply(state, turn_event(state, draft))
    assert after is not None
    return after


def test_the_same_request_again_is_the_last_turn_resent() -> None:
    first = TurnRequest(api="chat.completions", messages=USER, tools=[TOOL], temperature=1.0)
    state = _state_after_one_turn(first, [CALL])
    assert resent_turn(state, first.messages, first.tools, first.record) is state.last_turn
    # re-serialized: the same messages to the prompt
    loose = [{"role": "user", "content": "hi", "name": None, "cache_control": {"x": 1}}]
    assert resent_turn(state, loose, [TOOL], first.record) is state.last_turn


@pytest.mark.parametrize(
    "change",
    [
        {"messages": [{"role": "user", "content": "hi!"}]},
        {"messages": [*USER, {"role": "user", "content": "more"}]},
        {"tools": None},
        {"temperature": 0.5},
        {"api": "messages"},
        {"max_tokens": 10},
    ],
    ids=["other-text", "longer", "no-tools", "other-temperature", "other-api", "other-cap"],
)
def test_another_request_is_a_new_turn(change: dict[str, Any]) -> None:
    first = TurnRequest(api="chat.completions", messages=USER, tools=[TOOL], temperature=1.0)
    state = _state_after_one_turn(first, [])
    fields = {**first.__dict__, **change}
    other = TurnRequest(**fields)
    assert resent_turn(state, other.messages, other.tools, other.record) is None


def test_a_continued_turn_is_not_resent_and_old_events_never_are() -> None:
    first = TurnRequest(api="chat.completions", messages=USER)
    state = _state_after_one_turn(first, [])
    assert state.last_turn is not None
    second = TurnRequest(
        api="chat.completions",
        messages=[*USER, state.conversation[-1], {"role": "user", "content": "and?"}],
    )
    draft = TurnDraft(
        prompt_ids=[1, 2, 3, 4],
        messages=second.messages,
        tools=None,
        completion_ids=[5],
        logprobs=[-0.1],
        request=second.record,
    )
    state = apply(state, turn_event(state, draft))  # type: ignore[assignment]
    assert resent_turn(state, first.messages, None, first.record) is None  # a fork, not a resend
    legacy = TurnDraft(prompt_ids=[1], messages=USER, tools=None, completion_ids=[2], logprobs=[0])
    old = apply(SessionState(run="r", id="t"), turn_event(SessionState(run="r", id="t"), legacy))
    assert old is not None
    assert resent_turn(old, USER, None, {}) is None  # recorded before TurnCompleted.request


def test_same_messages_compares_what_the_prompt_shows() -> None:
    echoed = {"role": "assistant", "content": None, "tool_calls": [CALL]}
    as_object = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{**CALL, "function": {"name": "f", "arguments": {"a": 1}}}],
    }
    assert same_messages([echoed], [as_object])
    assert not same_messages([echoed], [echoed, echoed])


@pytest.mark.parametrize(
    ("error", "status_type"),
    [
        (InvalidRequest("bad"), "invalid_request_error"),
        (Unauthorized("key"), "authentication_error"),
        (ModelNotFound("m"), "not_found_error"),
        (SessionClosed("closed"), "invalid_request_error"),
        (RequestTooLarge("big"), "request_too_large"),
        (ContextLengthExceeded("over"), "invalid_request_error"),
        (BackendUnavailable("busy"), "overloaded_error"),
        (RuntimeError("secret detail"), "api_error"),
    ],
)
def test_anthropic_routes_answer_anthropic_error_bodies(
    error: BaseException, status_type: str
) -> None:
    body = anthropic_error_body(error)
    assert body["type"] == "error"
    assert body["error"] == {"type": status_type, "message": body["error"]["message"]}  # type: ignore[index]
    assert "secret detail" not in str(body)
    if isinstance(error, ContextLengthExceeded):  # Claude Code compacts on these words
        assert anthropic_status(error) == 400
        assert body["error"]["message"].startswith("prompt is too long: ")  # type: ignore[index]


@pytest.mark.parametrize(
    ("tools", "choice", "named", "problem"),
    [
        ([TOOL], {"type": "function", "function": {"name": "f"}}, "f", None),
        ([TOOL], "required", None, None),
        ([TOOL], {"type": "function", "function": {"name": "g"}}, None, "'g', not among"),
        (None, "required", None, "needs tools"),
        ([], "required", None, "needs tools"),
        (None, {"type": "function", "function": {"name": "f"}}, None, "'f', not among"),
    ],
)
def test_tool_choice_is_checked_against_the_tools(
    tools: list[Any] | None, choice: Any, named: str | None, problem: str | None
) -> None:
    request = TurnRequest(api="messages", messages=USER, tools=tools, tool_choice=choice)
    if problem is None:
        assert named_tool_choice(request) == named
    else:
        with pytest.raises(InvalidRequest, match=problem) as caught:
            named_tool_choice(request)
        assert caught.value.param == "tool_choice"
