"""StreamingTransport against a real HTTP/1.1 server on a free local port.

The server is a few lines of asyncio so that each test controls the bytes on the wire: chunked
and Content-Length bodies, keep-alive and ``Connection: close``, a server that stalls, drops
the connection mid-body or closes an idle one. The remote-backend tests cover the SSE
translation with httpx.MockTransport; these cover what that cannot: the connections.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import httpx
import pytest

from gateway.backends.base import Prompt, SamplingParams
from gateway.backends.transport import StreamingTransport
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


async def test_chunked_bodies_on_one_kept_alive_connection() -> None:
    server = Server(reply(SSE_HEAD + chunked(b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n")))
    async with server.running() as url, httpx.AsyncClient(transport=StreamingTransport()) as client:
        for _ in range(3):
            async with client.stream("POST", f"{url}/v1/completions", json={"a": [1, 2]}) as r:
                assert r.status_code == 200
                assert r.headers["content-type"] == "text/event-stream"
                body = b"".join([part async for part in r.aiter_bytes()])
            assert body == b"data: 1\n\ndata: 2\n\ndata: [DONE]\n\n"
    assert server.connections == 1
    head, _, sent = server.requests[0].partition(b"\r\n\r\n")
    assert head.startswith(b"POST /v1/completions HTTP/1.1\r\n")
    assert json.loads(sent) == {"a": [1, 2]}


async def test_connection_close_and_content_length_are_honoured() -> None:
    answer = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\nconnection: close\r\n\r\nhello"
    server = Server(reply(answer))
    async with server.running() as url, httpx.AsyncClient(transport=StreamingTransport()) as client:
        for _ in range(2):
            response = await client.post(url, content=b"x")
            assert response.content == b"hello"
    assert server.connections == 2


async def test_a_response_closed_before_its_end_closes_the_connection() -> None:
    async def stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: bytes) -> bool:
        writer.write(SSE_HEAD + b"9\r\ndata: 1\n\n\r\n")
        await writer.drain()
        if await reader.read() == b"":
            server.closed_by_client.set()
        return False

    server = Server(stall)
    async with server.running() as url, httpx.AsyncClient(transport=StreamingTransport()) as client:
        async with client.stream("POST", url, json={}) as response:
            async for part in response.aiter_bytes():
                assert part == b"data: 1\n\n"
                break
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
    async with server.running() as url, httpx.AsyncClient(transport=StreamingTransport()) as client:
        assert (await client.post(url, content=b"1")).content == b"ok"
        await asyncio.sleep(0.05)  # the EOF reaches the idle connection
        assert (await client.post(url, content=b"2")).content == b"ok"
    assert (served, server.connections) == (2, 2)


async def test_transport_failures_are_httpx_errors() -> None:
    async def stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: bytes) -> bool:
        await reader.read()  # until the client gives up
        return False

    async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: bytes) -> bool:
        writer.write(SSE_HEAD + b"20\r\ndata: cut")
        await writer.drain()
        return False

    async with httpx.AsyncClient(transport=StreamingTransport()) as client:
        async with Server(stall).running() as url:
            with pytest.raises(httpx.ReadTimeout):
                await client.post(url, content=b"x", timeout=0.2)
        async with Server(drop).running() as url:
            with pytest.raises(httpx.RemoteProtocolError):
                await client.post(url, content=b"x")
        refused = Server(stall)
        async with refused.running() as url:
            pass  # the port is free again: nothing listens there
        with pytest.raises(httpx.ConnectError):
            await client.post(url, content=b"x")


async def test_informational_close_delimited_and_malformed_responses() -> None:
    """A 100 Continue before the response is skipped; a body framed by neither Content-Length
    nor chunked ends when the server closes; bytes that are not HTTP are a protocol error."""
    informational = Server(
        reply(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\ncontent-length: 2\r\n\r\nok")
    )
    until_close = Server(reply(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nto the end"))
    garbage = Server(reply(b"HTTP/1.1 2x0 OK\r\n\r\n"))
    async with httpx.AsyncClient(transport=StreamingTransport()) as client:
        async with informational.running() as url:
            response = await client.post(url, content=b"x")
            assert (response.status_code, response.reason_phrase) == (201, "Created")
            assert response.content == b"ok"
            assert (await client.post(url, content=b"y")).content == b"ok"
        assert informational.connections == 1
        async with until_close.running() as url:
            assert (await client.post(url, content=b"x")).content == b"to the end"
        async with garbage.running() as url:
            with pytest.raises(httpx.RemoteProtocolError, match="malformed response"):
                await client.post(url, content=b"x")


async def test_the_request_head_and_a_body_of_unknown_length() -> None:
    """The head carries httpx's headers; a streamed body goes chunked; a header value with a
    line break is refused before anything is sent."""
    server = Server(reply(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"))

    async def parts() -> AsyncIterator[bytes]:
        yield b"ab"
        yield b""
        yield b"cde"

    async with server.running() as url, httpx.AsyncClient(transport=StreamingTransport()) as client:
        await client.post(f"{url}/v1/x?q=1", content=b"{}", headers={"x-a": "1"})
        lines = server.requests[0].partition(b"\r\n\r\n")[0].split(b"\r\n")
        assert lines[0] == b"POST /v1/x?q=1 HTTP/1.1"
        assert b"x-a: 1" in lines and b"content-length: 2" in [h.lower() for h in lines]
        with pytest.raises(httpx.LocalProtocolError, match="control character"):
            await client.post(url, content=b"{}", headers={"x-a": "1\r\nx-b: 2"})
        await client.post(url, content=parts())
        head, _, body = server.requests[1].partition(b"\r\n\r\n")
        assert b"transfer-encoding: chunked" in head.lower() and body == b"abcde"
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
