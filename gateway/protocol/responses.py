"""OpenAI Responses API (``POST /v1/responses``): the request (the response object and the
stream events: ``responses_reply``).

What Codex CLI and the OpenAI Agents SDK send is accepted or refused by rule:

- Function tools (flat: ``{"type": "function", "name", "description", "parameters",
  "strict"}``) are offered to the model, and so are the function tools of a ``namespace``
  (Codex's multi-agent tools), flattened to ``<namespace>__<name>`` (``responses_tools``).
  Every other tool type (``web_search``, ``custom``, ...) is accepted and NOT offered: the turn
  records it in ``unoffered_tools``.
- Input items: messages (``type`` "message" or omitted; ``input_text``, ``output_text`` and
  ``encrypted_content`` parts, the last as its string, and ``input_image`` parts, not in the
  assistant's), ``function_call``
  (with its ``namespace``, if any), ``function_call_output``, ``agent_message`` (Codex
  multi_agent_v2's messages between agents: rendered as a user message) and ``reasoning``
  (dropped: the gateway never produces reasoning, so a reasoning item can only be another
  model's). Any other item type is a 400 naming it.
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

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from gateway.protocol.responses_items import (
    AgentMessageItem,
    EncryptedPart,
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItem,
    InputTextPart,
    MessageItem,
    ReasoningItem,
    ToolOutputPart,
    item_text,
    text_or_list,
)
from gateway.protocol.responses_tools import (
    MAX_FUNCTIONS,
    FunctionChoice,
    FunctionTool,
    HostedTool,
    NamespaceTool,
    flat_name,
)
from gateway.protocol.validated_once import validated_once_field
from gateway.protocol.wire import (
    JSONObject,
    Temperature,
    TokenCount,
    TopP,
)

__all__ = [
    "AgentMessageItem",
    "EncryptedPart",
    "FunctionCallItem",
    "FunctionCallOutputItem",
    "FunctionChoice",
    "FunctionTool",
    "HostedTool",
    "InputTextPart",
    "MessageItem",
    "NamespaceTool",
    "ReasoningItem",
    "ResponsesRequest",
    "ToolOutputPart",
    "item_text",
]

# resp_<session>_<reply>: the reply a per-request id (12 hex digits), or a turn index (older ids)
RESPONSE_ID = r"^resp_[A-Za-z0-9_-]{1,64}_[0-9a-f]{1,12}$"
LOGPROBS_INCLUDE = "message.output_text.logprobs"

# -- tools ----------------------------------------------------------------------------------


def _tool_kind(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    if not isinstance(kind, str):
        return None
    return kind if kind in ("function", "namespace") else "hosted"


Tool = Annotated[
    Annotated[FunctionTool, Tag("function")]
    | Annotated[NamespaceTool, Tag("namespace")]
    | Annotated[HostedTool, Tag("hosted")],
    Discriminator(
        _tool_kind,
        custom_error_type="tool_type",
        custom_error_message="every tool needs a string type: function, namespace (of "
        "functions: offered to the model) or another (recorded, not offered)",
    ),
]


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
        description="a user message's text, or items: messages, agent_message, function_call, "
        "function_call_output, reasoning (dropped)"
    )
    instructions: str | None = Field(None, description="a leading system message")
    tools: list[Tool] | None = Field(
        None,
        max_length=1024,
        description="function tools and namespaces' functions (as <namespace>__<name>) are "
        "offered; other types recorded",
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
        self._one_function_per_name()
        names = [t.name for t in self.function_tools]
        choice = self.tool_choice
        if isinstance(choice, FunctionChoice) and choice.function not in names:
            hint = ""
            bare = [name for _, name in self.namespaced_functions.values()]
            if choice.namespace is None and choice.name in bare:
                hint = (
                    "; a namespace's function is named with its namespace: "
                    '{"type": "function", "namespace": ..., "name": ...}, or flattened'
                )
            raise _invalid(
                "tool_choice",
                choice.model_dump(exclude_none=True),
                f"tool_choice names function {choice.function!r}, not among the function tools "
                f"{names}{hint}",
            )
        if choice == "required" and not names:
            raise _invalid("tool_choice", choice, "tool_choice 'required' needs function tools")
        return self

    def _one_function_per_name(self) -> None:
        """A namespace's flattened function may not take the name of another function offered
        (a call must name one)."""
        plain = {t.name for t in self.tools or () if isinstance(t, FunctionTool)}
        flattened: dict[str, str] = {}  # offered name -> which namespace's function it is
        for index, tool in enumerate(self.tools or ()):
            if not isinstance(tool, NamespaceTool):
                continue
            for function in tool.tools:
                name = flat_name(tool.name, function.name)
                what = f"function {function.name!r} of namespace {tool.name!r}"
                other = f"function tool {name!r}" if name in plain else flattened.get(name)
                if other is not None:
                    raise _invalid(
                        ("tools", index),
                        name,
                        f"{what} is offered to the model as {name!r}, the name of {other}: "
                        "rename one (a call names one function)",
                    )
                flattened[name] = what

    @field_validator("tools", mode="before")
    @classmethod
    def _bounded_functions(cls, tools: Any) -> Any:
        """At most MAX_FUNCTIONS tools, a namespace's functions each counted: counted before
        they are validated, so that validating one request cannot hold the event loop long."""
        if isinstance(tools, list):
            count = sum(
                len(tool["tools"])
                if isinstance(tool, dict)
                and tool.get("type") == "namespace"
                and isinstance(tool.get("tools"), list)
                else 1
                for tool in tools
            )
            if count > MAX_FUNCTIONS:
                raise ValueError(
                    f"{count} tools offered, namespaces' functions each counted: at most "
                    f"{MAX_FUNCTIONS}"
                )
        return tools

    _tools_once = validated_once_field("tools")  # a session's resent tools: once

    @property
    def function_tools(self) -> list[FunctionTool]:
        """The functions offered to the model, in order: function tools, and each namespace's
        under its flattened name."""
        offered: list[FunctionTool] = []
        for tool in self.tools or ():
            if isinstance(tool, FunctionTool):
                offered.append(tool)
            elif isinstance(tool, NamespaceTool):
                offered += tool.flattened()
        return offered

    @property
    def namespaced_functions(self) -> dict[str, tuple[str, str]]:
        """Each namespace's function by the name it is offered under: (namespace, name), the
        fields of the ``function_call`` item that calls it."""
        return {
            flat_name(tool.name, function.name): (tool.name, function.name)
            for tool in self.tools or ()
            if isinstance(tool, NamespaceTool)
            for function in tool.tools
        }

    @property
    def logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ())


def _invalid(field: str | tuple[str | int, ...], value: object, message: str) -> ValidationError:
    """A validation error located at ``field`` (the 400 names it as its param)."""
    error = PydanticCustomError("invalid_field", "{message}", {"message": message})
    loc = field if isinstance(field, tuple) else (field,)
    return ValidationError.from_exception_data(
        "ResponsesRequest", [InitErrorDetails(type=error, loc=loc, input=value)]
    )
