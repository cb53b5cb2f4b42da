"""OpenAI Chat Completions: the request and response models.

Parameters the gateway does not implement are refused (400) when set to a value that would
change the result, and ignored when they are at their defaults, so unmodified agents work.
Tools keep the exact JSON the client sent (``ChatTool.raw``): it is what the chat template
renders and what the log records.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Literal

import msgspec
from jsonschema import exceptions as jsonschema_errors
from jsonschema import validators
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    field_validator,
    model_validator,
)

from gateway.protocol.common import FiniteFloat, Int64, TokenCount, Usage, Wire

__all__ = [
    "AssistantMessage",
    "ChatCompletion",
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "ChatMessage",
    "ChatTool",
    "Choice",
    "ChoiceLogprobs",
    "ChunkChoice",
    "Delta",
    "DeltaToolCall",
    "NamedToolChoice",
    "TokenLogprob",
    "ToolCallFunction",
    "ToolCallOut",
    "TopLogprobOut",
    "message_text",
]

Role = Literal["system", "developer", "user", "assistant", "tool"]


class OpenAIRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown OpenAI fields: checked in _unsupported

    @model_validator(mode="after")
    def _unsupported(self) -> OpenAIRequest:
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


class FunctionCall(BaseModel):
    """A tool call's function as a client sends it back in an assistant message."""

    model_config = ConfigDict(extra="allow")

    name: str
    arguments: str | dict[str, Any] = ""


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Role
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _checked(self) -> ChatMessage:
        # One validator, not one per field: it runs for every message of every request.
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError(
                "a message with role 'tool' needs the tool_call_id of the call it answers"
            )
        if isinstance(self.content, list):
            message_text(self.content)  # text parts only
        return self


def message_text(content: str | list[dict[str, Any]] | None) -> str | None:
    """The text of a message: a string, or the concatenated text parts of a list."""
    if content is None or isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text", ""), str):
            raise ValueError(
                f"content part of type {part.get('type')!r} is not supported "
                "(text only: {'type': 'text', 'text': '...'})"
            )
        parts.append(part.get("text", ""))
    return "".join(parts)


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema")

    @field_validator("parameters")
    @classmethod
    def _json_schema(cls, parameters: dict[str, Any] | None) -> dict[str, Any] | None:
        if parameters is not None:
            problem = _schema_problem(parameters)
            if problem is not None:
                raise ValueError(f"parameters is not a valid JSON schema: {problem}")
        return parameters


class ChatTool(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["function"]
    function: FunctionDefinition
    _raw: dict[str, Any] = PrivateAttr(default_factory=dict)

    @model_validator(mode="wrap")
    @classmethod
    def _keep_raw(cls, data: Any, handler: Any) -> ChatTool:
        tool: ChatTool = handler(data)
        tool._raw = data if isinstance(data, dict) else tool.model_dump(exclude_none=True)
        return tool

    @property
    def raw(self) -> dict[str, Any]:
        return self._raw


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool = False


class ChatCompletionRequest(OpenAIRequest):
    model: str | None = Field(None, description="the served model (GET /v1/models); omitted: it")
    # Bounded so that validating one request cannot hold the event loop for long (260k tiny
    # messages took 1.3 s); agents' sessions stay far below it within any context length.
    messages: list[ChatMessage] = Field(min_length=1, max_length=10_000)
    tools: list[ChatTool] | None = Field(None, max_length=1024)
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    stop: str | list[str] | None = Field(None, max_length=16)
    max_tokens: TokenCount | None = None
    max_completion_tokens: TokenCount | None = None
    temperature: FiniteFloat | None = Field(None, ge=0, le=2)
    top_p: FiniteFloat | None = Field(None, gt=0, le=1)
    seed: Int64 | None = None
    n: int = Field(1, ge=1, le=1, description="one choice per turn: a turn is one sample")

    @model_validator(mode="after")
    def _consistent(self) -> ChatCompletionRequest:
        names = [t.function.name for t in self.tools or []]
        if isinstance(self.tool_choice, NamedToolChoice):
            if self.tool_choice.function.name not in names:
                raise ValueError(
                    f"tool_choice names function {self.tool_choice.function.name!r}, "
                    f"not among tools {names}"
                )
        elif self.tool_choice == "required" and not names:
            raise ValueError("tool_choice 'required' needs tools")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        return self

    @property
    def raw_tools(self) -> list[dict[str, Any]] | None:
        return [t.raw for t in self.tools] if self.tools else None

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def token_budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


# Agents send the same tool schemas every turn: each distinct schema is checked once.
_SCHEMA_VERDICTS: OrderedDict[bytes, str | None] = OrderedDict()
_SCHEMA_CACHE_SIZE = 1024


def _schema_problem(schema: dict[str, Any]) -> str | None:
    key = msgspec.json.encode(schema)
    if key in _SCHEMA_VERDICTS:
        _SCHEMA_VERDICTS.move_to_end(key)
        return _SCHEMA_VERDICTS[key]
    try:
        validators.validator_for(schema).check_schema(schema)
        problem = None
    except jsonschema_errors.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "(top level)"
        problem = f"{exc.message} at {where}"
    _SCHEMA_VERDICTS[key] = problem
    if len(_SCHEMA_VERDICTS) > _SCHEMA_CACHE_SIZE:
        _SCHEMA_VERDICTS.popitem(last=False)
    return problem


# -- responses ----------------------------------------------------------------------------


class ToolCallFunction(Wire):
    name: str
    arguments: str


class ToolCallOut(Wire):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class TopLogprobOut(Wire):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(Wire):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprobOut]


class ChoiceLogprobs(Wire):
    content: list[TokenLogprob] | None
    refusal: None = None


class AssistantMessage(Wire):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: None = None
    tool_calls: list[ToolCallOut] | None = None


class Choice(Wire):
    index: int = 0
    message: AssistantMessage
    finish_reason: str
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(Wire):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage


class DeltaToolCall(Wire):
    index: int
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class Delta(Wire):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChunkChoice(Wire):
    index: int = 0
    delta: Delta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(Wire):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
