"""The HTTP client the remote backends speak to their inference servers through.

httpx cost most of the gateway's CPU per backend request: its default transport (httpcore:
pool bookkeeping, anyio and sniffio wrappers, trace hooks, a cancellation scope around every
read) ~0.9 of ~2.6 ms per streamed request, then, on this module's transport, its client layer
(cookie jar, auth and redirect hooks, header merging) ~10% of the gateway's CPU per request and
its Request and Response models (header objects, URL copies, encoding lookups, byte-stream
wrappers) ~6% more (benchmarks/gateway_overhead.py, short shape). The backends send one kind of
request (a POST of a JSON body to a URL parsed once) and read one kind of answer, so this does
the least that keeps HTTP/1.1 correct: a stack of idle keep-alive connections per server over
asyncio streams; the request's head written here (request line, Host, the caller's headers,
Content-Length; a name or value with a control character is refused); httptools (llhttp, the C
parser uvicorn serves the gateway with) for the response's framing (chunked and Content-Length
bodies, keep-alive rules); and one body part per network read (every piece parsed from it,
joined), so the SSE events that arrived together are split and parsed together.

Failures are raised as the httpx exceptions httpcore would raise (``ConnectError``,
``ReadTimeout``, ``RemoteProtocolError``, ...), and timeouts are an ``httpx.Timeout``, so the
adapters translate one family of errors (``gateway.backends.remote``). Not supported, because the
backends do not need them: HTTP/2, proxies, client certificates, upgrades, request bodies of
unknown length, compressed responses (none is asked for: one that comes anyway is refused).
Tests stand in for a server with ``tests/helpers/backend_transport.py``, which runs an
``httpx.MockTransport`` handler behind the same ``Transport`` interface.
"""

from __future__ import annotations

import asyncio
import re
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Protocol

import httptools
import httpx

__all__ = ["Response", "StreamingTransport", "Target", "Transport"]

_READ_SIZE = 64 * 1024
_DEFAULT_PORTS = {b"http": 80, b"https": 443}
_CONTROL = re.compile(rb"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")  # but tab, CR and LF
Origin = tuple[bytes, str, int]
Headers = Sequence[tuple[bytes, bytes]]


class Target:
    """A URL parsed once (a backend's endpoint): where to connect, the request line's target
    and the Host header. ``str()`` gives the URL as it was written, for messages. Anything but
    an http(s) URL with a host is refused (``httpx.UnsupportedProtocol``, ``httpx.InvalidURL``)."""

    __slots__ = ("host", "origin", "path", "url")

    def __init__(self, url: str) -> None:
        parsed = httpx.URL(url)
        scheme = parsed.raw_scheme
        if scheme not in _DEFAULT_PORTS:
            raise httpx.UnsupportedProtocol(f"unsupported URL scheme {parsed.scheme!r} in {url}")
        if not parsed.host:
            raise httpx.InvalidURL(f"no host in {url}")
        self.url = url
        self.origin: Origin = (scheme, parsed.host, parsed.port or _DEFAULT_PORTS[scheme])
        self.path: bytes = parsed.raw_path
        self.host: bytes = parsed.netloc

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"Target({self.url!r})"


class Response:
    """A response's status and headers, then its body: iterate it for the parts as they
    arrive, or ``read()`` it whole. Close it (``read`` does) to hand the connection back; closed
    before the body's end, it closes the connection, which is how a streaming server learns
    that the client went away."""

    __slots__ = ("_close", "_closed", "_parts", "headers", "reason", "status")

    def __init__(
        self,
        status: int,
        headers: list[tuple[bytes, bytes]],
        parts: AsyncIterator[bytes],
        close: Callable[[], Awaitable[None]],
        reason: bytes = b"",
    ) -> None:
        self.status = status
        self.reason = reason
        self.headers = headers
        self._parts = parts
        self._close = close
        self._closed = False

    def __aiter__(self) -> AsyncIterator[bytes]:
        self._check_open()
        return self._parts

    async def read(self) -> bytes:
        self._check_open()
        try:
            return b"".join([part async for part in self._parts])
        finally:
            await self.aclose()

    def _check_open(self) -> None:
        # Closed, its connection may carry another request's response already.
        if self._closed:
            raise RuntimeError("the response is closed; its body can no longer be read")

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            await self._close()


class Transport(Protocol):
    """What the backends send requests through (``StreamingTransport``; a stand-in in tests)."""

    async def request(
        self,
        method: bytes,
        target: Target,
        *,
        body: bytes,
        headers: Headers,
        timeouts: httpx.Timeout,
    ) -> Response:
        """The response once its head has arrived; the caller reads and closes it."""
        ...

    async def aclose(self) -> None: ...


class _Connection:
    """One connection, and the response being read on it (httptools calls the ``on_*``
    methods while ``receive`` feeds it what arrived)."""

    __slots__ = (
        "body",
        "complete",
        "headers",
        "keep_alive",
        "parser",
        "reader",
        "reason",
        "status",
        "writer",
    )

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.start()

    def start(self) -> None:
        """Ready to read the next response."""
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0  # set once the final response's head is complete
        self.reason = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []  # parsed, not yet passed on
        self.complete = False
        self.keep_alive = False

    def on_status(self, reason: bytes) -> None:
        self.reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status < 200:  # 100 Continue and the like: the final response follows
            self.headers, self.reason = [], b""
        else:
            self.status = status

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        # Asked now: llhttp resets its flags for the next message once this returns.
        self.keep_alive = self.parser.should_keep_alive()
        self.complete = self.status != 0

    def reusable(self) -> bool:
        # asyncio reads idle sockets too: a server that closed its side has fed EOF by now.
        return not self.reader.at_eof() and not self.writer.is_closing()

    def kept_alive(self) -> bool:
        """The response was read to its end and the connection may carry the next one."""
        return self.complete and self.keep_alive and self.reusable()

    def close(self) -> None:
        self.writer.close()

    async def receive(self, read_timeout_s: float | None) -> None:
        """Read what arrives next and parse it."""
        data = await self.read(read_timeout_s)
        if not data:
            if self.status and self._ends_at_close():
                self.complete = True
                return
            where = "mid-response" if self.status else "without sending a response"
            raise httpx.RemoteProtocolError(f"the server closed the connection {where}")
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            raise httpx.RemoteProtocolError(f"malformed response: {exc}") from exc

    def _ends_at_close(self) -> bool:
        """A body without Content-Length or chunked framing: it ends when the server closes."""
        names = {name.lower() for name, _ in self.headers}
        return b"content-length" not in names and b"transfer-encoding" not in names

    def encoded(self) -> bytes | None:
        """The response's content coding, where it is not the identity."""
        for name, value in self.headers:
            if name.lower() == b"content-encoding" and value.strip().lower() != b"identity":
                return value
        return None

    async def read(self, read_timeout_s: float | None) -> bytes:
        reader = self.reader
        ready, waits = _read_ahead(reader)
        try:
            if ready:  # returns at once: no wait to bound
                data = await reader.read(_READ_SIZE)
            else:
                async with asyncio.timeout(read_timeout_s):
                    data = await reader.read(_READ_SIZE)
        except TimeoutError as exc:
            raise httpx.ReadTimeout("timed out reading the response") from exc
        except OSError as exc:
            raise httpx.ReadError(str(exc) or repr(exc)) from exc
        if not waits:
            # A read of what is buffered already returns without suspending: a server ahead of
            # a busy gateway would keep one stream's loop running, and every other request of
            # the gateway waiting, until that generation ends. Give them their turn. (A read
            # that waited for its bytes gave it: a second yield would only send the wake-up
            # through the request's every frame again, once per backend request.)
            await asyncio.sleep(0)
        return data


def _read_ahead(reader: asyncio.StreamReader) -> tuple[bool, bool]:
    """Whether a read of ``reader`` returns at once (bytes arrived already, or the stream
    ended), and whether it waits for bytes (nothing arrived yet). asyncio's StreamReader holds
    what arrived in ``_buffer``; for a reader without one, neither is known: (False, False)."""
    buffer = getattr(reader, "_buffer", None)
    if buffer is None:
        return False, False
    ready = len(buffer) > 0 or reader.at_eof()
    return ready, not ready


class StreamingTransport:
    """HTTP/1.1 keep-alive connections over asyncio streams, parsed by httptools.

    ``max_idle_per_server`` bounds the connections kept open between requests; there is no
    bound on connections in use (the router bounds requests in flight per replica)."""

    def __init__(
        self, *, max_idle_per_server: int = 256, ssl_context: ssl.SSLContext | None = None
    ) -> None:
        self._max_idle = max_idle_per_server
        self._ssl_context = ssl_context
        self._idle: dict[Origin, list[_Connection]] = {}
        self._closed = False

    async def request(
        self,
        method: bytes,
        target: Target,
        *,
        body: bytes,
        headers: Headers = (),
        timeouts: httpx.Timeout,
    ) -> Response:
        if self._closed:
            raise RuntimeError("the transport is closed")
        head = self._head(method, target, headers, len(body))
        origin = target.origin
        connection = self._idle_connection(origin)
        if connection is None:
            connection = await self._connect(origin, timeouts.connect)
        read_timeout = timeouts.read
        try:
            await self._send(connection, head, body, timeouts.write)
            while not connection.status:
                await connection.receive(read_timeout)
            coding = connection.encoded()
            if coding is not None:
                raise httpx.RemoteProtocolError(
                    f"the server sent a {coding.decode('latin-1')}-encoded body, which was not "
                    "asked for"
                )
        except BaseException:
            connection.close()
            raise

        async def close() -> None:
            self._release(origin, connection)

        return Response(
            connection.status,
            connection.headers,
            _BodyParts(connection, read_timeout),
            close,
            connection.reason,
        )

    @staticmethod
    def _head(method: bytes, target: Target, headers: Headers, length: int) -> bytes:
        lines = [b"%s %s HTTP/1.1" % (method, target.path), b"host: " + target.host]
        lines += [b"%s: %s" % field for field in headers]
        lines.append(b"content-length: %d" % length)
        head = b"\r\n".join(lines)
        # A line break or another control character (but tab) in a name or value would end
        # its line early: refused.
        breaks = len(lines) - 1
        if head.count(b"\n") != breaks or head.count(b"\r") != breaks or _CONTROL.search(head):
            raise httpx.LocalProtocolError("a header name or value holds a control character")
        return head + b"\r\n\r\n"

    def _idle_connection(self, origin: Origin) -> _Connection | None:
        idle = self._idle.get(origin)
        while idle:
            connection = idle.pop()
            if connection.reusable():
                return connection
            connection.close()
        return None

    def _release(self, origin: Origin, connection: _Connection) -> None:
        idle = self._idle.setdefault(origin, [])
        if self._closed or len(idle) >= self._max_idle or not connection.kept_alive():
            connection.close()
        else:
            connection.start()
            idle.append(connection)

    async def _connect(self, origin: Origin, connect_timeout_s: float | None) -> _Connection:
        scheme, host, port = origin
        tls: ssl.SSLContext | None = None
        if scheme == b"https":
            if self._ssl_context is None:
                self._ssl_context = httpx.create_ssl_context()
            tls = self._ssl_context
        try:
            async with asyncio.timeout(connect_timeout_s):
                reader, writer = await asyncio.open_connection(
                    host, port, ssl=tls, limit=_READ_SIZE
                )
        except TimeoutError as exc:
            raise httpx.ConnectTimeout(f"connecting to {host}:{port} timed out") from exc
        except OSError as exc:
            raise httpx.ConnectError(str(exc) or repr(exc)) from exc
        return _Connection(reader, writer)

    @staticmethod
    async def _send(
        connection: _Connection, head: bytes, body: bytes, write_timeout_s: float | None
    ) -> None:
        writer = connection.writer
        try:
            writer.write(head + body)
            if writer.transport.get_write_buffer_size():  # what the socket did not take at once
                async with asyncio.timeout(write_timeout_s):
                    await writer.drain()
            else:  # nothing to wait for: drain only raises what the connection met
                await writer.drain()
        except TimeoutError as exc:
            raise httpx.WriteTimeout("timed out sending the request") from exc
        except OSError as exc:
            raise httpx.WriteError(str(exc) or repr(exc)) from exc

    async def aclose(self) -> None:
        self._closed = True
        for idle in self._idle.values():
            for connection in idle:
                connection.close()
        self._idle.clear()


class _BodyParts:
    """A response's body, one part per network read (what arrived together, joined)."""

    __slots__ = ("_connection", "_timeout")

    def __init__(self, connection: _Connection, timeout: float | None) -> None:
        self._connection = connection
        self._timeout = timeout

    def __aiter__(self) -> _BodyParts:
        return self

    async def __anext__(self) -> bytes:
        connection = self._connection
        while True:
            body = connection.body
            if body:
                connection.body = []
                return body[0] if len(body) == 1 else b"".join(body)
            if connection.complete:
                raise StopAsyncIteration
            await connection.receive(self._timeout)
