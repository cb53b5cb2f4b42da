"""OpenAI Responses: what the gateway answers: the response object and the typed stream events
(the request is ``gateway.protocol.responses``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from gateway.protocol.chat import TokenLogprob
from gateway.protocol.wire import JSON_VALUE_SCHEMA, Wire

__all__ = [
    "ArgumentsDeltaEvent",
    "ArgumentsDoneEvent",
    "ContentPartEvent",
    "IncompleteDetails",
    "InputTokensDetails",
    "LifecycleEvent",
    "OutputFunctionCall",
    "OutputItemEvent",
    "OutputMessage",
    "OutputText",
    "OutputTokensDetails",
    "ResponseError",
    "ResponseErrorEvent",
    "ResponseObject",
    "ResponseUsage",
    "TextDeltaEvent",
    "TextDoneEvent",
]


# -- the response ---------------------------------------------------------------------------


class OutputText(Wire):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any]
    logprobs: list[TokenLogprob]


class OutputMessage(Wire):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class OutputFunctionCall(Wire):
    """A call of the model's; of a namespace's function: its ``namespace`` and bare ``name``,
    as the client offered it (left out for any other function)."""

    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]
    namespace: str | None = Field(None, exclude_if=lambda value: value is None)


class InputTokensDetails(Wire):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(Wire):
    reasoning_tokens: int = 0


class ResponseUsage(Wire):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(Wire):
    reason: Literal["max_output_tokens"] = "max_output_tokens"


class ResponseError(Wire):
    code: str
    message: str


class ResponseObject(Wire):
    """A response; its request's parameters are echoed as the OpenAI API does."""

    id: str = Field(description="resp_<session>_<turn>: names the session and the turn")
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    model: str
    output: list[OutputMessage | OutputFunctionCall]
    usage: ResponseUsage | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    tool_choice: Any = Field("auto", json_schema_extra=JSON_VALUE_SCHEMA)
    tools: list[dict[str, Any]]
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    max_output_tokens: int | None = None
    reasoning: dict[str, Any] | None = None
    store: bool | None = None
    text: dict[str, Any]
    truncation: Literal["auto", "disabled"] = "disabled"
    user: str | None = None
    prompt_cache_key: str | None = None
    background: bool = False


# -- stream events --------------------------------------------------------------------------


class LifecycleEvent(Wire):
    """response.created, response.in_progress, response.completed, response.incomplete."""

    type: str
    sequence_number: int
    response: ResponseObject


class OutputItemEvent(Wire):
    """response.output_item.added, response.output_item.done."""

    type: str
    sequence_number: int
    output_index: int
    item: OutputMessage | OutputFunctionCall


class ContentPartEvent(Wire):
    """response.content_part.added, response.content_part.done."""

    type: str
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int = 0
    part: OutputText


class TextDeltaEvent(Wire):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int = 0
    delta: str
    logprobs: list[TokenLogprob]


class TextDoneEvent(Wire):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int = 0
    text: str
    logprobs: list[TokenLogprob]


class ArgumentsDeltaEvent(Wire):
    type: Literal["response.function_call_arguments.delta"] = (
        "response.function_call_arguments.delta"
    )
    sequence_number: int
    item_id: str
    output_index: int
    delta: str


class ArgumentsDoneEvent(Wire):
    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
    sequence_number: int
    item_id: str
    output_index: int
    name: str
    arguments: str


class ResponseErrorEvent(Wire):
    """An error after the stream started (its status line is gone); the stream ends."""

    type: Literal["error"] = "error"
    code: str
    message: str
    param: str | None
    sequence_number: int
