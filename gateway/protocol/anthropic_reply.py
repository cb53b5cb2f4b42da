"""Anthropic Messages: what the gateway answers: the message, the stream events, the token count
and the error body (the request is ``gateway.protocol.anthropic``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from gateway.protocol.wire import Wire

__all__ = [
    "AnthropicError",
    "AnthropicErrorResponse",
    "ContentBlockDeltaEvent",
    "ContentBlockStartEvent",
    "ContentBlockStopEvent",
    "InputJsonDelta",
    "Message",
    "MessageDelta",
    "MessageDeltaEvent",
    "MessageDeltaUsage",
    "MessageStartEvent",
    "MessageStopEvent",
    "MessageUsage",
    "StreamErrorEvent",
    "TextContent",
    "TextDelta",
    "TokenCountResult",
    "ToolUseContent",
]


# -- responses ----------------------------------------------------------------------------


class TextContent(Wire):
    type: Literal["text"] = "text"
    text: str


class ToolUseContent(Wire):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class MessageUsage(Wire):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


StopReason = Literal[
    "end_turn", "max_tokens", "stop_sequence", "tool_use", "model_context_window_exceeded"
]


class Message(Wire):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[TextContent | ToolUseContent]
    stop_reason: StopReason | None
    stop_sequence: str | None = None
    usage: MessageUsage


class MessageStartEvent(Wire):
    type: Literal["message_start"] = "message_start"
    message: Message


class ContentBlockStartEvent(Wire):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: TextContent | ToolUseContent


class TextDelta(Wire):
    type: Literal["text_delta"] = "text_delta"
    text: str


class InputJsonDelta(Wire):
    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str


class ContentBlockDeltaEvent(Wire):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: TextDelta | InputJsonDelta


class ContentBlockStopEvent(Wire):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class MessageDelta(Wire):
    stop_reason: StopReason
    stop_sequence: str | None = None


class MessageDeltaUsage(Wire):
    output_tokens: int
    input_tokens: int | None = None


class MessageDeltaEvent(Wire):
    type: Literal["message_delta"] = "message_delta"
    delta: MessageDelta
    usage: MessageDeltaUsage


class MessageStopEvent(Wire):
    type: Literal["message_stop"] = "message_stop"


class TokenCountResult(Wire):
    input_tokens: int


class AnthropicError(BaseModel):
    type: str = Field(description="e.g. invalid_request_error, not_found_error, overloaded_error")
    message: str = Field(description="what was wrong and what to do")


class AnthropicErrorResponse(BaseModel):
    """Every error on the Messages routes: Anthropic's error body."""

    type: Literal["error"] = "error"
    error: AnthropicError


class StreamErrorEvent(Wire):
    """An error after the stream started (``event: error``)."""

    type: Literal["error"] = "error"
    error: dict[str, str]
