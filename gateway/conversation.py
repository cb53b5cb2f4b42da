"""The conversation as the gateway compares it across turns (PURE).

Clients re-serialize their history on every request (arguments as a JSON string or an object,
``content`` None or "", fields the model never saw); continuation compares what matters to the
rendered prompt, not the bytes a client sent.

>>> message_key({"role": "assistant", "content": None, "tool_calls": [
...     {"function": {"name": "f", "arguments": '{"b": 1, "a": 2}'}}]})
('assistant', '', (('f', '{"a": 2, "b": 1}'),), None, None)
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["arguments_object", "message_key"]

JSON = dict[str, Any]


def arguments_object(arguments: object) -> object:
    """OpenAI sends tool-call arguments as a JSON string; HF templates expect the object."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def message_key(message: JSON) -> tuple[object, ...]:
    """What must be equal for a message sent back by a client to count as the same message."""
    calls = tuple(
        (
            (c.get("function") or {}).get("name"),
            json.dumps(
                arguments_object((c.get("function") or {}).get("arguments")), sort_keys=True
            ),
        )
        for c in message.get("tool_calls") or ()
    )
    return (
        message.get("role"),
        message.get("content") or "",
        calls,
        message.get("tool_call_id"),
        message.get("name"),
    )
