"""Server-sent events framing of streamed replies: OpenAI Chat Completions' ``data: {...}``
lines, and the typed events (``event: NAME`` + ``data: {...}``) of Anthropic Messages and
OpenAI Responses."""

from __future__ import annotations

import msgspec

from gateway.errors import error_body
from gateway.protocol.wire import ErrorBody, ErrorResponse, Wire

__all__ = ["DONE", "TextEvents", "sse", "sse_error", "sse_event"]

DONE = b"data: [DONE]\n\n"


def sse(payload: Wire) -> bytes:
    return b"data: " + payload.json_bytes() + b"\n\n"


def sse_event(name: str, payload: Wire) -> bytes:
    """A typed event: ``event: NAME`` then the payload (which carries ``type: NAME`` too)."""
    return b"event: " + name.encode() + b"\ndata: " + payload.json_bytes() + b"\n\n"


def sse_error(exc: BaseException) -> bytes:
    """An error after the stream started (its status line is gone): OpenAI's error body as an
    event; the OpenAI SDK raises it as an APIError."""
    error = ErrorResponse(error=ErrorBody.model_validate(error_body(exc)))
    return b"data: " + error.model_dump_json().encode() + b"\n\n"


_TEXT = msgspec.json.Encoder()


class TextEvents:
    """Events that differ in one text field only (a streamed reply's text deltas), written from
    their framed bytes with that text empty: split around it once, each delta JSON-encoded into
    the gap. A delta then costs one string encode, not a model built and serialized.

    >>> events = TextEvents(b'data: {"delta":{"content":""},"n":null}\\n\\n', b'"content":')
    >>> events.write('say "hi"\\n')
    b'data: {"delta":{"content":"say \\\\"hi\\\\"\\\\n"},"n":null}\\n\\n'
    """

    __slots__ = ("_head", "_tail")

    def __init__(self, framed: bytes, key: bytes) -> None:
        """``framed``: the event with the text empty: ``key`` then ``""``, once."""
        empty = key + b'""'
        if framed.count(empty) != 1:
            raise ValueError(f"{empty!r} should occur once in {framed[:200]!r}")
        head, tail = framed.split(empty)
        self._head = head + key
        self._tail = tail

    def write(self, text: str) -> bytes:
        return self._head + _TEXT.encode(text) + self._tail
