"""What a worker reads of a request before uvicorn does (``gateway.http.handoff``): its head, where
its body ends on a keep-alive connection, and the session it is for, found by the routes' rules.

Plain bytes in, no I/O: each request of a connection is framed here (HTTP/1.x only; anything
else is left to uvicorn on the worker it landed on, which answers it).
"""

from __future__ import annotations

import json
import re
from urllib.parse import unquote

from gateway.http.guard import SESSION_HEADERS

__all__ = ["BODY_NAMED", "RequestHead", "chunked_end", "session_of"]

_SESSION_PATH = re.compile(
    rb"^(?:/runs/[^/]+)?/sessions/([^/?#]+)/|^/v1/sessions/([^/?#]+)(?:/|$|\?)"
)
_HEADER_NAMES = tuple(h.lower().encode() for h in SESSION_HEADERS)
BODY_NAMED = {b"/v1/sessions": "session_id", b"/v1/responses": "previous_response_id"}
"""Routes whose session may be named in the body only (no session in the path or a header), and
the member that names it."""
_RESPONSE_ID = re.compile(r"^resp_([A-Za-z0-9_-]+)_[0-9a-f]+$")  # resp_<session>_<reply>


def session_of(target: bytes, headers: dict[bytes, bytes], body: bytes | None = None) -> str | None:
    """The session a request is served for, by the routes' rules; None: none (served anywhere).

    The path's session first (``/sessions/{sid}/...``, ``/runs/{run}/sessions/{sid}/...``,
    ``/v1/sessions/{sid}...``), then the session headers in the routes' order
    (``SESSION_HEADERS``), then, given the ``body``, the session it names (``session_id`` of
    POST /v1/sessions, ``previous_response_id`` of /v1/responses).

    >>> session_of(b"/runs/r/sessions/s-1/v1/chat/completions", {})
    's-1'
    >>> session_of(b"/v1/chat/completions", {b"session-id": b"c", b"x-session-id": b"x"})
    'x'
    >>> session_of(b"/v1/responses", {}, b'{"previous_response_id": "resp_a_b_9f3a0c17e2b4"}')
    'a_b'
    >>> session_of(b"/v1/models", {}) is None
    True
    """
    match = _SESSION_PATH.match(target)
    if match is not None:
        raw = match.group(1) or match.group(2)
        return unquote(raw.decode("latin-1")) if b"%" in raw else raw.decode("latin-1")
    for name in _HEADER_NAMES:
        value = headers.get(name)
        if value:
            return value.decode("latin-1")
    if body is None:
        return None
    key = BODY_NAMED.get(target.partition(b"?")[0])
    if key is None:
        return None
    try:
        named = json.loads(body).get(key)
    except (ValueError, AttributeError):
        return None  # not a JSON object: the worker it landed on answers the 400
    if not isinstance(named, str):
        return None
    if key == "previous_response_id":
        found = _RESPONSE_ID.match(named)
        return found.group(1) if found else None
    return named


class RequestHead:
    """What routing needs of a request head; ``None`` from ``parse`` when it is not HTTP/1.x as
    understood here (uvicorn then answers it, on the worker it landed on)."""

    __slots__ = ("body_length", "chunked", "headers", "size", "target")

    def __init__(self, target: bytes, headers: dict[bytes, bytes], size: int) -> None:
        self.target = target
        self.headers = headers
        self.size = size
        self.body_length = 0
        self.chunked = False

    @classmethod
    def parse(cls, buf: bytearray, end: int) -> RequestHead | None:
        lines = bytes(buf[:end]).split(b"\r\n")
        parts = lines[0].split(b" ")
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
            return None
        headers: dict[bytes, bytes] = {}
        for line in lines[1:]:
            name, colon, value = line.partition(b":")
            if not colon:
                return None
            headers.setdefault(name.strip().lower(), value.strip())
        if b"upgrade" in headers or parts[0] == b"CONNECT":
            return None
        head = cls(parts[1], headers, end + 4)
        encoding = headers.get(b"transfer-encoding")
        length = headers.get(b"content-length")
        if encoding is not None:
            if length is not None or encoding.lower() != b"chunked":
                return None
            head.chunked = True
        elif length is not None:
            if not length.isdigit():
                return None
            head.body_length = int(length)
        return head


def chunked_end(buf: bytearray, start: int) -> int | None:
    """Where a chunked body that begins at ``start`` ends; None: not all here yet; -1: malformed."""
    pos = start
    while True:
        line_end = buf.find(b"\r\n", pos)
        if line_end < 0:
            return None if len(buf) - pos < 1024 else -1
        size_text = bytes(buf[pos:line_end]).split(b";", 1)[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError:
            return -1
        pos = line_end + 2
        if size == 0:
            trailer_end = buf.find(b"\r\n\r\n", pos - 2)
            return None if trailer_end < 0 else trailer_end + 4
        pos += size + 2
        if pos > len(buf):
            return None
