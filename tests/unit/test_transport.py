"""StreamingTransport against a real HTTP/1.1 server on a free local port.

The server is a few lines of asyncio so that each test controls the bytes on the wire: chunked
and Content-Length bodies, keep-alive and ``Connection: close``, a server that stalls, drops
the connection mid-body or closes an idle one. The remote-backend tests cover the SSE
translation with tests/helpers/backend_transport.py; these cover what that cannot: the
connections.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from itertools import pairwise

import httpx
import pytest

from gateway.backends.interface import Prompt, SamplingParams
from gateway.backends.transport import Response, StreamingTransport, Target, _read_ahead
from gateway.backends.vllm import VLLMBackend
from gateway.errors import BackendError, BackendUnavailable

Answer = Callable[[asyncio.StreamReader, asyncio.StreamWriter, bytes], Awaitable[bool]]


def chunked(*parts: bytes) -> bytes:
    return b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)


class Server:
    """Reads each request (head and Content-Length body) and lets ``answer`` write the reply;
    ``answer`` returns False to stop serving that connection."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.connections = 0
        self.requests: list[bytes] = []
        self.closed_by_client = asyncio.Event()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    self.closed_by_client.set()
                    return
                length, chunked = 0, False
                for line in head.decode().split("\r\n"):
                    name, _, value = line.partition(":")
                    if name.lower() == "content-length":
                        length = int(value)
                    chunked |= (name.lower(), value.strip()) == ("transfer-encoding", "chunked")
                request = head + (
                    await read_chunked(reader) if chunked else await reader.readexactly(length)
                )
                self.requests.append(request)
                if not await self.answer(reader, writer, request):
                    return
        finally:
            writer.close()

    @asynccontextmanager
    async def running(self) -> AsyncIterator[str]:
        server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            yield f"http://127.0.0.1:{port}"


async def read_chunked(reader: asyncio.StreamReader) -> bytes:
    """A chunked body, unframed."""
    body = b""
    while size := int((await reader.readuntil(b"\r\n")).strip(), 16):
        body += (await reader.readexactly(size + 2))[:-2]
    await reader.readuntil(b"\r\n")
    return body


def reply(data: bytes) -> Answer:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: bytes) -> bool:
        writer.write(data)
        await writer.drain()
        return b"connection: close" not in data.lower()

    return answer


TIMEOUTS = httpx.Timeout(5.0)


async def post(
    transport: StreamingTransport,
    url: str,
    body: bytes = b"x",
    headers: Sequence[tuple[bytes, bytes]] = (),
    timeouts: httpx.Timeout = TIMEOUTS,
) -> Response:
    return await transport.request(
        b"POST", Target(url), body=body, headers=headers, timeouts=timeouts
    )


async def test_chunked_bodies_on_one_kept_alive_connection() -> None:
    server = Server(reply(SSE_HEAD + chunked(b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n")))
    transport = StreamingTransport()
    async with server.running() as url:
        for _ in range(3):
            r = await post(transport, f"{url}/v1/completions", b'{"a":[1,2]}')
            assert r.status == 200
            assert (b"content-type", b"text/event-stream") in r.headers
            body = b"".join([part async for part in r])
            await r.aclose()
            assert body == b"data: 1\n\ndata: 2\n\ndata: [DONE]\n\n"
    await transport.aclose()
    assert server.connections == 1
    head, _, sent = server.requests[0].partition(b"\r\n\r\n")
    assert head.startswith(b"POST /v1/completions HTTP/1.1\r\n")
    assert json.loads(sent) == {"a": [1, 2]}


async def test_connection_close_and_content_length_are_honoured() -> None:
    answer = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\nconnection: close\r\n\r\nhello"
    server = Server(reply(answer))
    transport = StreamingTransport()
    async with server.running() as url:
        for _ in range(2):
            assert await (await post(transport, url)).read() == b"hello"
    assert server.connections == 2


async def test_a_response_closed_before_its_end_closes_the_connection() -> None:
    async def stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: bytes) -> bool:
        writer.write(SSE_HEAD + b"9\r\ndata: 1\n\n\r\n")
        await writer.drain()
        if await reader.read() == b"":
            server.closed_by_client.set()
        return False

    server = Server(stall)
    async with server.running() as url:
        response = await post(StreamingTransport(), url, b"{}")
        async for part in response:
            assert part == b"data: 1\n\n"
            break
        await response.aclose()
        # What tells vLLM to abort the generation: the connection goes away.
        await asyncio.wait_for(server.closed_by_client.wait(), 5)


async def test_an_idle_connection_the_server_closed_is_not_reused() -> None:
    served = 0

    async def once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: bytes) -> bool:
        nonlocal served
        served += 1
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        return False  # keep-alive announced, then closed: a server's idle timeout

    server = Server(once)
    transport = StreamingTransport()
    async with server.running() as url:
        assert await (await post(transport, url, b"1")).read() == b"ok"
        await asyncio.sleep(0.05)  # the EOF reaches the idle connection
        assert await (await post(transport, url, b"2")).read() == b"ok"
    assert (served, server.connections) == (2, 2)


async def test_transport_failures_are_httpx_errors() -> None:
    async def stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: bytes) -> bool:
        await reader.read()  # until the client gives up
        return False

    async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: bytes) -> bool:
        writer.write(SSE_HEAD + b"20\r\ndata: cut")
        await writer.drain()
        return False

    transport = StreamingTransport()
    async with Server(stall).running() as url:
        with pytest.raises(httpx.ReadTimeout):
            await post(transport, url, timeouts=httpx.Timeout(0.2))
    async with Server(drop).running() as url:
        with pytest.raises(httpx.RemoteProtocolError):
            await (await post(transport, url)).read()
    refused = Server(stall)
    async with refused.running() as url:
        pass  # the port is free again: nothing listens there
    with pytest.raises(httpx.ConnectError):
        await post(transport, url)
    with pytest.raises(httpx.UnsupportedProtocol):
        Target("ftp://127.0.0.1/x")
    await transport.aclose()
    with pytest.raises(RuntimeError, match="the transport is closed"):
        await post(transport, url)


async def test_informational_close_delimited_and_malformed_responses() -> None:
    """A 100 Continue before the response is skipped; a body framed by neither Content-Length
    nor chunked ends when the server closes; bytes that are not HTTP are a protocol error; a
    compressed body (never asked for) is refused."""
    informational = Server(
        reply(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\ncontent-length: 2\r\n\r\nok")
    )
    until_close = Server(reply(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nto the end"))
    garbage = Server(reply(b"HTTP/1.1 2x0 OK\r\n\r\n"))
    gzipped = Server(
        reply(b"HTTP/1.1 200 OK\r\ncontent-encoding: gzip\r\ncontent-length: 2\r\n\r\n\x1f\x8b")
    )
    transport = StreamingTransport()
    async with informational.running() as url:
        response = await post(transport, url)
        assert (response.status, response.reason) == (201, b"Created")
        assert await response.read() == b"ok"
        assert await (await post(transport, url, b"y")).read() == b"ok"
    assert informational.connections == 1
    async with until_close.running() as url:
        assert await (await post(transport, url)).read() == b"to the end"
    async with garbage.running() as url:
        with pytest.raises(httpx.RemoteProtocolError, match="malformed response"):
            await post(transport, url)
    async with gzipped.running() as url:
        with pytest.raises(httpx.RemoteProtocolError, match="gzip-encoded body"):
            await post(transport, url)


async def test_the_request_head() -> None:
    """The request line, Host, the caller's headers and Content-Length; a header value with a
    line break is refused before anything is sent."""
    server = Server(reply(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"))
    transport = StreamingTransport()
    async with server.running() as url:
        await (await post(transport, f"{url}/v1/x?q=1", b"{}", [(b"x-a", b"1")])).read()
        lines = server.requests[0].partition(b"\r\n\r\n")[0].split(b"\r\n")
        assert lines[0] == b"POST /v1/x?q=1 HTTP/1.1"
        assert lines[1] == b"host: " + url.removeprefix("http://").encode()
        assert lines[2:] == [b"x-a: 1", b"content-length: 2"]
        with pytest.raises(httpx.LocalProtocolError, match="control character"):
            await post(transport, url, b"{}", [(b"x-a", b"1\r\nx-b: 2")])
        await (await post(transport, url, "é 🧪".encode())).read()
        assert server.requests[1].endswith(b"\r\n\r\n" + "é 🧪".encode())
    assert len(server.requests) == 2


VLLM_EVENTS = [
    {
        "choices": [
            {
                "index": 0,
                "text": "Hi",
                "token_ids": [72, 105],
                "prompt_token_ids": [1, 2, 3],
                "logprobs": {"token_logprobs": [-0.5, -0.25], "tokens": ["token_id:72"] * 2},
                "finish_reason": None,
            }
        ],
        "usage": None,
    },
    {
        "choices": [
            {
                "index": 0,
                "text": "",
                "token_ids": [258],
                "logprobs": {"token_logprobs": [-0.125], "tokens": ["token_id:258"]},
                "finish_reason": "stop",
            }
        ],
        "usage": None,
    },
    {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3}},
]


@pytest.mark.parametrize("split", [1, 7, 10_000], ids=["byte-by-byte", "odd-parts", "one-write"])
async def test_vllm_backend_over_the_transport(split: int) -> None:
    """Events split anywhere by the network, or several per read, give the same tokens (the
    events of one read in one chunk: how many chunks depends on the reads), and the connection
    is reused after [DONE]."""
    body = b"".join(b"data: " + json.dumps(e).encode() + b"\r\n\r\n" for e in VLLM_EVENTS)
    body += b": ping\n\ndata: [DONE]\n\n"

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: bytes) -> bool:
        writer.write(SSE_HEAD)
        for start in range(0, len(body), split):
            writer.write(chunked(body[start : start + split])[:-5])  # without the last chunk
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        return True

    server = Server(answer)
    async with server.running() as url:
        backend = VLLMBackend(url, "m", backend_id="vllm-0", max_context=64)
        try:
            for _ in range(2):
                chunks = [c async for c in backend.generate(Prompt([1, 2, 3]), SamplingParams(8))]
                assert [t for c in chunks for t in c.token_ids] == [72, 105, 258]
                assert [lp for c in chunks for lp in c.logprobs] == [-0.5, -0.25, -0.125]
                assert [c.finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["stop"]
                assert 1 <= len(chunks) <= 2
        finally:
            await backend.close()
    assert server.connections == 1


async def test_vllm_backend_errors_over_the_transport() -> None:
    server = Server(reply(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 7\r\n\r\nloading"))
    async with server.running() as url:
        backend = VLLMBackend(url, "m", backend_id="vllm-0", max_context=64)
        with pytest.raises(BackendUnavailable, match="HTTP 503: loading"):
            [c async for c in backend.generate(Prompt([1]), SamplingParams(8))]
        await backend.close()
    backend = VLLMBackend(url, "m", backend_id="vllm-0", max_context=64)
    with pytest.raises(BackendUnavailable, match="cannot connect"):
        [c async for c in backend.generate(Prompt([1]), SamplingParams(8))]
    await backend.close()
    stalled = Server(reply(SSE_HEAD))
    async with stalled.running() as url:
        backend = VLLMBackend(url, "m", backend_id="vllm-0", max_context=64, timeout_s=0.2)
        with pytest.raises(BackendError, match="timed out") as caught:
            [c async for c in backend.generate(Prompt([1]), SamplingParams(8))]
        assert not isinstance(caught.value, BackendUnavailable)
        await backend.close()


async def test_a_closed_response_is_not_read() -> None:
    """Once closed, a response's connection may carry the next request: reading it is refused."""
    server = Server(reply(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"))
    transport = StreamingTransport()
    async with server.running() as url:
        response = await post(transport, url)
        assert await response.read() == b"ok"
        for read in (response.read, lambda: anext(aiter(response))):
            with pytest.raises(RuntimeError, match="the response is closed"):
                await read()
    await transport.aclose()


async def test_reads_ahead_of_the_reader_still_give_other_tasks_their_turn() -> None:
    """A response that arrived ahead of the gateway (here ~320 KB, read 64 KB at a time) yields
    to the loop's other tasks after each read of buffered bytes; a read that waits for its bytes
    yields by waiting (``_read_ahead`` tells which: asyncio's StreamReader, known)."""
    parts = [b"data: %s\n\n" % (b"x" * 1000) for _ in range(320)]
    server = Server(reply(SSE_HEAD + chunked(*parts)))
    transport = StreamingTransport()
    ticks = 0

    async def ticking() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    async with server.running() as url:
        r = await post(transport, f"{url}/v1/completions")
        await asyncio.sleep(0.2)  # the whole body arrives, unread
        ticker = asyncio.create_task(ticking())
        await asyncio.sleep(0)
        seen = []
        async for part in r:
            seen.append((len(part), ticks))
        await r.aclose()
        ticker.cancel()
    await transport.aclose()
    assert sum(n for n, _ in seen) == sum(len(p) for p in parts)
    assert len(seen) >= 4
    assert all(b[1] > a[1] for a, b in pairwise(seen))

    reader = asyncio.StreamReader()
    assert _read_ahead(reader) == (False, True)  # nothing arrived: a read waits
    reader.feed_data(b"x")
    assert _read_ahead(reader) == (True, False)
    await reader.read(1)
    reader.feed_eof()
    assert _read_ahead(reader) == (True, False)  # ended: returns b"" at once


async def test_a_body_the_server_does_not_take_times_out_as_a_write() -> None:
    """A request body the socket cannot take at once is drained under the write timeout; one
    it took whole is not waited for (nothing is left to drain)."""
    stalled = asyncio.Event()

    async def never_read(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await stalled.wait()
        writer.close()

    server = await asyncio.start_server(never_read, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    transport = StreamingTransport()
    timeouts = httpx.Timeout(5.0, write=0.2)
    async with server:
        with pytest.raises(httpx.WriteTimeout):
            await post(transport, url, b"x" * (64 << 20), timeouts=timeouts)
        stalled.set()
    await transport.aclose()
