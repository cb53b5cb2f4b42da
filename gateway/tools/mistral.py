"""Mistral tool calls (v3 tokenizer: Mistral-7B-Instruct-v0.3, Mixtral-8x22B, Nemo, Small):
a ``[TOOL_CALLS]`` marker followed by a JSON array of calls.

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "now"}]

Text before the marker is the content. A single object instead of an array, and several
``[TOOL_CALLS]`` segments in a row, are accepted too. The newer ``[TOOL_CALLS]name[ARGS]{...}``
format (tokenizer v11+) is not parsed: it comes back as content.
"""

from __future__ import annotations

import json

from gateway.tools.base import (
    ParsedOutput,
    ParsedToolCall,
    as_content,
    content_before,
    held_back_prefix_len,
    skip_whitespace,
    tool_call_from,
)

__all__ = ["MistralParser"]

TOOL_CALLS = "[TOOL_CALLS]"
_decoder = json.JSONDecoder()


class MistralParser:
    """
    >>> MistralParser().parse('[TOOL_CALLS] [{"name": "f", "arguments": {"x": 1}}]')
    ParsedOutput(content=None, tool_calls=[ParsedToolCall(name='f', arguments='{"x":1}')])
    """

    name = "mistral"

    def parse(self, text: str) -> ParsedOutput:
        start = text.find(TOOL_CALLS)
        if start < 0:
            return as_content(text)
        calls: list[ParsedToolCall] = []
        position = start
        try:
            while text.startswith(TOOL_CALLS, position):
                position = skip_whitespace(text, position + len(TOOL_CALLS))
                value, position = _decoder.raw_decode(text, position)
                for obj in value if isinstance(value, list) else [value]:
                    calls.append(tool_call_from(obj))
                position = skip_whitespace(text, position)
        except ValueError:
            return as_content(text)  # invalid JSON, or cut off by max_tokens
        if not calls:
            return as_content(text)  # "[TOOL_CALLS][]"
        # As with hermes, whatever follows the calls (usually nothing) is dropped.
        return ParsedOutput(content=content_before(text, start), tool_calls=calls)

    def forced_prefix(self, function: str | None) -> str:
        if function is None:
            return "[TOOL_CALLS]"
        return '[TOOL_CALLS][{"name": ' + json.dumps(function) + ', "arguments": '

    def content_safe_prefix_len(self, text: str) -> int:
        return held_back_prefix_len(text, TOOL_CALLS)
