"""Llama 3.1 / 3.2 JSON tool calls: the whole completion is the call.

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}

The ``<|python_tag|>`` prefix is optional, the arguments key is ``parameters`` (``arguments`` is
accepted too), and parallel calls are separated by ``;``. Following Meta's prompt format and
vLLM's ``llama3_json`` parser, a completion is a tool call only if it *starts* with the call:
JSON inside prose is content.
"""

from __future__ import annotations

import json

from gateway.tools.base import (
    ParsedOutput,
    ParsedToolCall,
    as_content,
    skip_whitespace,
    tool_call_from,
)

__all__ = ["Llama3JsonParser"]

PYTHON_TAG = "<|python_tag|>"
_ARGUMENT_KEYS = ("parameters", "arguments")
_decoder = json.JSONDecoder()


class Llama3JsonParser:
    """
    >>> Llama3JsonParser().parse('{"name": "f", "parameters": {"x": 1}}; {"name": "g"}')
    ParsedOutput(content=None, tool_calls=[ParsedToolCall(name='f', arguments='{"x":1}'), \
ParsedToolCall(name='g', arguments='{}')])
    """

    name = "llama3_json"

    def parse(self, text: str) -> ParsedOutput:
        body = _strip_python_tag(text.lstrip())
        if not body.startswith("{"):
            return as_content(text)
        calls: list[ParsedToolCall] = []
        position = 0
        try:
            while True:
                obj, position = _decoder.raw_decode(body, position)
                calls.append(tool_call_from(obj, arguments_keys=_ARGUMENT_KEYS))
                position = skip_whitespace(body, position)
                if position == len(body):
                    break
                if body[position] != ";":
                    raise ValueError("tool calls must be separated by ';'")
                position = skip_whitespace(body, position + 1)
                if position == len(body):
                    break  # a trailing ';'
        except ValueError:
            # Not a call after all (a JSON answer, or cut off by max_tokens): the text is content.
            return as_content(text)
        return ParsedOutput(content=None, tool_calls=calls)

    def forced_prefix(self, function: str | None) -> str:
        if function is None:
            return '{"name": "'
        return '{"name": ' + json.dumps(function) + ', "parameters": '

    def content_safe_prefix_len(self, text: str) -> int:
        # Nothing is streamed until the first non-blank characters rule a call out.
        head = text.lstrip()
        if not head or head.startswith("{") or _could_become_python_tag(head):
            return 0
        return len(text)


def _strip_python_tag(text: str) -> str:
    return text[len(PYTHON_TAG) :].lstrip() if text.startswith(PYTHON_TAG) else text


def _could_become_python_tag(head: str) -> bool:
    return PYTHON_TAG.startswith(head) or head.startswith(PYTHON_TAG)
