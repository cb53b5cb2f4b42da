"""Streaming content while a completion may still turn into a tool call.

The gateway feeds the text decoded so far after every chunk of tokens and sends what comes back
as a content delta; when the completion is finished, ``finish`` parses it and returns the content
still owed and the tool calls. Content is never taken back: a parser's
``content_safe_prefix_len`` only lets through text that cannot be the start of a call.
"""

from __future__ import annotations

from gateway.tools.base import ParsedOutput, ToolCallParser

__all__ = ["ContentStream"]


class ContentStream:
    """
    >>> from gateway.tools.hermes import HermesParser
    >>> stream = ContentStream(HermesParser())
    >>> [stream.feed(t) for t in ["Hi", "Hi <tool", 'Hi <tool_call>{"name": "f"}</tool_call>']]
    ['Hi', '', '']
    >>> stream.finish('Hi <tool_call>{"name": "f"}</tool_call>')
    ('', ParsedOutput(content='Hi', tool_calls=[ParsedToolCall(name='f', arguments='{}')]))
    """

    def __init__(self, parser: ToolCallParser | None) -> None:
        self._parser = parser  # None: the request has no tools, everything is content
        self._sent = 0

    @property
    def sent(self) -> int:
        """Characters of content streamed so far."""
        return self._sent

    def feed(self, text: str) -> str:
        """The content delta to stream now. ``text`` is everything decoded so far and only
        grows (decode with an incremental detokenizer that holds back partial characters)."""
        safe = len(text) if self._parser is None else self._parser.content_safe_prefix_len(text)
        if safe <= self._sent:
            return ""
        delta = text[self._sent : safe]
        self._sent = safe
        return delta

    def finish(self, text: str) -> tuple[str, ParsedOutput]:
        """The content delta still owed for the finished ``text``, and the parsed output."""
        if self._parser is None:
            parsed = ParsedOutput(content=text or None)
        else:
            parsed = self._parser.parse(text)
        content = parsed.content or ""
        # The invariant of content_safe_prefix_len: what was sent is a prefix of the content.
        assert content.startswith(text[: self._sent]), "streamed content was taken back"
        return content[self._sent :], parsed
