"""Server-sent events framing of streamed replies: OpenAI Chat Completions' ``data: {...}``
lines, and the typed events (``event: NAME`` + ``data: {...}``) of Anthropic Messages and
OpenAI Responses."""

from __future__ import annotations

from gateway.errors import error_body
from gateway.protocol.common import ErrorBody, ErrorResponse, Wire

__all__ = ["DONE", "sse", "sse_error", "sse_event"]

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
