"""An httpx transport for many concurrent streamed responses from a few inference servers.

httpx's default transport (httpcore) cost ~0.9 ms of the gateway's ~2.6 ms of CPU per
streamed backend request (benchmarks/gateway_overhead.py): pool bookkeeping that grows with
the pool, anyio and sniffio wrappers, trace hooks and a cancellation scope around every read.
This one does the least that keeps HTTP/1.1 correct: a stack of idle keep-alive connections
per server over asyncio streams, httptools (llhttp, the C parser uvicorn serves the gateway
with) for the response's framing (chunked and Content-Length bodies, keep-alive rules), and one
body part per network read (every piece parsed from it, joined), so the SSE events that arrived
together are split and parsed together. (It used h11, pure Python: ~10% of the gateway's CPU
per request at the benchmark's short shape.) The request's head is written here: method,
target, the headers httpx built (a name or value with a control character is refused), and the
body as httpx framed it (Content-Length, or chunked for a body of unknown length).

It plugs in under ``httpx.AsyncClient(transport=...)`` (httpx's one-method
``AsyncBaseTransport`` port), so the adapter code, timeouts and error classes stay httpx's, and
the adapter's tests can keep ``httpx.MockTransport``. Failures are raised as the httpx
exceptions httpcore would raise (``ConnectError``, ``ReadTimeout``, ``RemoteProtocolError``,
...). Not supported, because the backends do not need them: HTTP/2, proxies, client
certificates, upgrades.
"""

from __future__ import annotations

import asyncio
import re
import ssl
from collections.abc import AsyncIterator

import httptools
import httpx

__all__ = ["StreamingTransport"]

_READ_SIZE = 64 * 1024
_DEFAULT_PORTS = {b"http": 80, b"https": 443}
_CONTROL = re.compile(rb"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")  # but tab, CR and LF
Origin = tuple[bytes, str, int]


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

    async def receive(self, read_timeout_s: float | None, request: httpx.Request) -> None:
        """Read what arrives next and parse it."""
        data = await self.read(read_timeout_s, request)
        if not data:
            if self.status and self._ends_at_close():
                self.complete = True
                return
            where = "mid-response" if self.status else "without sending a response"
            raise httpx.RemoteProtocolError(
                f"the server closed the connection {where}", request=request
            )
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            raise httpx.RemoteProtocolError(f"malformed response: {exc}", request=request) from exc

    def _ends_at_close(self) -> bool:
        """A body without Content-Length or chunked framing: it ends when the server closes."""
        names = {name.lower() for name, _ in self.headers}
        return b"content-length" not in names and b"transfer-encoding" not in names

    async def read(self, read_timeout_s: float | None, request: httpx.Request) -> bytes:
        try:
            async with asyncio.timeout(read_timeout_s):
                return await self.reader.read(_READ_SIZE)
        except TimeoutError as exc:
            raise httpx.ReadTimeout("timed out reading the response", request=request) from exc
        except OSError as exc:
            raise httpx.ReadError(str(exc) or repr(exc), request=request) from exc


class StreamingTransport(httpx.AsyncBaseTransport):
    """HTTP/1.1 keep-alive connections over asyncio streams, parsed by h11.

    ``max_idle_per_server`` bounds the connections kept open between requests; there is no
    bound on connections in use (the router bounds requests in flight per replica)."""

    def __init__(
        self, *, max_idle_per_server: int = 256, ssl_context: ssl.SSLContext | None = None
    ) -> None:
        self._max_idle = max_idle_per_server
        self._ssl_context = ssl_context
        self._idle: dict[Origin, list[_Connection]] = {}
        self._closed = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self._closed:
            raise RuntimeError("the transport is closed")
        url = request.url
        scheme = url.raw_scheme
        if scheme not in _DEFAULT_PORTS:
            raise httpx.UnsupportedProtocol(f"unsupported URL scheme {url.scheme!r}")
        origin: Origin = (scheme, url.host, url.port or _DEFAULT_PORTS[scheme])
        timeouts: dict[str, float | None] = request.extensions.get("timeout", {})
        connection = self._idle_connection(origin)
        if connection is None:
            connection = await self._connect(origin, timeouts.get("connect"), request)
        try:
            await self._send(connection, request, timeouts.get("write"))
            read_timeout = timeouts.get("read")
            while not connection.status:
                await connection.receive(read_timeout, request)
        except BaseException:
            connection.close()
            raise
        return httpx.Response(
            connection.status,
            headers=connection.headers,
            stream=_ResponseBody(self, origin, connection, read_timeout, request),
            extensions={"http_version": b"HTTP/1.1", "reason_phrase": connection.reason},
        )

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

    async def _connect(
        self, origin: Origin, connect_timeout_s: float | None, request: httpx.Request
    ) -> _Connection:
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
            raise httpx.ConnectTimeout(
                f"connecting to {host}:{port} timed out", request=request
            ) from exc
        except OSError as exc:
            raise httpx.ConnectError(str(exc) or repr(exc), request=request) from exc
        return _Connection(reader, writer)

    async def _send(
        self, connection: _Connection, request: httpx.Request, write_timeout_s: float | None
    ) -> None:
        lines = [b"%s %s HTTP/1.1" % (request.method.encode("ascii"), request.url.raw_path)]
        lines += [b"%s: %s" % field for field in request.headers.raw]
        head = b"\r\n".join(lines)
        # A line break or another control character (but tab) in a name or value would end
        # its line early: refused.
        breaks = len(lines) - 1
        if head.count(b"\n") != breaks or head.count(b"\r") != breaks or _CONTROL.search(head):
            raise httpx.LocalProtocolError(
                "a header name or value holds a control character", request=request
            )
        parts = [head, b"\r\n\r\n"]
        chunked = b"\r\ntransfer-encoding: chunked\r\n" in head.lower() + b"\r\n"
        async for data in request.stream:  # type: ignore[union-attr]  # an async request
            if not chunked:
                parts.append(data)
            elif data:
                parts.append(b"%x\r\n%b\r\n" % (len(data), data))
        if chunked:
            parts.append(b"0\r\n\r\n")
        try:
            connection.writer.write(b"".join(parts))
            async with asyncio.timeout(write_timeout_s):
                await connection.writer.drain()
        except TimeoutError as exc:
            raise httpx.WriteTimeout("timed out sending the request", request=request) from exc
        except OSError as exc:
            raise httpx.WriteError(str(exc) or repr(exc), request=request) from exc

    async def aclose(self) -> None:
        self._closed = True
        for idle in self._idle.values():
            for connection in idle:
                connection.close()
        self._idle.clear()


class _ResponseBody(httpx.AsyncByteStream):
    """The body, one part per network read; closing it before its end closes the connection
    (which is how a streaming server learns that the client went away)."""

    def __init__(
        self,
        transport: StreamingTransport,
        origin: Origin,
        connection: _Connection,
        timeout: float | None,
        request: httpx.Request,
    ) -> None:
        self._transport = transport
        self._origin = origin
        self._connection = connection
        self._timeout = timeout
        self._request = request
        self._closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        connection = self._connection
        while True:
            body = connection.body
            if body:
                connection.body = []
                yield body[0] if len(body) == 1 else b"".join(body)
            if connection.complete:
                return
            await connection.receive(self._timeout, self._request)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._transport._release(self._origin, self._connection)
