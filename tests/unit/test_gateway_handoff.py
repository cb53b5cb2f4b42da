"""``gateway.http.handoff`` and ``request_heads``: which session a request is for, request framing
on keep-alive and pipelined connections, and a real connection moved between two workers over a
Unix socket."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

import pytest

from gateway.http.handoff import Handoff, owner_routed
from gateway.http.request_heads import chunked_end, session_of
from schemas.ids import new_session_id, own_new_session_ids, session_owner


def test_the_session_is_found_as_the_routers_find_it() -> None:
    assert session_of(b"/sessions/abc/v1/chat/completions", {}) == "abc"
    assert session_of(b"/runs/r1/sessions/abc/v1/models?x=1", {}) == "abc"
    assert session_of(b"/v1/sessions/abc", {}) == "abc"
    assert session_of(b"/v1/sessions/abc/close", {}) == "abc"
    assert session_of(b"/v1/sessions/ab%2Dc/reward", {}) == "ab-c"
    headers = {b"x-claude-code-session-id": b"cc", b"session-id": b"codex"}
    assert session_of(b"/v1/messages", headers) == "cc"
    assert session_of(b"/v1/responses", {b"session-id": b"codex"}) == "codex"
    assert session_of(b"/v1/chat/completions", {b"x-session-id": b""}) is None
    assert session_of(b"/v1/sessions", {}, b'{"session_id": "mine"}') == "mine"
    assert session_of(b"/v1/sessions", {}, b"{}") is None
    assert session_of(b"/v1/sessions", {}, b"[not json") is None
    assert session_of(b"/v1/responses", {}, b'{"previous_response_id": "resp_s_1_0"}') == "s_1"
    assert session_of(b"/v1/responses", {}, b'{"previous_response_id": "nope"}') is None
    assert session_of(b"/v1/models", {}) is None
    assert session_of(b"/health", {}) is None


def test_chunked_bodies_are_framed() -> None:
    body = bytearray(b"4\r\nwiki\r\n5;x=1\r\npedia\r\n0\r\n\r\nNEXT")
    assert chunked_end(body, 0) == len(body) - 4
    assert chunked_end(bytearray(b"4\r\nwi"), 0) is None
    assert chunked_end(bytearray(b"zz\r\n"), 0) == -1
    trailer = bytearray(b"0\r\nX-T: 1\r\n\r\n")
    assert chunked_end(trailer, 0) == len(trailer)


def test_made_session_ids_belong_to_the_worker_that_made_them() -> None:
    try:
        for index in range(3):
            own_new_session_ids(index, 3)
            assert all(session_owner(new_session_id(), 3) == index for _ in range(200))
    finally:
        own_new_session_ids(0, 1)
    with pytest.raises(ValueError):
        own_new_session_ids(2, 2)


class Recorder(asyncio.Protocol):
    """Stands in for uvicorn's protocol: records what it is given; ``cycle`` as uvicorn's."""

    def __init__(self, **_: Any) -> None:
        self.data = bytearray()
        self.cycle: Any = None
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.data += data

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True


def request(path: str, session: str | None, body: bytes = b"") -> bytes:
    headers = f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}\r\n"
    if session is not None:
        headers += f"x-session-id: {session}\r\n"
    return headers.encode() + b"\r\n" + body


def session_of_worker(index: int, workers: int = 2) -> str:
    return next(s for s in (f"s{i}" for i in range(100)) if session_owner(s, workers) == index)


async def test_a_pipelined_request_of_another_workers_session_moves_with_its_connection(
    tmp_path: Path,
) -> None:
    loop = asyncio.get_running_loop()
    here, there = Handoff(tmp_path, 0, 2), Handoff(tmp_path, 1, 2)
    adopted: asyncio.Future[tuple[socket.socket, bytes]] = loop.create_future()
    there.listen(lambda conn, data: adopted.set_result((conn, data)))
    routed = owner_routed(Recorder, here)
    mine, theirs = session_of_worker(0), session_of_worker(1)
    first = request("/v1/chat/completions", mine, b'{"a": 1}')
    health = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"
    second = request("/v1/chat/completions", theirs, b'{"b": 2}')
    client, server = socket.socketpair()
    server.setblocking(False)
    try:
        _, protocol = await loop.connect_accepted_socket(
            lambda: routed(config=None, server_state=None, app_state={}), sock=server
        )
        assert isinstance(protocol, routed)
        inner: Recorder = protocol.inner
        inner.cycle = type("Cycle", (), {"response_complete": False})()  # busy with the first
        # Three requests in one write, split mid-body: the first two are this worker's.
        payload = first + health + second
        client.sendall(payload[:10])
        await asyncio.sleep(0.05)
        client.sendall(payload[10:])
        await asyncio.sleep(0.05)
        assert bytes(inner.data) == first + health
        assert not adopted.done(), "moved while an earlier request was still being answered"
        inner.cycle.response_complete = True
        conn, data = await asyncio.wait_for(adopted, 5)
        assert data == second
        assert inner.lost and here.moved == 1 and there.adopted == 1
        # The owner now holds the client's very connection.
        conn.sendall(b"answered by the owner")
        assert client.recv(100) == b"answered by the owner"
        conn.close()
    finally:
        client.close()
        here.close()
        there.close()


async def test_connections_for_an_absent_owner_wait_for_it(tmp_path: Path) -> None:
    loop = asyncio.get_running_loop()
    here, there = Handoff(tmp_path, 0, 2), Handoff(tmp_path, 1, 2)
    client, server = socket.socketpair()
    try:
        here.send(1, server.detach(), b"GET / HTTP/1.1\r\n\r\n" + b"x" * 200_000)
        await asyncio.sleep(0.2)  # worker 1 is not listening yet
        adopted: asyncio.Future[tuple[socket.socket, bytes]] = loop.create_future()
        there.listen(lambda conn, data: adopted.set_result((conn, data)))
        conn, data = await asyncio.wait_for(adopted, 5)
        assert data == b"GET / HTTP/1.1\r\n\r\n" + b"x" * 200_000  # several messages
        conn.sendall(b"ok")
        assert client.recv(10) == b"ok"
        conn.close()
    finally:
        client.close()
        here.close()
        there.close()


async def test_a_body_naming_the_session_is_read_before_routing(tmp_path: Path) -> None:
    loop = asyncio.get_running_loop()
    here, there = Handoff(tmp_path, 0, 2), Handoff(tmp_path, 1, 2)
    adopted: asyncio.Future[tuple[socket.socket, bytes]] = loop.create_future()
    there.listen(lambda conn, data: adopted.set_result((conn, data)))
    routed = owner_routed(Recorder, here)
    mine, theirs = session_of_worker(0), session_of_worker(1)
    chunked = (
        b"POST /v1/chat/completions HTTP/1.1\r\nx-session-id: " + mine.encode() + b"\r\n"
        b"transfer-encoding: chunked\r\n\r\n3\r\n{}\n\r\n0\r\n\r\n"
    )
    create = request("/v1/sessions", None, f'{{"session_id": "{theirs}"}}'.encode())
    client, server = socket.socketpair()
    server.setblocking(False)
    try:
        _, protocol = await loop.connect_accepted_socket(
            lambda: routed(config=None, server_state=None, app_state={}), sock=server
        )
        assert isinstance(protocol, routed)
        payload = chunked + create
        for i in range(0, len(payload), 7):  # in small pieces: framing across reads
            client.sendall(payload[i : i + 7])
            await asyncio.sleep(0.005)
        conn, data = await asyncio.wait_for(adopted, 5)
        assert bytes(protocol.inner.data) == chunked
        assert data == create
        conn.close()
    finally:
        client.close()
        here.close()
        there.close()
