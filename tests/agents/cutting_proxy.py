"""A TCP proxy between a CLI and the gateway that cuts one chosen model response mid-stream.

The proxy reads each HTTP/1.1 request the CLI sends (head + ``Content-Length`` body), forwards it
on a fresh connection to the gateway with ``Connection: close`` (so the end of the response is the
end of that connection), and relays the response with ``Connection: close`` too (so the CLI opens
a new connection for its next request instead of reusing one the proxy is about to drop).
``Accept-Encoding`` is removed so the stream is searchable.

The ``cut_at``-th model request (POST to ``.../v1/messages`` or ``.../v1/responses``) is relayed
only up to the cut marker, then the CLI's connection is reset (TCP RST), as a network failure
would:

- ``after=MARKER``: through the end of the SSE event holding the marker;
- ``before=MARKER``: everything before the event holding the marker.

Where to cut so that the CLI resends (measured, 2.1.328 / 0.169.0): Claude Code after its first
``content_block_delta`` (once a content block is complete it keeps it and moves on); Codex before
``response.output_item.done`` (once an item is done it acts on it and moves on, even without
``response.completed``). ``model_requests`` lists every request seen, cut or not, with its
headers: with ``cut_at=0`` the proxy only records what the CLI sent (the agent ids in its
headers), for the sub-agent tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

from eventlog.server import free_port

__all__ = ["CuttingProxy", "SeenRequest"]

_MODEL_PATHS = (b"/v1/messages", b"/v1/responses")
_HOP_HEADERS = (b"connection", b"keep-alive", b"accept-encoding", b"proxy-connection")


@dataclass
class SeenRequest:
    method: str
    target: str
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)  # names lower-cased, as sent
    arrived: float = 0.0  # time.time() when its body was read
    cut: bool = False
    relayed: bytes = b""  # the response bytes the CLI got


@dataclass
class CuttingProxy:
    upstream_port: int
    cut_at: int  # 1-based index among model requests; 0: never cut (a recording proxy)
    after: bytes | None = None
    before: bytes | None = None
    port: int = field(default_factory=free_port)
    model_requests: list[SeenRequest] = field(default_factory=list)
    all_requests: list[SeenRequest] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.cut_at > 0 and (self.after is None) == (self.before is None):
            raise ValueError("give exactly one of after= and before=")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def cuts(self) -> int:
        return sum(request.cut for request in self.model_requests)

    def start(self) -> CuttingProxy:
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._client, "127.0.0.1", self.port), self._loop
        )
        self._server = future.result(10)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await self._one_request(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def _one_request(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        """Relays one request; False when the client connection is done."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return False
        request_line, *header_lines = head[:-4].split(b"\r\n")
        method, target, _ = request_line.split(b" ", 2)
        headers = [line for line in header_lines if line]
        length = 0
        for line in headers:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value.strip())
            if name.strip().lower() == b"transfer-encoding":
                raise ConnectionError("chunked request bodies are not supported by this proxy")
        body = await reader.readexactly(length) if length else b""
        seen = SeenRequest(
            method.decode(), target.decode(), body, _header_dict(headers), time.time()
        )
        self.all_requests.append(seen)
        is_model = method == b"POST" and target.split(b"?")[0].endswith(_MODEL_PATHS)
        if is_model:
            self.model_requests.append(seen)
            seen.cut = len(self.model_requests) == self.cut_at
        forwarded = b"\r\n".join(
            [
                request_line,
                *(h for h in headers if h.split(b":")[0].strip().lower() not in _HOP_HEADERS),
                b"Connection: close",
                b"",
                b"",
            ]
        )
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        try:
            up_writer.write(forwarded + body)
            await up_writer.drain()
            response_head = await up_reader.readuntil(b"\r\n\r\n")
            status_line, *response_headers = response_head[:-4].split(b"\r\n")
            relayed_head = b"\r\n".join(
                [
                    status_line,
                    *(
                        h
                        for h in response_headers
                        if h and h.split(b":")[0].strip().lower() not in _HOP_HEADERS
                    ),
                    b"Connection: close",
                    b"",
                    b"",
                ]
            )
            writer.write(relayed_head)
            buffer = b""
            while True:
                chunk = await up_reader.read(65536)
                if not chunk:
                    break
                if seen.cut:
                    buffer += chunk
                    end = self._cut_end(buffer)
                    if end is not None:
                        writer.write(buffer[:end])
                        seen.relayed += buffer[:end]
                        await writer.drain()
                        await self._reset(writer)
                        return False
                    continue
                writer.write(chunk)
                seen.relayed += chunk
                await writer.drain()
            if buffer:  # the marker never came: relay what there was
                writer.write(buffer)
                seen.relayed += buffer
            await writer.drain()
            return False  # Connection: close was announced
        finally:
            up_writer.close()
            with contextlib.suppress(ConnectionError):
                await up_writer.wait_closed()

    async def _reset(self, writer: asyncio.StreamWriter) -> None:
        """Close the CLI's connection with a TCP reset, once it has read what was relayed: a
        plain close (FIN) in the middle of a chunked body is read by some clients (Claude Code's
        runtime) as the end of the stream, not as a failure."""
        await asyncio.sleep(0.3)
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()

    def _cut_end(self, buffer: bytes) -> int | None:
        """Where to stop relaying the cut response, once the buffer shows it."""
        if self.before is not None:
            start = buffer.find(self.before)
            if start < 0:
                return None
            # The marker may sit in the event's ``data:`` line: cut before its whole event.
            previous = buffer.rfind(b"\n\n", 0, start)
            return 0 if previous < 0 else previous + 2
        assert self.after is not None
        start = buffer.find(self.after)
        if start < 0:
            return None
        end = buffer.find(b"\n\n", start)
        return None if end < 0 else end + 2


def _header_dict(lines: list[bytes]) -> dict[str, str]:
    """Request header lines as a dict, names lower-cased (a repeated name keeps its last value)."""
    headers: dict[str, str] = {}
    for line in lines:
        name, _, value = line.partition(b":")
        headers[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
    return headers
