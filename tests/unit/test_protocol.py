"""Request validation of the OpenAI and session APIs (gateway.protocol)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from gateway.protocol import ChatCompletionRequest, CompletionRequest, message_text

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
        ({"messages": USER, "tools": [{"type": "retrieval"}]}, r"tools\[0\]"),
        (
            {
                "messages": USER,
                "tools": [TOOL],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "'g'",
        ),
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
        "tool-choice",
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
    assert message_text([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]) == "ab"
    with pytest.raises(ValueError, match="image_url"):
        message_text([{"type": "image_url", "image_url": {"url": "x"}}])


def test_completion_prompt_may_be_token_ids_but_not_empty() -> None:
    assert CompletionRequest.model_validate({"prompt": [1, 2]}).prompt == [1, 2]
    with pytest.raises(ValidationError, match="must not be empty"):
        CompletionRequest.model_validate({"prompt": ""})
