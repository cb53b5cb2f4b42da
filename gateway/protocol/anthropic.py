"""Anthropic Messages (``POST /v1/messages``): the request, as Claude Code and the ``anthropic``
SDK send it (the reply, its stream events and the error body: ``anthropic_reply``).

The request is checked here, at the edge; ``gateway.serving.anthropic_service`` translates it
into the canonical conversation. What the gateway cannot do is refused with a 400 naming the
field, what does not change the reply is accepted:

- ``system`` (a string or text blocks), and ``role: "system"`` messages inside ``messages``
  (Claude Code sends its environment block so): both become system messages.
- Content blocks: ``text`` (``cache_control``, ``citations`` and other decorations ignored),
  ``tool_result`` (``content`` a string or text blocks; ``is_error`` is not recorded: the
  content says what failed), ``tool_use``; the assistant's ``thinking`` / ``redacted_thinking``
  blocks are accepted and dropped (this gateway never produces them). ``image`` blocks are
  taken in user messages and in ``tool_result`` content (a computer-use agent's screenshot),
  with a ``base64`` source (a ``url`` source only from a host the gateway lists; a ``file``
  source is refused: the gateway has no Files API); the image itself is checked by
  ``gateway.images.intake``. ``document`` blocks are refused (send their text), and so are
  images in system or assistant messages. Any other block type is refused, by name.
  Extra keys of a message or a block are ignored (Claude Code's system message carries
  ``output_config``).
- ``tools``: custom tools (``type`` absent or ``"custom"``) are offered to the model; server
  tools (any other ``type``: ``web_search_20250305``, ``bash_20250124``, ...) are not, and are
  recorded with the turn as sent. Extra tool keys (``cache_control``, ``defer_loading``, ...)
  are ignored.
- ``temperature`` (0..1), ``top_p``, ``stop_sequences``, ``tool_choice`` (with
  ``disable_parallel_tool_use``) are honoured; ``top_k`` only unset: sampling uses temperature
  and top_p.
- ``metadata``, ``thinking``, ``context_management``, ``output_config`` (``effort``) are
  recorded with the turn and otherwise ignored; ``output_config.format`` (structured output) is
  refused. ``service_tier``, ``container``, ``diagnostics``, ``inference_geo``, ``speed``,
  ``user_profile_id``, ``workspace_id`` and a top-level ``cache_control`` are ignored (they
  route, bill or cache, never change the reply, and are not recorded); ``mcp_servers`` is
  refused unless empty. Any other field is refused with a 400 naming it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    PrivateAttr,
    Tag,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from gateway.protocol.images import ImageBlock
from gateway.protocol.validated_once import validated_once_field
from gateway.protocol.wire import (
    JSON_VALUE_SCHEMA,
    JSONObject,
    TokenCount,
    TopP,
    free_form_extras,
    schema_problem,
)

__all__ = [
    "AssistantTurn",
    "CountTokensRequest",
    "CustomTool",
    "ImageBlock",
    "MessagesRequest",
    "ServerTool",
    "TextBlock",
    "ToolChoiceTool",
    "ToolResultBlock",
    "ToolUseBlock",
    "block_text",
]

# Blocks Anthropic's API takes that this gateway does not: refused with this reason.
_MEDIA = ("image", "document")


def _refuse_media(data: Any, key: str, media: tuple[str, ...] = _MEDIA) -> Any:
    """A clear 400 for ``media`` blocks in ``data[key]`` (the block union alone would answer a
    type error per union member): a model ``mode="before"`` check."""
    blocks = data.get(key) if isinstance(data, dict) else None
    if isinstance(blocks, list):
        for i, block in enumerate(blocks):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "document":
                raise ValueError(
                    f"{key} block {i} has type 'document': not supported by this gateway; send "
                    "its content as text"
                )
            if kind in media:
                raise ValueError(
                    f"{key} block {i} has type {kind!r}: images are taken in user messages and "
                    "tool_result content only"
                )
    return data


class _TextOnly(BaseModel):
    """A model whose ``content`` blocks may not be media."""

    # Extra keys are ignored: Claude Code's system message carries its output_config.
    model_config = ConfigDict(extra="allow", json_schema_extra=free_form_extras)

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        return _refuse_media(data, "content")


class _Seeing(_TextOnly):
    """A model whose ``content`` blocks may be images, not documents."""

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        return _refuse_media(data, "content", media=())


class TextBlock(BaseModel):
    """A text block; ``cache_control``, ``citations`` and other decorations are ignored."""

    model_config = ConfigDict(extra="allow", json_schema_extra=free_form_extras)

    type: Literal["text"]
    text: str


def _content_kind(content: Any) -> str:
    return "string" if isinstance(content, str) else "blocks"


# Content is a string or a list of blocks; the tag makes an error name only the form sent.
_ByForm = Discriminator(_content_kind)
TextContentIn = Annotated[
    Annotated[str, Tag("string")] | Annotated[list[TextBlock], Tag("blocks")], _ByForm
]


def block_text(content: str | list[TextBlock] | None) -> str:
    """A string, or text blocks joined with "" (the same text whichever way a client sends it).

    >>> block_text([TextBlock(type="text", text="a"), TextBlock(type="text", text="b")])
    'ab'
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(block.text for block in content)


ResultBlock = Annotated[TextBlock | ImageBlock, Field(discriminator="type")]
ResultContent = Annotated[
    Annotated[str, Tag("string")] | Annotated[list[ResultBlock], Tag("blocks")], _ByForm
]


class ToolResultBlock(_Seeing):
    """A tool's result, answering the assistant's ``tool_use`` block ``tool_use_id``."""

    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=256)
    content: ResultContent | None = None
    is_error: bool | None = Field(None, description="not recorded: the content says what failed")


class ToolUseBlock(BaseModel):
    """A tool call of the assistant's, as the client sends it back."""

    model_config = ConfigDict(extra="allow", json_schema_extra=free_form_extras)

    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=256)
    input: JSONObject


class ThinkingBlock(BaseModel):
    """Accepted in assistant messages and dropped: this gateway never produces thinking."""

    model_config = ConfigDict(extra="allow", json_schema_extra=free_form_extras)

    type: Literal["thinking", "redacted_thinking"]


UserBlock = Annotated[TextBlock | ImageBlock | ToolResultBlock, Field(discriminator="type")]
AssistantBlock = Annotated[TextBlock | ToolUseBlock | ThinkingBlock, Field(discriminator="type")]
UserContent = Annotated[
    Annotated[str, Tag("string")] | Annotated[list[UserBlock], Tag("blocks")], _ByForm
]
AssistantContent = Annotated[
    Annotated[str, Tag("string")] | Annotated[list[AssistantBlock], Tag("blocks")], _ByForm
]


class UserTurn(_Seeing):
    role: Literal["user"]
    content: UserContent


class AssistantTurn(_TextOnly):
    role: Literal["assistant"]
    content: AssistantContent


class SystemTurn(_TextOnly):
    """A system message inside ``messages`` (Claude Code's environment block)."""

    role: Literal["system"]
    content: TextContentIn


InputMessage = Annotated[UserTurn | AssistantTurn | SystemTurn, Field(discriminator="role")]


class _Tool(BaseModel):
    model_config = ConfigDict(extra="allow", json_schema_extra=free_form_extras)
    _raw: dict[str, Any] = PrivateAttr(default_factory=dict)

    @model_validator(mode="wrap")
    @classmethod
    def _keep_raw(cls, data: Any, handler: Any) -> Any:
        tool = handler(data)
        tool._raw = data if isinstance(data, dict) else tool.model_dump(exclude_none=True)
        return tool

    @property
    def raw(self) -> dict[str, Any]:
        """The tool as the client sent it."""
        return self._raw


class CustomTool(_Tool):
    """A client tool: offered to the model as a function; extra keys (``cache_control``,
    ``defer_loading``, ...) are ignored."""

    type: Literal["custom"] | None = None
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    input_schema: JSONObject = Field(description="a JSON schema of the tool's input")

    @field_validator("input_schema")
    @classmethod
    def _json_schema(cls, schema: dict[str, Any]) -> dict[str, Any]:
        problem = schema_problem(schema)
        if problem is not None:
            raise ValueError(f"input_schema is not a valid JSON schema: {problem}")
        return schema


class ServerTool(_Tool):
    """A server tool (Anthropic runs these: web search, code execution, ...): accepted, not
    offered to the model, recorded with the turn as sent."""

    type: Annotated[
        str,
        WithJsonSchema({"type": "string", "pattern": "^[a-z_]+_[0-9]{8}$"}),
        Field(description="a server tool type, as web_search_20250305"),
    ]
    name: str | None = None


def _tool_kind(tool: Any) -> str:
    kind = tool.get("type") if isinstance(tool, dict) else getattr(tool, "type", None)
    return "custom" if kind in (None, "custom") else "server"


Tool = Annotated[
    Annotated[CustomTool, Tag("custom")] | Annotated[ServerTool, Tag("server")],
    Discriminator(_tool_kind),
]


class _ParallelChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    disable_parallel_tool_use: bool = Field(False, description="true: at most one tool call")


class ToolChoiceAuto(_ParallelChoice):
    type: Literal["auto"]


class ToolChoiceAny(_ParallelChoice):
    """The model must call one of the tools (the gateway opens the call in the prompt)."""

    type: Literal["any"]


class ToolChoiceNone(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["none"]


class ToolChoiceTool(_ParallelChoice):
    """The model must call this tool (one of ``tools``)."""

    type: Literal["tool"]
    name: str = Field(min_length=1, max_length=256)


ToolChoice = Annotated[
    ToolChoiceAuto | ToolChoiceAny | ToolChoiceNone | ToolChoiceTool, Field(discriminator="type")
]
Temperature = Annotated[float, Field(ge=0, le=1)]


def _unset_only(what: str) -> Any:
    def check(value: object) -> object:
        if value is not None:
            raise ValueError(what)
        return value

    return BeforeValidator(check)


class _OutputConfig(BaseModel):
    model_config = ConfigDict(extra="allow", json_schema_extra=free_form_extras)

    effort: str | None = Field(None, description="recorded, ignored")
    format: Annotated[
        None,
        _unset_only("output_config.format (structured output) is not supported by this gateway"),
    ] = None


def _empty_list(value: object) -> object:
    if value:
        raise ValueError("mcp_servers is not supported by this gateway: omit it or send []")
    return value


def _closed(schema: dict[str, Any]) -> None:
    schema["additionalProperties"] = False


# Accepted, never read: any JSON value.
Ignored = Annotated[Any, WithJsonSchema({**JSON_VALUE_SCHEMA, "description": "accepted, ignored"})]


# The models list every top-level field they take; any other is refused by name.
class _MessagesInput(BaseModel):
    """What a turn's prompt is made of (shared with count_tokens)."""

    model_config = ConfigDict(extra="allow", json_schema_extra=_closed)

    model: str = Field(max_length=256, description="the served model (GET /v1/models)")
    # Bounded so that validating one request cannot hold the event loop for long.
    messages: list[InputMessage] = Field(min_length=1, max_length=10_000)
    system: TextContentIn | None = Field(None, description="text blocks are joined with ''")
    tools: list[Tool] | None = Field(None, max_length=1024)
    tool_choice: ToolChoice | None = Field(None, description="a named tool must be one of tools")
    thinking: JSONObject | None = Field(None, description="recorded; no thinking is produced")
    context_management: JSONObject | None = Field(None, description="recorded, ignored")
    output_config: _OutputConfig | None = Field(None, description="recorded; no format")
    # Request decorations that never change the reply (caching, routing, billing).
    cache_control: Ignored = None
    speed: Ignored = None
    user_profile_id: Ignored = None
    workspace_id: Ignored = None
    mcp_servers: Annotated[
        list[Any] | None,
        WithJsonSchema({"type": "array", "maxItems": 0}),
        BeforeValidator(_empty_list),
    ] = Field(None, description="MCP servers are not supported: empty or absent")

    _tools_once = validated_once_field("tools")  # a session's resent tools: once

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        return _refuse_media(data, "system")

    @model_validator(mode="after")
    def _checked(self) -> _MessagesInput:
        for name in self.model_extra or {}:
            raise ValueError(
                f"parameter {name!r} is not supported by this gateway (see /docs for the "
                "fields it takes)"
            )
        return self

    @property
    def custom_tools(self) -> list[CustomTool]:
        return [t for t in self.tools or () if isinstance(t, CustomTool)]

    @property
    def server_tools(self) -> list[ServerTool]:
        return [t for t in self.tools or () if isinstance(t, ServerTool)]


class MessagesRequest(_MessagesInput):
    """``POST /v1/messages``."""

    max_tokens: TokenCount = Field(
        description="a cap: lowered to the room the prompt leaves in the context"
    )
    stop_sequences: list[str] | None = Field(None, max_length=16)
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: Annotated[
        int | None,
        WithJsonSchema({"type": "null"}),
        _unset_only(
            "top_k is not supported by this gateway (it samples with temperature and "
            "top_p): omit it"
        ),
    ] = Field(None, description="not supported: omit it")
    stream: bool = False
    metadata: JSONObject | None = Field(None, description="recorded, ignored")
    service_tier: Ignored = None
    container: Ignored = None
    diagnostics: Ignored = None
    inference_geo: Ignored = None

    @model_validator(mode="after")
    def _named_tool_offered(self) -> MessagesRequest:
        # Not checked by count_tokens: the choice does not change what the prompt counts.
        choice = self.tool_choice
        if isinstance(choice, ToolChoiceTool):
            names = [t.name for t in self.custom_tools]
            if choice.name not in names:
                raise ValueError(
                    f"tool_choice names tool {choice.name!r}, not among the custom tools {names}"
                )
        return self


class CountTokensRequest(_MessagesInput):
    """``POST /v1/messages/count_tokens``: the prompt's length as this gateway renders it."""
