"""Hermes / Qwen2.5 tool calls: JSON objects between ``<tool_call>`` and ``</tool_call>``.

    Let me check.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    {"name": "get_time", "arguments": {"tz": "CET"}}
    </tool_call>

Several blocks are parallel calls. Text before the first block is the content; text between or
after blocks is dropped, as vLLM's ``hermes`` parser does (it is usually only newlines).
"""

from __future__ import annotations

import json
import re

from gateway.tools.base import (
    ParsedOutput,
    ParsedToolCall,
    as_content,
    content_before,
    held_back_prefix_len,
    tool_call_from,
)

__all__ = ["HermesParser"]

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN_TAG) + r"(.*?)" + re.escape(CLOSE_TAG), re.DOTALL)


class HermesParser:
    """
    >>> HermesParser().parse('Hi.\\n<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>')
    ParsedOutput(content='Hi.', tool_calls=[ParsedToolCall(name='f', arguments='{"x":1}')])
    """

    name = "hermes"

    def parse(self, text: str) -> ParsedOutput:
        start = text.find(OPEN_TAG)
        if start < 0:
            return as_content(text)
        calls: list[ParsedToolCall] = []
        end = start
        for block in _BLOCK.finditer(text, start):
            if OPEN_TAG in block.group(1):
                return as_content(text)  # an unclosed block swallowed by the next one
            try:
                calls.append(tool_call_from(json.loads(block.group(1))))
            except ValueError:  # json.JSONDecodeError is a ValueError
                return as_content(text)
            end = block.end()
        if not calls or OPEN_TAG in text[end:]:
            return as_content(text)  # truncated: an opening tag with no closing tag
        return ParsedOutput(content=content_before(text, start), tool_calls=calls)

    def forced_prefix(self, function: str | None) -> str:
        if function is None:
            return "<tool_call>\n"
        return '<tool_call>\n{"name": ' + json.dumps(function) + ', "arguments": '

    def content_safe_prefix_len(self, text: str) -> int:
        return held_back_prefix_len(text, OPEN_TAG)
