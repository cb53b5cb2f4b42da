"""Request validation of the OpenAI and session APIs (gateway.protocol)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from gateway.protocol import (
    ChatCompletionRequest,
    CloseSessionRequest,
    CompletionRequest,
    RewardRequest,
    message_text,
)

USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "role"),
        ({"messages": USER, "temperature": 3}, "temperature"),
        ({"messages": USER, "n": 2}, "n"),
        ({"messages": USER, "top_logprobs": 3}, "top_logprobs requires logprobs"),
        ({"messages": USER, "tools": [{"type": "retrieval"}]}, r"tools\.0\.type"),
        ({"messages": USER, "frequency_penalty": 0.5}, "frequency_penalty=0.5 is not supported"),
        ({"messages": USER, "max_tokens": 0}, "max_tokens"),
    ],
    ids=[
        "empty",
        "role",
        "temperature",
        "n",
        "top-logprobs",
        "tool-type",
        "penalty",
        "max-tokens",
    ],
)
def test_bad_chat_requests_name_what_is_wrong(body: dict[str, Any], error: str) -> None:
    with pytest.raises(ValidationError, match=error):
        ChatCompletionRequest.model_validate(body)


def test_neutral_unsupported_and_metadata_fields_are_accepted() -> None:
    req = ChatCompletionRequest.model_validate(
        {
            "messages": USER,
            "frequency_penalty": 0,
            "presence_penalty": 0.0,
            "user": "u-1",
            "max_completion_tokens": 9,
            "max_tokens": 5,
            "stop": "x",
        }
    )
    assert req.token_budget == 9
    assert req.stop_strings == ["x"]


def test_text_parts_are_joined_and_other_parts_refused() -> None:
    parts = [{"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}}]
    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "b"}]}]}
    )
    assert message_text(req.messages[0].content) == "ab"
    image = [{"type": "image_url", "image_url": {"url": "x"}}]
    with pytest.raises(ValidationError, match="content"):  # a system message holds text
        ChatCompletionRequest.model_validate({"messages": [{"role": "system", "content": image}]})
    audio = [{"type": "input_audio", "input_audio": {}}]
    with pytest.raises(ValidationError, match="content"):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": audio}]})


def test_completion_prompt_may_be_token_ids_but_not_empty() -> None:
    assert CompletionRequest.model_validate({"prompt": [1, 2]}).prompt == [1, 2]
    with pytest.raises(ValidationError, match="at least 1 character"):
        CompletionRequest.model_validate({"prompt": ""})


BAD_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ({"messages": [{"role": "tool", "content": "42"}]}, "tool_call_id"),
        ({"messages": USER, "tools": [BAD_TOOL]}, "not a valid JSON schema: 5 is not valid"),
        (
            {"messages": USER, "tools": [{**TOOL, "function": {"name": "f", "parameters": 5}}]},
            "parameters",
        ),
        ({"messages": USER, "tools": [TOOL], "tool_choice": {"function": "str"}}, "tool_choice"),
        ({"messages": USER, "seed": 2**64}, "seed"),
        ({"messages": USER, "max_tokens": 2**40}, "max_tokens"),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"function": "x"}]}]},
            "tool_calls.0.function",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "image_url"),
    ],
    ids=[
        "tool-result-without-call-id",
        "schema-type",
        "schema-not-object",
        "tool-choice-shape",
        "seed-over-int64",
        "max-tokens-huge",
        "assistant-tool-call-shape",
        "image-part",
    ],
)
def test_hostile_chat_requests_are_refused_by_rule(body: dict[str, Any], error: str) -> None:
    with pytest.raises(ValidationError, match=error):
        ChatCompletionRequest.model_validate(body)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), False, True])
def test_rewards_are_finite_numbers(value: object) -> None:
    with pytest.raises(ValidationError, match="value"):
        RewardRequest.model_validate({"value": value})
    with pytest.raises(ValidationError, match="reward"):
        CloseSessionRequest.model_validate({"reward": value})
    assert RewardRequest.model_validate({"value": 1}).value == 1.0


def test_tools_keep_the_json_the_client_sent() -> None:
    tool = {**TOOL, "function": {**TOOL["function"], "strict": True, "x-extra": [1]}}
    req = ChatCompletionRequest.model_validate({"messages": USER, "tools": [tool]})
    assert req.raw_tools == [tool] and req.raw_tools[0] is tool


def test_message_and_tool_counts_are_bounded() -> None:
    """Validating 260k tiny messages held the event loop for 1.3 s; the bound fails fast."""
    many = [{"role": "user", "content": "x"}] * 10_001
    with pytest.raises(ValidationError, match="at most 10000"):
        ChatCompletionRequest.model_validate({"messages": many})
    with pytest.raises(ValidationError, match="at most 1024"):
        ChatCompletionRequest.model_validate({"messages": USER, "tools": [TOOL] * 1025})
