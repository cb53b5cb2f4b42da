"""OpenAI Responses API (``POST /v1/responses``): the request (the response object and the
stream events: ``responses_reply``).

What Codex CLI and the OpenAI Agents SDK send is accepted or refused by rule:

- Function tools (flat: ``{"type": "function", "name", "description", "parameters",
  "strict"}``) are offered to the model. Every other tool type (``namespace``, ``web_search``,
  ...) is accepted and NOT offered: the turn records it in ``unoffered_tools``.
- Input items: messages (``type`` "message" or omitted; text content only), ``function_call``,
  ``function_call_output``, and ``reasoning`` (dropped: the gateway never produces reasoning,
  so a reasoning item can only be another model's). Any other item type is a 400 naming it.
- Recorded with the turn, never changing the completion: ``reasoning``, ``store``, ``include``
  (but ``message.output_text.logprobs``, which adds logprobs), ``prompt_cache_key``,
  ``metadata``, ``client_metadata``, ``previous_response_id``.
- Accepted and ignored: ``user``, ``service_tier``, ``truncation`` (``auto`` too: the gateway
  never drops input; a prompt over the context is a 413 either way), ``text`` with the
  ``text`` format and any ``verbosity`` (a ``json_schema`` format is a 400: no structured
  output here).
- Any other top-level field is a 400 naming it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from gateway.protocol.chat import FunctionDefinition
from gateway.protocol.wire import (
    JSONObject,
    Temperature,
    TokenCount,
    TopP,
    free_form_extras,
)

__all__ = [
    "FunctionCallItem",
    "FunctionCallOutputItem",
    "FunctionChoice",
    "FunctionTool",
    "HostedTool",
    "InputTextPart",
    "MessageItem",
    "ReasoningItem",
    "ResponsesRequest",
    "ToolOutputPart",
    "item_text",
]

# resp_<session>_<reply>: the reply a per-request id (12 hex digits), or a turn index (older ids)
RESPONSE_ID = r"^resp_[A-Za-z0-9_-]{1,64}_[0-9a-f]{1,12}$"
LOGPROBS_INCLUDE = "message.output_text.logprobs"

# -- input items --------------------------------------------------------------------------

_BINARY_PARTS = {"input_image", "input_file", "input_audio"}


def _text_part(value: Any) -> Any:
    """Names what is wrong with a content part before the union's generic message would."""
    if isinstance(value, dict):
        kind = value.get("type")
        if kind in _BINARY_PARTS:
            raise ValueError(
                f"content part type {kind!r} is not supported: this gateway serves a text "
                "model; send the content as input_text"
            )
        if kind not in ("input_text", "output_text"):
            raise ValueError(
                f"content part type {str(kind)[:64]!r} is not supported: send input_text parts "
                "(output_text for the model's own replies)"
            )
    return value


class InputTextPart(BaseModel):
    """``input_text``, or ``output_text`` (a reply echoed back; its annotations and logprobs
    are kept as extra fields and never reach the prompt)."""

    model_config = ConfigDict(extra="allow", json_schema_extra=free_form_extras)

    type: Literal["input_text", "output_text"]
    text: str


def _text_or_list(value: Any) -> str | None:
    if isinstance(value, str):
        return "text"
    return "list" if isinstance(value, list) else None


def text_or_list(items: Any, what: str) -> Any:
    """``str | list[items]``, whose errors are the branch the value took (a plain union
    reports every branch's)."""
    return Annotated[
        Annotated[str, Tag("text")] | Annotated[items, Tag("list")],
        Discriminator(
            _text_or_list,
            custom_error_type="text_or_list",
            custom_error_message=f"must be a string or a list of {what}",
        ),
    ]


TextParts = list[Annotated[InputTextPart, BeforeValidator(_text_part)]]
TextContent = text_or_list(TextParts, "input_text parts")


def item_text(content: str | Sequence[InputTextPart | ToolOutputPart]) -> str:
    """A message's or tool output's text: a string, or its parts' texts joined (as Chat
    Completions joins text parts), so both forms of the same text are the same message.

    >>> part = InputTextPart(type="input_text", text="ab")
    >>> item_text([part, part]), item_text("abab")
    ('abab', 'abab')
    """
    if isinstance(content, str):
        return content
    return "".join(part.text for part in content)


class MessageItem(BaseModel):
    # id, status and the like: a client's bookkeeping, never the prompt's
    model_config = ConfigDict(extra="allow", json_schema_extra=free_form_extras)

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: TextContent  # type: ignore[valid-type]


class FunctionCallItem(BaseModel):
    """A function call of the model's, sent back (it joins the assistant message before it)."""

    model_config = ConfigDict(extra="allow", json_schema_extra=free_form_extras)

    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=256)
    arguments: str = Field(description="the call's arguments, a JSON string")


def _output_part(value: Any) -> Any:
    if isinstance(value, dict) and value.get("type") != "input_text":
        kind = str(value.get("type"))[:64]
        raise ValueError(
            f"function_call_output part type {kind!r} is not supported: send the tool's output "
            "as a string or input_text parts"
        )
    return value


class ToolOutputPart(BaseModel):
    model_config = ConfigDict(extra="allow", json_schema_extra=free_form_extras)

    type: Literal["input_text"]
    text: str


class FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(extra="allow", json_schema_extra=free_form_extras)

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=256)
    output: text_or_list(  # type: ignore[valid-type]
        list[Annotated[ToolOutputPart, BeforeValidator(_output_part)]], "input_text parts"
    )


class ReasoningItem(BaseModel):
    """Dropped: the gateway never produces reasoning (it is another model's)."""

    model_config = ConfigDict(extra="allow", json_schema_extra=free_form_extras)

    type: Literal["reasoning"]


_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


def _item_kind(value: Any) -> str | None:
    if isinstance(value, dict):
        kind = value.get("type", "message")
        return kind if kind in _ITEM_TYPES else None
    kind = getattr(value, "type", None)
    return kind if kind in _ITEM_TYPES else None


def _known_item(value: Any) -> Any:
    """Refuses an item the gateway cannot put in a prompt, saying why and what to send."""
    if not isinstance(value, dict):
        return value
    kind = value.get("type", "message")
    if kind in _ITEM_TYPES:
        return value
    name = str(kind)[:64]
    if kind == "item_reference":
        raise ValueError(
            "input item type 'item_reference' is not supported: the gateway stores no items "
            "by id; send the item itself, or previous_response_id to continue a response"
        )
    if isinstance(kind, str) and (kind.endswith("_call") or kind.endswith("_call_output")):
        raise ValueError(
            f"input item type {name!r} is not supported: only function tools are offered to "
            "the model here; send function_call and function_call_output items"
        )
    raise ValueError(
        f"input item type {name!r} is not supported: send message, function_call, "
        "function_call_output or reasoning items"
    )


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_kind),
    BeforeValidator(_known_item),
]

# -- tools ----------------------------------------------------------------------------------


class FunctionTool(FunctionDefinition):
    """A function tool, flat as this API sends it; offered to the model as the chat shape
    ``{"type": "function", "function": {name, description, parameters}}`` (``strict`` is the
    client's wish for constrained decoding, which the gateway does not do)."""

    type: Literal["function"]
    strict: bool | None = None


class HostedTool(BaseModel):
    """Any other tool (``namespace``, ``web_search``, ...): recorded, not offered."""

    model_config = ConfigDict(extra="allow", json_schema_extra=free_form_extras)

    type: str = Field(min_length=1, max_length=64)


def _tool_kind(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    if not isinstance(kind, str):
        return None
    return "function" if kind == "function" else "hosted"


Tool = Annotated[
    Annotated[FunctionTool, Tag("function")] | Annotated[HostedTool, Tag("hosted")],
    Discriminator(
        _tool_kind,
        custom_error_type="tool_type",
        custom_error_message="every tool needs a string type: function (offered to the model) "
        "or another (recorded, not offered)",
    ),
]


class FunctionChoice(BaseModel):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=256)


def _text_format(value: Any) -> Any:
    if isinstance(value, dict) and value.get("type") != "text":
        kind = str(value.get("type"))[:64]
        raise ValueError(
            f"text.format {kind!r} is not supported: the gateway does no structured output; "
            'use {"type": "text"} and ask for the format in the prompt'
        )
    return value


class TextFormat(BaseModel):
    type: Literal["text"]


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: Annotated[TextFormat, BeforeValidator(_text_format)] | None = None
    verbosity: str | None = Field(None, max_length=32, description="accepted and ignored")


# -- the request ----------------------------------------------------------------------------


def _no_other_fields(schema: dict[str, Any]) -> None:
    schema["additionalProperties"] = False


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``. Fields beyond the ones below are refused with a 400 naming them."""

    # Unknown fields reach _unsupported, which names them in its 400.
    model_config = ConfigDict(extra="allow", json_schema_extra=_no_other_fields)

    model: str | None = Field(None, description="the served model (GET /v1/models); omitted: it")
    # Bounded so that validating one request cannot hold the event loop for long.
    input: text_or_list(  # type: ignore[valid-type]
        Annotated[list[InputItem], Field(max_length=10_000)], "input items"
    ) = Field(
        description="a user message's text, or items: messages, function_call, "
        "function_call_output, reasoning (dropped)"
    )
    instructions: str | None = Field(None, description="a leading system message")
    tools: list[Tool] | None = Field(
        None, max_length=1024, description="function tools are offered; other types recorded"
    )
    tool_choice: Literal["auto", "none", "required"] | FunctionChoice | None = Field(
        None,
        description="a named function must be one of the function tools; 'required' "
        "needs function tools",
    )
    parallel_tool_calls: bool = True
    max_output_tokens: TokenCount | None = Field(
        None, description="a cap: lowered to the room the prompt leaves in the context"
    )
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_logprobs: int | None = Field(
        None,
        ge=0,
        le=20,
        description="alternatives per token, with include message.output_text.logprobs",
    )
    stream: bool = False
    previous_response_id: str | None = Field(
        None,
        pattern=RESPONSE_ID,
        description="continue the conversation of this response (the session's last one): "
        "its messages, its reply, then this input",
    )
    # Recorded with the turn, never changing the completion:
    reasoning: JSONObject | None = Field(None, description="recorded; the model does not reason")
    include: list[Annotated[str, Field(max_length=128)]] | None = Field(
        None,
        max_length=32,
        description=f"recorded; {LOGPROBS_INCLUDE} adds the tokens' logprobs",
    )
    store: bool | None = Field(None, description="recorded; every turn is in the log anyway")
    prompt_cache_key: str | None = Field(None, max_length=1024, description="recorded")
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = Field(
        None, max_length=64, description="recorded"
    )
    client_metadata: JSONObject | None = Field(None, description="recorded (Codex's telemetry)")
    # Accepted and ignored:
    user: str | None = Field(None, max_length=1024, description="ignored")
    service_tier: str | None = Field(None, max_length=64, description="ignored")
    text: TextConfig | None = Field(None, description='only {"format": {"type": "text"}}')
    truncation: Literal["auto", "disabled"] | None = Field(
        None, description="the gateway never drops input (auto included)"
    )

    @model_validator(mode="after")
    def _unsupported(self) -> ResponsesRequest:
        for name, value in (self.model_extra or {}).items():
            raise _invalid(
                name,
                value,
                f"parameter {name[:64]!r} is not supported by this gateway's Responses API "
                "(see /docs for the fields it takes)",
            )
        names = [t.name for t in self.function_tools]
        choice = self.tool_choice
        if isinstance(choice, FunctionChoice) and choice.name not in names:
            raise _invalid(
                "tool_choice",
                choice.model_dump(),
                f"tool_choice names function {choice.name!r}, not among the function tools {names}",
            )
        if choice == "required" and not names:
            raise _invalid("tool_choice", choice, "tool_choice 'required' needs function tools")
        return self

    @property
    def function_tools(self) -> list[FunctionTool]:
        return [t for t in self.tools or () if isinstance(t, FunctionTool)]

    @property
    def logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ())


def _invalid(field: str, value: object, message: str) -> ValidationError:
    """A validation error located at ``field`` (the 400 names it as its param)."""
    error = PydanticCustomError("invalid_field", "{message}", {"message": message})
    return ValidationError.from_exception_data(
        "ResponsesRequest", [InitErrorDetails(type=error, loc=(field,), input=value)]
    )
