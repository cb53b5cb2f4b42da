"""An httpx transport for many concurrent streamed responses from a few inference servers.

httpx's default transport (httpcore) cost ~0.9 ms of the gateway's ~2.6 ms of CPU per
streamed backend request (benchmarks/gateway_overhead.py): pool bookkeeping that grows with
the pool, anyio and sniffio wrappers, trace hooks and a cancellation scope around every read.
This one does the least that keeps HTTP/1.1 correct: a stack of idle keep-alive connections
per server over asyncio streams, h11 for the protocol (framing, chunked bodies, keep-alive
rules), and one body part per network read (every chunk h11 parsed from it, joined), so the
SSE events that arrived together are split and parsed together.

It plugs in under ``httpx.AsyncClient(transport=...)`` (httpx's one-method
``AsyncBaseTransport`` port), so the adapter code, timeouts and error classes stay httpx's, and
the adapter's tests can keep ``httpx.MockTransport``. Failures are raised as the httpx
exceptions httpcore would raise (``ConnectError``, ``ReadTimeout``, ``RemoteProtocolError``,
...). Not supported, because the backends do not need them: HTTP/2, proxies, client
certificates.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from typing import Any

import h11
import httpx

__all__ = ["StreamingTransport"]

_READ_SIZE = 64 * 1024
_DEFAULT_PORTS = {b"http": 80, b"https": 443}
Origin = tuple[bytes, str, int]


class _Connection:
    __slots__ = ("h11", "reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.h11 = h11.Connection(h11.CLIENT)

    def reusable(self) -> bool:
        # asyncio reads idle sockets too: a server that closed its side has fed EOF by now.
        return not self.reader.at_eof() and not self.writer.is_closing()

    def close(self) -> None:
        self.writer.close()

    async def next_event(self, read_timeout_s: float | None, request: httpx.Request) -> Any:
        """The next h11 event, reading from the socket as h11 asks for data."""
        try:
            event = self.h11.next_event()
            while event is h11.NEED_DATA:
                self.h11.receive_data(await self.read(read_timeout_s, request))
                event = self.h11.next_event()
        except h11.RemoteProtocolError as exc:
            raise httpx.RemoteProtocolError(str(exc), request=request) from exc
        return event

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
            event = await connection.next_event(read_timeout, request)
            while type(event) is h11.InformationalResponse:  # 100 Continue and the like
                event = await connection.next_event(read_timeout, request)
            if type(event) is not h11.Response:
                raise httpx.RemoteProtocolError(
                    "the server closed the connection without sending a response",
                    request=request,
                )
        except BaseException:
            connection.close()
            raise
        return httpx.Response(
            event.status_code,
            headers=event.headers.raw_items(),
            stream=_ResponseBody(self, origin, connection, read_timeout, request),
            extensions={"http_version": b"HTTP/1.1", "reason_phrase": event.reason},
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
        if self._closed or len(idle) >= self._max_idle or not connection.reusable():
            connection.close()
        else:
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
        protocol = connection.h11
        try:
            head = h11.Request(
                method=request.method,
                target=request.url.raw_path,
                headers=request.headers.raw,
            )
            parts = [protocol.send(head)]
            async for data in request.stream:  # type: ignore[union-attr]  # an async request
                parts.append(protocol.send(h11.Data(data=data)))
            parts.append(protocol.send(h11.EndOfMessage()))
        except h11.LocalProtocolError as exc:
            raise httpx.LocalProtocolError(str(exc), request=request) from exc
        try:
            connection.writer.write(b"".join(p for p in parts if p))
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
        self._complete = False
        self._closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        connection = self._connection
        protocol = connection.h11
        parts: list[bytes] = []
        while True:
            try:
                event = protocol.next_event()
            except h11.RemoteProtocolError as exc:
                raise httpx.RemoteProtocolError(str(exc), request=self._request) from exc
            if type(event) is h11.Data:
                parts.append(event.data)
                continue
            if parts:
                yield b"".join(parts)
                parts = []
            if event is h11.NEED_DATA:
                data = await connection.read(self._timeout, self._request)
                try:
                    protocol.receive_data(data)
                except h11.RemoteProtocolError as exc:
                    raise httpx.RemoteProtocolError(str(exc), request=self._request) from exc
            elif type(event) is h11.EndOfMessage:
                self._complete = True
                return
            else:
                raise httpx.RemoteProtocolError(
                    f"unexpected {type(event).__name__} in the response body",
                    request=self._request,
                )

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        connection = self._connection
        protocol = connection.h11
        if self._complete and protocol.our_state is h11.DONE and protocol.their_state is h11.DONE:
            protocol.start_next_cycle()
            self._transport._release(self._origin, connection)
        else:
            connection.close()
