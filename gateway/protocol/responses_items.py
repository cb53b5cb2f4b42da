"""OpenAI Responses input items (part of ``gateway.protocol.responses``): what a prompt is
built from (``gateway.serving.responses_input`` turns them into chat messages).

Messages hold text: ``input_text``, ``output_text`` (the model's own reply echoed back) and
``encrypted_content`` parts (Codex's, taken as the string they carry), and images
(``input_image``, in a user's, system's or developer's message and in a
``function_call_output``'s output: a data URL, or an http(s) URL of a host the gateway lists; a
``file_id`` is refused, the gateway has no file uploads). Items the gateway cannot put in a
prompt are refused by ``_known_item`` with a message saying what to send.
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
)

from gateway.protocol.images import ImageInput, InputImagePart, refused_file_id
from gateway.protocol.responses_tools import NamespaceName, flat_name
from gateway.protocol.wire import free_form_extras

__all__ = [
    "AgentMessageItem",
    "EncryptedPart",
    "FunctionCallItem",
    "FunctionCallOutputItem",
    "InputImagePart",
    "InputItem",
    "InputTextPart",
    "MessageItem",
    "ReasoningItem",
    "ToolOutputPart",
    "content_items",
    "item_text",
    "text_or_list",
]

# Tuples, as the others: a part's "type" may be any JSON value, and a dict is no set member
# (schemathesis sent one: a TypeError, a 500, where a 400 belongs).
_BINARY_PARTS = ("input_file", "input_audio")


def _text_part(value: Any, images: bool = False) -> Any:
    """Names what is wrong with a content part before the union's generic message would."""
    if isinstance(value, dict):
        kind = value.get("type")
        if kind in _BINARY_PARTS or (kind == "input_image" and not images):
            where = "an agent_message" if kind == "input_image" else "this gateway"
            raise ValueError(
                f"content part type {kind!r} is not supported in {where}: send the content as "
                "input_text"
            )
        if kind not in _TEXT_PARTS and not (images and kind == "input_image"):
            raise ValueError(
                f"content part type {str(kind)[:64]!r} is not supported: send input_text parts "
                "(output_text for the model's own replies, encrypted_content as Codex does, "
                "input_image for images)"
            )
    return value


def _seeing_part(value: Any) -> Any:
    return _text_part(value, images=True)


class InputTextPart(BaseModel):
    """``input_text``, or ``output_text`` (a reply echoed back; its annotations and logprobs
    are kept as extra fields and never reach the prompt)."""

    model_config = ConfigDict(extra="allow", json_schema_extra=free_form_extras)

    type: Literal["input_text", "output_text"]
    text: str


class EncryptedPart(BaseModel):
    """``encrypted_content``: Codex (multi_agent_v2) sends a task's or an answer's text in one,
    whose ``spawn_agent`` schema marks the message ``encrypted``. The gateway decrypts nothing
    (it holds no key, and what reaches the model is what the client sent): the string is the
    part's text, as it came (with a model that emits plain text, as Codex relays it, plain
    text)."""

    model_config = ConfigDict(extra="allow", json_schema_extra=free_form_extras)

    type: Literal["encrypted_content"]
    encrypted_content: str

    @property
    def text(self) -> str:
        return self.encrypted_content


_TEXT_PARTS = ("input_text", "output_text", "encrypted_content")


def _part_kind(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return (
        "encrypted" if kind == "encrypted_content" else "image" if kind == "input_image" else "text"
    )


TextPart = Annotated[
    Annotated[InputTextPart, Tag("text")] | Annotated[EncryptedPart, Tag("encrypted")],
    Discriminator(_part_kind),
    BeforeValidator(_text_part),
]
# A message's part: text, or an image.
MessagePart = Annotated[
    Annotated[InputTextPart, Tag("text")]
    | Annotated[EncryptedPart, Tag("encrypted")]
    | Annotated[InputImagePart, Tag("image")],
    Discriminator(_part_kind),
    BeforeValidator(refused_file_id),
    BeforeValidator(_seeing_part),
]


def _text_or_list(value: Any) -> str | None:
    if isinstance(value, str):
        return "text"
    return "list" if isinstance(value, list) else None


def text_or_list(items: Any, what: str, text: Any = str) -> Any:
    """``text | list[items]`` (``text``: ``str``, maybe constrained), whose errors are the
    branch the value took (a plain union reports every branch's)."""
    return Annotated[
        Annotated[text, Tag("text")] | Annotated[items, Tag("list")],
        Discriminator(
            _text_or_list,
            custom_error_type="text_or_list",
            custom_error_message=f"must be a string or a list of {what}",
        ),
    ]


TextContent = text_or_list(list[MessagePart], "input_text or input_image parts")


def content_items(
    content: str | Sequence[InputTextPart | EncryptedPart | InputImagePart | ToolOutputPart],
) -> str | list[str | ImageInput]:
    """A content's texts and image parts, in order (a string as it is)."""
    if isinstance(content, str):
        return content
    return [p if isinstance(p, InputImagePart) else p.text for p in content]


def item_text(content: str | Sequence[InputTextPart | EncryptedPart | ToolOutputPart]) -> str:
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
    namespace: NamespaceName | None = Field(
        None, description="a namespace's function: the model called it as <namespace>__<name>"
    )

    @property
    def function(self) -> str:
        """The function the model called: a namespace's as it was offered (flattened)."""
        return self.name if self.namespace is None else flat_name(self.namespace, self.name)


class AgentMessageItem(BaseModel):
    """A message between two agents of a session's tree (Codex multi_agent_v2): a parent's
    task (author ``/root``, recipient ``/root/fresh1``, "Message Type: NEW_TASK ...") or a
    child's answer ("FINAL_ANSWER"). Rendered as a USER message: the recipient's model answers
    it as it answers its user, the way a v1 sub-agent reads its task and a v1 parent its
    ``<subagent_notification>``, both user messages. Its content is as the client sent it: the
    parts' texts joined, encrypted_content strings as they are (``EncryptedPart``). author and
    recipient are not rendered again: Codex writes the sender and the task into the text."""

    model_config = ConfigDict(extra="allow", json_schema_extra=free_form_extras)

    type: Literal["agent_message"]
    author: str | None = Field(None, max_length=1024, description="the sending agent's path")
    recipient: str | None = Field(None, max_length=1024, description="the receiving agent's")
    content: text_or_list(  # type: ignore[valid-type]
        Annotated[list[TextPart], Field(min_length=1)],
        "input_text or encrypted_content parts",
        Annotated[str, Field(min_length=1)],
    ) = Field(description="not empty: an agent_message is its content")


def _output_part(value: Any) -> Any:
    if isinstance(value, dict) and value.get("type") not in ("input_text", "input_image"):
        kind = str(value.get("type"))[:64]
        raise ValueError(
            f"function_call_output part type {kind!r} is not supported: send the tool's output "
            "as a string, or input_text and input_image parts"
        )
    return value


class ToolOutputPart(BaseModel):
    model_config = ConfigDict(extra="allow", json_schema_extra=free_form_extras)

    type: Literal["input_text"]
    text: str


def _output_kind(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return "image" if kind == "input_image" else "text"


OutputPart = Annotated[
    Annotated[ToolOutputPart, Tag("text")] | Annotated[InputImagePart, Tag("image")],
    Discriminator(_output_kind),
    BeforeValidator(refused_file_id),
    BeforeValidator(_output_part),
]


class FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(extra="allow", json_schema_extra=free_form_extras)

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=256)
    output: text_or_list(  # type: ignore[valid-type]
        list[OutputPart], "input_text or input_image parts"
    )


class ReasoningItem(BaseModel):
    """Dropped: the gateway never produces reasoning (it is another model's)."""

    model_config = ConfigDict(extra="allow", json_schema_extra=free_form_extras)

    type: Literal["reasoning"]


_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning", "agent_message")


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
    if kind == "additional_tools":
        # Codex 0.169 sends its tools this way for the models whose harness is "code mode" (its
        # default, gpt-6.1-sol: the shell only behind a JavaScript `exec` custom tool), which no
        # served open model drives; under another model name it offers plain function tools.
        raise ValueError(
            "input item type 'additional_tools' is not supported: Codex sends it for its own "
            "default model's code-mode tools; set `model` in Codex's config.toml to the served "
            "model's name (GET /v1/models), and Codex offers function tools"
        )
    if isinstance(kind, str) and (kind.endswith("_call") or kind.endswith("_call_output")):
        raise ValueError(
            f"input item type {name!r} is not supported: only function tools are offered to "
            "the model here; send function_call and function_call_output items"
        )
    raise ValueError(
        f"input item type {name!r} is not supported: send message, agent_message, "
        "function_call, function_call_output or reasoning items"
    )


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")]
    | Annotated[AgentMessageItem, Tag("agent_message")],
    Discriminator(_item_kind),
    BeforeValidator(_known_item),
]
