"""OpenAI Chat Completions: the request and response models.

Parameters the gateway does not implement are refused (400) when set to a value that would
change the result, and ignored when they are at their defaults, so unmodified agents work.
Tools keep the exact JSON the client sent (``ChatTool.raw``): it is what the chat template
renders and what the log records. A user's or a tool's message may hold ``image_url`` parts
(``ImagePart``; checked at the edge by ``gateway.serving.image_input``); the system's and the
assistant's hold text.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    field_validator,
    model_validator,
)

from gateway.protocol.images import ImageInput, ImagePart
from gateway.protocol.validated_once import validated_once_field
from gateway.protocol.wire import (
    JSON_VALUE_SCHEMA,
    Int64,
    JSONObject,
    Temperature,
    TokenCount,
    TopP,
    Usage,
    Wire,
    free_form_extras,
    schema_problem,
)

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
    "Content",
    "Delta",
    "DeltaToolCall",
    "ImagePart",
    "NamedToolChoice",
    "SeeingContent",
    "TextPart",
    "TokenLogprob",
    "ToolCallFunction",
    "ToolCallOut",
    "TopLogprobOut",
    "content_items",
    "message_text",
]

Role = Literal["system", "developer", "user", "assistant", "tool"]


def _documented_extras(schema: dict[str, Any]) -> None:
    """The schema names the fields accepted beyond the model's own (at their neutral values,
    or ignored) and nothing else: any other field is refused."""
    properties = schema.setdefault("properties", {})
    for name, values in _NEUTRAL.items():
        properties[name] = {"enum": list(values), "description": "accepted at its neutral value"}
    for name in sorted(_IGNORED):
        properties[name] = {
            **JSON_VALUE_SCHEMA,
            "description": "accepted and ignored (never changes the completion)",
        }
    schema["additionalProperties"] = False


class OpenAIRequest(BaseModel):
    # Unknown OpenAI fields reach _unsupported, which names the field in its 400.
    model_config = ConfigDict(extra="allow", json_schema_extra=_documented_extras)

    stop: str | Annotated[list[str], Field(max_length=16)] | None = None

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

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

    model_config = ConfigDict(extra="allow", json_schema_extra=free_form_extras)

    name: str
    arguments: str | JSONObject = ""


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow", json_schema_extra=free_form_extras)

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class TextPart(BaseModel):
    # cache_control and the like
    model_config = ConfigDict(extra="allow", json_schema_extra=free_form_extras)

    type: Literal["text"]
    text: str


Content = str | list[TextPart] | None
# A user's or a tool's message may show images (a computer-use agent's tool returns a
# screenshot); the system's and the assistant's hold text.
SeeingContent = str | list[Annotated[TextPart | ImagePart, Field(discriminator="type")]]


class _Message(BaseModel):
    # extra fields are recorded with the message
    model_config = ConfigDict(extra="allow", json_schema_extra=free_form_extras)

    content: Any  # each role's own (declared here: the field comes first, as it always has)
    name: str | None = None


class SystemMessage(_Message):
    role: Literal["system", "developer"]
    content: str | list[TextPart]  # required, and not null: only the assistant may omit it


class UserMessage(_Message):
    role: Literal["user"]
    content: SeeingContent


class AssistantTurn(_Message):
    """An assistant message a client sends back (the model's earlier reply)."""

    role: Literal["assistant"]
    content: Content = None
    tool_calls: list[ToolCall] | None = None


class ToolMessage(_Message):
    role: Literal["tool"]
    content: SeeingContent
    tool_call_id: str = Field(description="the id of the tool call this result answers")


ChatMessage = Annotated[
    SystemMessage | UserMessage | AssistantTurn | ToolMessage, Field(discriminator="role")
]


def message_text(content: Content) -> str | None:
    """The text of a message: a string, or the concatenated text parts.

    >>> message_text([TextPart(type="text", text="a"), TextPart(type="text", text="b")])
    'ab'
    """
    if content is None or isinstance(content, str):
        return content
    return "".join(part.text for part in content)


def content_items(content: Content | SeeingContent) -> list[str | ImageInput] | str | None:
    """A message's content as texts and image parts, in order (a string or None as it is)."""
    if content is None or isinstance(content, str):
        return content
    return [part.text if isinstance(part, TextPart) else part for part in content]


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow", json_schema_extra=free_form_extras)

    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: JSONObject | None = Field(None, description="a JSON schema")

    @field_validator("parameters")
    @classmethod
    def _json_schema(cls, parameters: dict[str, Any] | None) -> dict[str, Any] | None:
        if parameters is not None:
            problem = schema_problem(parameters)
            if problem is not None:
                raise ValueError(f"parameters is not a valid JSON schema: {problem}")
        return parameters


class ChatTool(BaseModel):
    model_config = ConfigDict(extra="allow", json_schema_extra=free_form_extras)

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
    model_config = ConfigDict(extra="allow", json_schema_extra=free_form_extras)

    include_usage: bool = False


class ChatCompletionRequest(OpenAIRequest):
    model: str | None = Field(None, description="the served model (GET /v1/models); omitted: it")
    # Bounded so that validating one request cannot hold the event loop for long (260k tiny
    # messages took 1.3 s); agents' sessions stay far below it within any context length.
    messages: list[ChatMessage] = Field(min_length=1, max_length=10_000)
    tools: list[ChatTool] | None = Field(None, max_length=1024)
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = Field(
        None, description="a named function must be one of the tools; 'required' needs tools"
    )
    parallel_tool_calls: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20, description="needs logprobs=true")
    max_tokens: TokenCount | None = Field(
        None, description="a cap: lowered to the room the prompt leaves in the context"
    )
    max_completion_tokens: TokenCount | None = Field(None, description="as max_tokens")
    temperature: Temperature | None = None
    top_p: TopP | None = None
    seed: Int64 | None = None
    n: int = Field(1, ge=1, le=1, description="one choice per turn: a turn is one sample")

    _tools_once = validated_once_field("tools")  # a session's resent tools: once

    @model_validator(mode="after")
    def _consistent(self) -> ChatCompletionRequest:
        # tool_choice against tools is the turn core's check (the same for every API).
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        return self

    @property
    def raw_tools(self) -> list[dict[str, Any]] | None:
        return [t.raw for t in self.tools] if self.tools else None

    @property
    def token_budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


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
