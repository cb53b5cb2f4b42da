"""What a tool-call parser is: model text in, OpenAI-shaped content and tool calls out.

Parsers are pure: no tokenizer, no ids, no I/O. The gateway assigns the ``call_<random>`` ids
and renders the chosen format back into the next prompt through the chat template; a parser only
reads what the model wrote. The text given to a parser is the decoded completion without its
final stop token (``<|im_end|>``, ``<|eot_id|>``, ``</s>``): that token ends the turn, it is
not part of the message.

Malformed tool-call text (invalid JSON, a block cut off by ``max_tokens``) is never an error:
the whole text comes back as content with no tool calls, so the agent sees what the model said
and the turn is still recorded (a 500 would lose it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "ParsedOutput",
    "ParsedToolCall",
    "ToolCallParser",
]


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # a JSON object as a string, as OpenAI sends ``function.arguments``


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None  # None when the model wrote nothing but tool calls (or only whitespace)
    tool_calls: list[ParsedToolCall] = field(default_factory=list)


@runtime_checkable
class ToolCallParser(Protocol):
    """One model family's tool-call format."""

    @property
    def name(self) -> str: ...

    def parse(self, text: str) -> ParsedOutput:
        """Split a finished completion into content and tool calls."""
        ...

    def content_safe_prefix_len(self, text: str) -> int:
        """How much of ``text`` (everything generated so far) can be streamed as content now.

        Invariant the gateway relies on: for every prefix ``p`` of a completion ``text``,
        ``p[:content_safe_prefix_len(p)]`` is a prefix of ``parse(text).content or ""``, so
        content already streamed never has to be taken back. The rest of the content is flushed
        once the completion is finished.
        """
        ...

    def forced_prefix(self, function: str | None) -> str:
        """Text that opens a tool call in this format, appended to the prompt to enforce
        ``tool_choice``: any call (``function`` None, "required") or that function's. The
        gateway parses ``forced_prefix + completion``; the forced tokens are prompt tokens,
        not the policy's actions."""
        ...


def as_content(text: str) -> ParsedOutput:
    """The whole text as content: no tool call, or tool-call text that could not be parsed."""
    return ParsedOutput(content=text if text.strip() else None, tool_calls=[])


def content_before(text: str, start: int) -> str | None:
    """Content written before the first tool call. Trailing whitespace is dropped: models put
    newlines between prose and the call block, and the streaming side holds whitespace back
    until it knows no call follows (see ``held_back_prefix_len``)."""
    content = text[:start].rstrip()
    return content or None


def tool_call_from(obj: Any, *, arguments_keys: tuple[str, ...] = ("arguments",)) -> ParsedToolCall:
    """``{"name": str, "arguments": {...} | "<json object>" | null}`` as a ParsedToolCall.

    Raises ValueError (caught by the parsers, which then fall back to content) when the object
    is not a call: no string name, or arguments that are not a JSON object.
    """
    if not isinstance(obj, dict):
        raise ValueError("a tool call must be a JSON object")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError("a tool call needs a non-empty string 'name'")
    arguments: Any = None
    for key in arguments_keys:
        if key in obj:
            arguments = obj[key]
            break
    if isinstance(arguments, str):
        # Some models (and some fine-tunes' training data) double-encode the arguments.
        arguments = json.loads(arguments)
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise ValueError("tool-call arguments must be a JSON object")
    return ParsedToolCall(name=name, arguments=compact_json(arguments))


def compact_json(obj: Any) -> str:
    # ensure_ascii=False: the agent gets the characters the model wrote, not \\u escapes.
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def held_back_prefix_len(text: str, tag: str) -> int:
    """Safe-to-stream prefix length for formats whose calls start with ``tag`` anywhere.

    Stops before the tag if it is there, before a partial tag at the very end (``"<tool_c"``),
    and before trailing whitespace (it is dropped from the content if a call follows).
    """
    start = text.find(tag)
    if start < 0:
        start = len(text)
        # Longest suffix of the text that is a proper prefix of the tag.
        for size in range(min(len(tag) - 1, len(text)), 0, -1):
            if text.endswith(tag[:size]):
                start = len(text) - size
                break
    return len(text[:start].rstrip())


def skip_whitespace(text: str, position: int) -> int:
    while position < len(text) and text[position].isspace():
        position += 1
    return position
