"""The canonical conversation every API surface translates into, and how the gateway compares
it across turns (PURE).

A ``TurnRequest`` is a turn as the turn core sees it, whichever API carried it (Chat
Completions, Anthropic Messages, OpenAI Responses): OpenAI-chat-shaped messages with text content
(``role``, ``content``, ``tool_calls``, ``tool_call_id``, ``name``), function tools
(``{"type": "function", "function": {...}}``), tool choice and sampling. Rendering,
continuation, generation and the ``TurnCompleted`` event never know the API.

Clients re-serialize their history on every request (arguments as a JSON string or an object,
``content`` None or "", fields the model never saw); continuation compares what matters to the
rendered prompt, not the bytes a client sent.

>>> message_key({"role": "assistant", "content": None, "tool_calls": [
...     {"function": {"name": "f", "arguments": '{"b": 1, "a": 2}'}}]})
('assistant', '', (('f', '{"a": 2, "b": 1}'),), None, None)
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from gateway.core.agents import AgentIdentity

__all__ = [
    "MessageKey",
    "TurnRequest",
    "arguments_object",
    "message_key",
    "message_keys",
    "render_chars",
    "same_messages",
    "text_chars",
]

JSON = dict[str, Any]
MessageKey = tuple[object, ...]
ToolChoice = str | JSON | None  # "auto" | "none" | "required" | {"type": "function", ...}


@dataclass(frozen=True)
class TurnRequest:
    """One turn as any API asks for it (the canonical form the turn core takes)."""

    api: str  # "chat.completions" | "messages" | "responses"
    messages: list[JSON]
    # The model name as the client asked for it (None: it named none): a --model-aliases name
    # is recorded as asked, the turn served by the one model the gateway serves.
    model: str | None = None
    tools: list[JSON] | None = None  # function tools only: what the model is offered
    tool_choice: ToolChoice = None
    parallel_tool_calls: bool = True  # False: at most one tool call per reply
    max_tokens: int | None = None  # a cap, as asked
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: Sequence[str] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    # The API's own parameters worth keeping with the turn (thinking, metadata, reasoning,
    # tools not offered to the model, ...): recorded in TurnCompleted.request.
    extras: JSON = field(default_factory=dict)
    # Who in the session's tree of agents asks (from the client's headers); None: it said nothing.
    agent: AgentIdentity | None = None
    # The bytes of the messages' image parts (schemas.images), by digest, as decoded and
    # checked at the edge; {} for a text conversation. Not part of the record: events name
    # images by digest, their bytes go to the log's object store.
    images: Mapping[str, bytes] = field(default_factory=dict)

    @cached_property
    def keys(self) -> tuple[MessageKey, ...]:
        """``message_key`` of each message: computed once per request, then carried (the resend
        check, continuation, the event's message delta and the applied turn's node use these)."""
        return message_keys(self.messages)

    @property
    def record(self) -> JSON:
        """What the event records of how the turn was asked for (None and defaults left out).

        Two requests with the same conversation, tools and record are the same request: the
        second is a resend (a client retry) and gets the recorded answer."""
        asked: JSON = {
            "api": self.api,
            "model": self.model,
            "tool_choice": self.tool_choice,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "stop": list(self.stop) or None,
            "top_logprobs": self.top_logprobs or None,
        }
        record = {k: v for k, v in asked.items() if v is not None}
        record["parallel_tool_calls"] = self.parallel_tool_calls
        if self.logprobs:
            record["logprobs"] = True
        return {**record, **self.extras}


def arguments_object(arguments: object) -> object:
    """OpenAI sends tool-call arguments as a JSON string; HF templates expect the object."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def same_messages(a: Sequence[JSON], b: Sequence[JSON]) -> bool:
    """Whether two conversations are the same to the prompt (``message_key`` by message)."""
    return len(a) == len(b) and all(
        message_key(x) == message_key(y) for x, y in zip(a, b, strict=True)
    )


def message_keys(messages: Sequence[JSON]) -> tuple[MessageKey, ...]:
    """``message_key`` of each message."""
    return tuple(message_key(m) for m in messages)


def message_key(message: JSON) -> MessageKey:
    """What must be equal for a message sent back by a client to count as the same message."""
    tool_calls = message.get("tool_calls")
    calls = (
        tuple(
            (
                (c.get("function") or {}).get("name"),
                json.dumps(
                    arguments_object((c.get("function") or {}).get("arguments")), sort_keys=True
                ),
            )
            for c in tool_calls
        )
        if tool_calls
        else ()  # most messages: no generator to make and run
    )
    content = message.get("content") or ""
    return (
        message.get("role"),
        content if isinstance(content, str) else _content_key(content),
        calls,
        message.get("tool_call_id"),
        message.get("name"),
    )


def _content_key(parts: object) -> tuple[object, ...]:
    """A content given as parts (a conversation with images, schemas.images): its text parts'
    texts and its images' digests, in order (an image's size follows from its bytes)."""
    if not isinstance(parts, list):
        return (repr(parts),)
    return tuple(
        ("image", p.get("image")) if p.get("type") == "image" else p.get("text")
        for p in parts
        if isinstance(p, dict)
    )


# What a function tool adds to a render, about: a coding agent's tools are 1-3 KB of JSON
# schema each (Claude Code's 24: 63 KB). An estimate, so that the render's size is known
# without encoding the tools each turn.
_TOOL_CHARS = 1024


def render_chars(messages: Sequence[JSON], tools: Sequence[JSON] | None) -> int:
    """About how many characters a chat template writes for ``messages`` and ``tools``: the
    messages' text, their tool calls' arguments, ~1 KB a tool. Cheap (nothing encoded): it
    decides where a prompt is rendered and tokenized, it bounds nothing.

    >>> render_chars([{"role": "assistant", "content": None, "tool_calls": [
    ...     {"function": {"name": "f", "arguments": '{"a": 1}'}}]}], [{"type": "function"}])
    1032
    """
    chars = 0
    for message in messages:
        chars += text_chars(message)
        for call in message.get("tool_calls") or ():
            arguments = (call.get("function") or {}).get("arguments")
            if isinstance(arguments, str):
                chars += len(arguments)
    return chars + _TOOL_CHARS * len(tools or ())


def text_chars(message: JSON) -> int:
    """The characters of a message's text content (its text parts' where it has parts)."""
    content = message.get("content")
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(p.get("text") or "") for p in content if isinstance(p, dict))
    return 0
