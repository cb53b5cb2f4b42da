"""Request bodies of the HTTP API (OpenAI chat/completions and the session API), as pydantic
models. Responses are built as plain dicts in ``serving`` in the OpenAI shape; the official
``openai`` SDK parses them into its typed objects.

Parameters the gateway does not implement are refused (400) when set to a value that would
change the result, and ignored when they are at their defaults, so unmodified agents work.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from schemas.events import SessionStatus
from schemas.ids import ID_PATTERN

__all__ = [
    "ChatCompletionRequest",
    "CloseSessionRequest",
    "CompletionRequest",
    "CreateSessionRequest",
    "RewardRequest",
    "message_text",
]

Role = Literal["system", "developer", "user", "assistant", "tool"]


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown OpenAI fields: checked in _unsupported

    @model_validator(mode="after")
    def _unsupported(self) -> _Request:
        for name, value in (self.model_extra or {}).items():
            if name in _NEUTRAL and value in _NEUTRAL[name]:
                continue
            if name in _IGNORED:
                continue
            raise ValueError(f"parameter {name}={value!r} is not supported by this gateway")
        return self


# Sampling knobs we do not implement, accepted at their neutral values.
_NEUTRAL: dict[str, tuple[object, ...]] = {
    "frequency_penalty": (0, 0.0, None),
    "presence_penalty": (0, 0.0, None),
    "logit_bias": (None, {}),
    "best_of": (1, None),
    "echo": (False, None),
    "suffix": (None, ""),
    "response_format": (None, {"type": "text"}),
}
# Metadata-only fields that never change the completion.
_IGNORED = {"user", "metadata", "store", "service_tier", "reasoning_effort", "modalities"}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Role
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


def message_text(content: str | list[dict[str, Any]] | None) -> str | None:
    """The text of a message: a string, or the concatenated text parts of a list."""
    if content is None or isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.get("type") != "text":
            raise ValueError(
                f"content part of type {part.get('type')!r} is not supported (text only)"
            )
        parts.append(str(part.get("text", "")))
    return "".join(parts)


class ChatCompletionRequest(_Request):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["auto", "none", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    stop: str | list[str] | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = None
    n: int = Field(1, ge=1, le=1, description="one choice per turn: a turn is one sample")

    @field_validator("tools")
    @classmethod
    def _function_tools(cls, tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for i, tool in enumerate(tools or []):
            function = tool.get("function")
            if tool.get("type") != "function" or not isinstance(function, dict):
                raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}")
            if not isinstance(function.get("name"), str):
                raise ValueError(f"tools[{i}].function.name must be a string")
        return tools

    @model_validator(mode="after")
    def _named_tool_exists(self) -> ChatCompletionRequest:
        if isinstance(self.tool_choice, dict):
            name = (self.tool_choice.get("function") or {}).get("name")
            names = [t["function"]["name"] for t in self.tools or []]
            if name not in names:
                raise ValueError(f"tool_choice names function {name!r}, not among tools {names}")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        return self

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def token_budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Request):
    model: str | None = None
    prompt: str | list[int] = Field(description="text, or token ids (tokens in, tokens out)")
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    logprobs: int | None = Field(None, ge=0, le=20)
    stop: str | list[str] | None = None
    max_tokens: int | None = Field(16, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = None
    n: int = Field(1, ge=1, le=1)

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, prompt: str | list[int]) -> str | list[int]:
        if len(prompt) == 0:
            raise ValueError("prompt must not be empty")
        return prompt

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CreateSessionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    run: str | None = Field(None, pattern=f"^{ID_PATTERN}$")
    session_id: str | None = Field(None, pattern=f"^{ID_PATTERN}$", description="default: random")
    group: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)


class RewardRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    value: float
    turn: int | None = Field(None, ge=0)
    key: str = Field("default", pattern=f"^{ID_PATTERN}$")
    source: str = ""
    info: dict[str, Any] = Field(default_factory=dict)


class CloseSessionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    status: SessionStatus = "completed"
    reward: float | None = None
