"""The words ``turnstream inspect`` uses for messages, tool calls and numbers. Pure.

Both renderers (terminal, HTML) and both view models (the turn tree, the segments) take their
text from here, so every place says the same. Everything that comes from the agent or the model
goes through ``printable``: a terminal escape in model output is shown, not obeyed.

>>> message_text({"role": "user", "content": [{"type": "text", "text": "hi"}]})
'user: hi'
>>> first_words("user: one two three four five six seven eight nine ten", 4)
'user: one two three …'
"""

from __future__ import annotations

import json
from typing import Any

from schemas.events import JSON

__all__ = ["first_words", "message_text", "number", "printable", "tool_call_text"]

_SHOWN_CHARS = 300  # of each message's content


def printable(text: str) -> str:
    """``text`` with control characters (a terminal escape in model output) made visible."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c in "\n\t" else repr(c)[1:-1] for c in text)


def number(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def message_text(message: JSON) -> str:
    content: Any = message.get("content")
    if isinstance(content, list):  # OpenAI content parts
        content = " ".join(
            str(part.get("text", part)) if isinstance(part, dict) else str(part) for part in content
        )
    text = content if isinstance(content, str) else json.dumps(content)
    if message.get("tool_call_id"):
        text = f"[{message['tool_call_id']}] {text}"
    if len(text) > _SHOWN_CHARS:
        text = text[:_SHOWN_CHARS] + f"… ({len(text)} chars)"
    return printable(f"{message.get('role', '?')}: {text}")


def first_words(text: str, words: int, max_chars: int = 60) -> str:
    """The first ``words`` words of ``text`` on one line, at most ``max_chars`` long."""
    split = text.split()
    shown = " ".join(split[:words])
    if len(shown) > max_chars:
        shown = shown[: max_chars - 1].rstrip()
    elif len(split) <= words:
        return shown
    return f"{shown} …"


def tool_call_text(call: JSON) -> str:
    function = call.get("function") or {}
    return printable(f"tool call {function.get('name', '?')}({function.get('arguments', '')})")
