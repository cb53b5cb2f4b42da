"""Sticky sessions across gateway worker processes: each request is served by its session's owner.

``turnstream gateway --workers N`` runs N processes accepting on one listening socket. A
session's state (its turn tree, the token ids it continues) lives in the memory of one worker, its
owner (``schemas.ids.session_owner``). Any worker may accept a connection, and one keep-alive
connection carries requests of many sessions, so the owner is found per request, at each request
boundary, before uvicorn sees the request:

* ``OwnerRouted`` is the connection's asyncio protocol, in front of uvicorn's own (httptools or
  h11; it wraps whichever the uvicorn ``Config`` chose). It reads each request's head, finds the
  session the routes would find (``session_of``) and, when it is this worker's or there is none
  (models, health, metrics), passes the request's bytes through to uvicorn.
* When another worker owns it, the connection moves: reading pauses, earlier requests of the
  connection are answered (pipelining keeps its order), then the socket's file descriptor and the
  bytes read but not served go to the owner over a Unix socket (``SCM_RIGHTS``, ``Handoff``). The
  owner adopts the socket (``loop.connect_accepted_socket``), feeds it those bytes first, and
  serves it from then on, routing its next requests the same way. No extra network hop, no
  proxying of bytes: after the move the client talks to the owner's socket directly.

This lives in ``gateway/http/`` because it is HTTP-level (request framing, the routes' session
rules); the processes that use it are in ``turnstream.services.gateway.workers``.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
import struct
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from gateway.http.request_heads import BODY_NAMED, RequestHead, chunked_end, session_of
from schemas.ids import session_owner

__all__ = ["Handoff", "OwnerRouted", "owner_routed"]

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 64 * 1024
"""A request head longer than this is left to uvicorn (which refuses it) on this worker."""
MAX_NAMED_BODY_BYTES = 16 * 1024 * 1024
"""Bodies read to find a session they name (POST /v1/sessions, /v1/responses without a session
header) beyond this size are served where they landed (uvicorn's body limit refuses them)."""
OWNER_WAIT_S = 60.0
"""How long a connection waits for its session's owner to (re)start before a 503."""


class OwnerRouted(asyncio.Protocol):
    """A connection of a worker: each request goes to uvicorn's protocol here or, with the
    connection, to its session's owner. Made by ``owner_routed`` for one worker."""

    inner_class: type[asyncio.Protocol]
    handoff: Handoff

    def __init__(
        self,
        config: Any,
        server_state: Any,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
        preload: bytes = b"",
    ) -> None:
        self.inner: Any = self.inner_class(  # type: ignore[call-arg]
            config=config, server_state=server_state, app_state=app_state, _loop=_loop
        )
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray(preload)
        self.body_left = 0  # bytes of the current request's body still to pass to uvicorn
        self.passthrough = False  # something not routed (an upgrade, bad framing): all to uvicorn
        self.moving = False  # waiting to hand the connection to its owner

    # -- asyncio.Protocol ---------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # asyncio's or uvloop's (which does not subclass asyncio.Transport): the same methods.
        self.transport = cast(asyncio.Transport, transport)
        self.inner.connection_made(transport)
        if self.buf:
            self._route()

    def data_received(self, data: bytes) -> None:
        if self.passthrough:
            self.inner.data_received(data)
        elif self.body_left >= len(data) and not self.buf:
            self.body_left -= len(data)
            self.inner.data_received(data)
        else:
            self.buf += data
            if not self.moving:
                self._route()

    def eof_received(self) -> bool | None:
        if self.moving:  # the owner cannot be given a half-closed request: drop it
            self.moving = False
            self.buf.clear()
        result: bool | None = self.inner.eof_received()
        return result

    def connection_lost(self, exc: Exception | None) -> None:
        self.moving = False
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    # -- routing ------------------------------------------------------------------------------
    def _pass(self, n: int) -> None:
        data = bytes(self.buf[:n])
        del self.buf[:n]
        self.inner.data_received(data)

    def _route(self) -> None:
        buf = self.buf
        while buf and not self.passthrough:
            if self.body_left:
                n = min(self.body_left, len(buf))
                self.body_left -= n
                self._pass(n)
                continue
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > MAX_HEAD_BYTES:
                    self._pass_all()
                return
            head = RequestHead.parse(buf, end)
            if head is None:
                self._pass_all()
                return
            total: int | None = head.size + head.body_length
            if head.chunked:
                found = chunked_end(buf, head.size)
                if found == -1:
                    self._pass_all()
                    return
                total = found
            session = session_of(head.target, head.headers)
            # POST /v1/sessions, /v1/responses: the body may name the session. Not awaited for
            # 100-continue (the body waits for uvicorn's answer) nor a chunked or huge body (a
            # rare framing for these): those are served where they landed.
            if (
                session is None
                and head.target.partition(b"?")[0] in BODY_NAMED
                and b"expect" not in head.headers
                and not head.chunked
                and head.body_length <= MAX_NAMED_BODY_BYTES
            ):
                if len(buf) < head.size + head.body_length:
                    return  # wait for all of the body
                body = bytes(buf[head.size : head.size + head.body_length])
                session = session_of(head.target, head.headers, body)
            owner = None if session is None else session_owner(session, self.handoff.workers)
            if owner is not None and owner != self.handoff.index:
                self._move(owner)
                return
            if total is None:  # chunked, not all here: hold it (a rare framing) until it is
                if len(buf) > MAX_NAMED_BODY_BYTES:
                    self._pass_all()
                return
            n = min(total, len(buf))
            self.body_left = total - n
            self._pass(n)

    def _pass_all(self) -> None:
        self.passthrough = True
        if self.buf:
            self._pass(len(self.buf))

    # -- moving the connection to its owner ---------------------------------------------------
    def _move(self, owner: int) -> None:
        assert self.transport is not None
        self.moving = True
        self.transport.pause_reading()
        self._move_when_idle(owner, time.monotonic())

    def _idle(self) -> bool:
        cycle = getattr(self.inner, "cycle", None)
        if cycle is not None and not cycle.response_complete:
            return False
        if getattr(self.inner, "pipeline", None):  # httptools: pipelined requests queued
            return False
        return self.transport is not None and self.transport.get_write_buffer_size() == 0

    def _move_when_idle(self, owner: int, since: float) -> None:
        transport = self.transport
        if not self.moving or transport is None or transport.is_closing():
            return
        if not self._idle():  # an earlier request of this connection is still being answered
            delay = min(0.02, max(0.0005, (time.monotonic() - since) / 8))  # a long one: rarer
            asyncio.get_running_loop().call_later(delay, self._move_when_idle, owner, since)
            return
        transport.pause_reading()  # uvicorn resumes reading after each response
        sock = transport.get_extra_info("socket")
        fd = os.dup(sock.fileno())
        data = bytes(self.buf)
        self.buf.clear()
        self.moving = False
        transport.abort()  # our descriptor only: the connection lives on in ``fd``
        self.handoff.send(owner, fd, data)


def owner_routed(inner_class: type[asyncio.Protocol], handoff: Handoff) -> type[OwnerRouted]:
    """``OwnerRouted`` in front of ``inner_class`` (the uvicorn ``Config``'s
    ``http_protocol_class``) for the worker of ``handoff``."""
    return type("OwnerRouted", (OwnerRouted,), {"inner_class": inner_class, "handoff": handoff})


_HEADER = struct.Struct("!Q")  # the bytes that follow the descriptor, over 1+ messages
_CHUNK = 48 * 1024  # one SOCK_SEQPACKET message: well under the socket buffer


class _Link:
    """One worker's connection to a peer's handoff socket; messages leave in order."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock: socket.socket | None = None
        self.queue: deque[tuple[bytes, int | None]] = deque()  # (message, fd to close once sent)
        self.waiting = False


class Handoff:
    """Sends connections to their owners and adopts the ones sent here.

    Each worker listens on ``directory/worker-{index}.sock`` (``SOCK_SEQPACKET``: ordered
    messages). A connection is one message carrying the descriptor and how many bytes follow,
    then those bytes in messages of at most ``_CHUNK``. While the owner is away (restarting),
    the connections for it wait, up to ``OWNER_WAIT_S``; then each gets a 503.
    """

    def __init__(self, directory: Path, index: int, workers: int) -> None:
        self.directory = directory
        self.index = index
        self.workers = workers
        self.adopt: Callable[[socket.socket, bytes], None] | None = None
        self.moved = 0  # connections sent to their owner
        self.adopted = 0  # connections received from other workers
        self._links: dict[int, _Link] = {}
        self._listener: socket.socket | None = None
        self._peers: list[socket.socket] = []
        self._partial: dict[int, tuple[socket.socket, int, bytearray]] = {}

    @staticmethod
    def path(directory: Path, index: int) -> Path:
        return directory / f"worker-{index}.sock"

    # -- receiving ----------------------------------------------------------------------------
    def listen(self, adopt: Callable[[socket.socket, bytes], None]) -> None:
        """Accept connections from peers and adopt what they send with ``adopt``."""
        self.adopt = adopt
        path = self.path(self.directory, self.index)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(str(path))
        listener.listen(64)
        listener.setblocking(False)
        self._listener = listener
        asyncio.get_running_loop().add_reader(listener.fileno(), self._accept)

    def _accept(self) -> None:
        assert self._listener is not None
        loop = asyncio.get_running_loop()
        while True:
            try:
                peer, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            peer.setblocking(False)
            self._peers.append(peer)
            loop.add_reader(peer.fileno(), self._receive, peer)

    def _receive(self, peer: socket.socket) -> None:
        space = socket.CMSG_SPACE(struct.calcsize("i"))
        while True:
            try:
                data, ancillary, _, _ = peer.recvmsg(_HEADER.size + _CHUNK, space)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data, ancillary = b"", []
            if not data:  # the peer went away
                asyncio.get_running_loop().remove_reader(peer.fileno())
                self._peers.remove(peer)
                self._partial.pop(peer.fileno(), None)
                peer.close()
                return
            fds = [
                fd
                for level, kind, payload in ancillary
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS
                for fd in struct.unpack(f"{len(payload) // 4}i", payload[: len(payload) // 4 * 4])
            ]
            if fds:
                (size,) = _HEADER.unpack_from(data)
                conn = socket.socket(fileno=fds[0])
                for extra in fds[1:]:
                    os.close(extra)
                state = (conn, size, bytearray(data[_HEADER.size :]))
            else:
                pending = self._partial.pop(peer.fileno(), None)
                if pending is None:
                    continue  # bytes without a connection: cannot happen on an ordered socket
                pending[2].extend(data)
                state = pending
            conn, size, body = state
            if len(body) < size:
                self._partial[peer.fileno()] = state
                continue
            self.adopted += 1
            assert self.adopt is not None
            self.adopt(conn, bytes(body))

    # -- sending ------------------------------------------------------------------------------
    def send(self, owner: int, fd: int, data: bytes) -> None:
        """Give the connection ``fd`` (ours to close) and its unserved bytes to ``owner``."""
        self.moved += 1
        link = self._links.get(owner)
        if link is None:
            link = self._links[owner] = _Link(self.path(self.directory, owner))
        first = _HEADER.pack(len(data)) + data[:_CHUNK]
        link.queue.append((first, fd))
        for start in range(_CHUNK, len(data), _CHUNK):
            link.queue.append((data[start : start + _CHUNK], None))
        if not link.waiting:
            self._flush(link, time.monotonic())

    def _flush(self, link: _Link, since: float) -> None:
        loop = asyncio.get_running_loop()
        link.waiting = False
        while link.queue:
            message, fd = link.queue[0]
            try:
                if link.sock is None:
                    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                    sock.setblocking(False)  # never wait in the event loop, not even to connect
                    try:
                        sock.connect(str(link.path))
                    except BlockingIOError as exc:  # its backlog is full: as if away, briefly
                        sock.close()
                        raise ConnectionRefusedError(errno.EAGAIN, "backlog full") from exc
                    except OSError:
                        sock.close()
                        raise
                    link.sock = sock
                if fd is None:
                    link.sock.send(message)
                else:
                    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", fd))]
                    link.sock.sendmsg([message], ancillary)
            except (BlockingIOError, InterruptedError):
                link.waiting = True
                assert link.sock is not None  # connecting raises no BlockingIOError
                sock_fd = link.sock.fileno()

                def writable(link: _Link = link, sock_fd: int = sock_fd) -> None:
                    loop.remove_writer(sock_fd)
                    self._flush(link, time.monotonic())

                loop.add_writer(sock_fd, writable)
                return
            except OSError as exc:
                # The owner is away (dead, restarting): keep the connections and try again.
                if link.sock is not None:
                    link.sock.close()
                    link.sock = None
                    # The rest of a connection whose first message went out is lost with it.
                    while link.queue and link.queue[0][1] is None:
                        link.queue.popleft()
                if time.monotonic() - since > OWNER_WAIT_S:
                    log.warning("worker %s did not come back (%s): 503s", link.path.name, exc)
                    self._refuse(link)
                    return
                if exc.errno not in (errno.ENOENT, errno.ECONNREFUSED, errno.EPIPE, errno.EAGAIN):
                    log.warning("handing a connection to %s: %s", link.path.name, exc)
                link.waiting = True
                loop.call_later(0.05, self._flush, link, since)
                return
            link.queue.popleft()
            if fd is not None:
                os.close(fd)

    def _refuse(self, link: _Link) -> None:
        body = (
            b'{"error":{"message":"the worker that holds this session is unavailable; retry",'
            b'"type":"unavailable","param":null,"code":"503"}}'
        )
        reply = (
            b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            b"connection: close\r\nretry-after: 1\r\ncontent-length: %d\r\n\r\n" % len(body)
        ) + body
        while link.queue:
            _, fd = link.queue.popleft()
            if fd is None:
                continue
            with contextlib.suppress(OSError):
                os.write(fd, reply)
            os.close(fd)

    def close(self) -> None:
        loop = asyncio.get_running_loop()
        if self._listener is not None:
            loop.remove_reader(self._listener.fileno())
            self._listener.close()
            self._listener = None
            with contextlib.suppress(FileNotFoundError):
                self.path(self.directory, self.index).unlink()
        for peer in self._peers:
            loop.remove_reader(peer.fileno())
            peer.close()
        self._peers.clear()
        for link in self._links.values():
            if link.sock is not None:
                link.sock.close()
            for _, fd in link.queue:
                if fd is not None:
                    os.close(fd)
            link.queue.clear()
