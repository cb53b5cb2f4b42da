"""The gateway's HTTP serving: the listening socket, the uvicorn server, serving until stopped.

Shared by the one-process gateway (``command``), ``up`` and each ``--workers`` process
(``worker_process``), which serve on a socket bound before anything slow starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import importlib.util
import socket
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI

from schemas.errors import TurnstreamError

__all__ = ["http_server", "http_url", "listening_socket", "reuse_port_listener", "serve_until"]


class _HttpServer(uvicorn.Server):
    """uvicorn without signal handlers of its own: SIGINT/SIGTERM belong to the command.

    uvicorn's handlers, once the server has stopped, restore the previous ones and raise the
    signal again. With Python's default SIGTERM handler that killed the process on the spot,
    skipping every ``finally``: the gateway's publisher was never closed and its embedded
    nats-server was left running. The command's ``stop_on_signals()`` event stops the server
    instead (``serve_until``), and the stack unwinds in order.
    """

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def listening_socket(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """A TCP socket bound to ``host``:``port`` (0: a free port), as uvicorn binds one
    (SO_REUSEADDR, IPv6 for an address with a colon, inheritable by worker processes), bound
    before anything slow starts; a TurnstreamError naming the address and what to pass instead
    when it cannot be (uvicorn logs the OSError and calls ``sys.exit`` from inside the event
    loop, which left ``turnstream up`` printing tracebacks). ``reuse_port``: SO_REUSEPORT too, so
    that worker processes can each bind a listening socket of their own to the same address
    (``reuse_port_listener``)."""
    sock = socket.socket(family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            what = "pass another --port (0: a free one), or stop what listens there"
        elif exc.errno == errno.EACCES:
            what = "ports below 1024 need root or CAP_NET_BIND_SERVICE: pass --port 1024 or above"
        else:  # EADDRNOTAVAIL, a name that does not resolve (socket.gaierror)
            what = "pass --host with an address of this machine (127.0.0.1, 0.0.0.0)"
        reason = exc.strerror or str(exc)
        raise TurnstreamError(f"cannot listen on {host}:{port}: {reason}; {what}") from None
    sock.set_inheritable(True)
    return sock


def reuse_port_listener(bound: socket.socket, backlog: int) -> socket.socket:
    """A listening socket of this process on the address of ``bound`` (a ``listening_socket``
    with ``reuse_port``, which holds the address and does not listen itself): the kernel hands
    each new connection to one of the listening sockets there, by a hash of its addresses."""
    sock = socket.socket(family=bound.family)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind(bound.getsockname())
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


def http_url(host: str, port: int) -> str:
    """The URL of an HTTP server on ``host``:``port`` (an IPv6 address in brackets).

    >>> http_url("127.0.0.1", 8000), http_url("::1", 8000)
    ('http://127.0.0.1:8000', 'http://[::1]:8000')
    """
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def http_server(app: FastAPI) -> uvicorn.Server:
    """A uvicorn server for ``app`` (on the sockets ``serve_until`` gives it) that leaves
    SIGINT/SIGTERM to its caller; its HTTP parser is httptools (C; h11 is pure Python: it was
    ~9% of the gateway's CPU per request at the benchmark's short shape), or h11 where
    httptools is not installed."""
    http = "httptools" if importlib.util.find_spec("httptools") is not None else "h11"
    config = uvicorn.Config(app, log_level="warning", lifespan="off", http=http)
    return _HttpServer(config)


async def serve_until(
    server: uvicorn.Server, stop: asyncio.Event, sockets: list[socket.socket]
) -> None:
    """Serve on ``sockets`` (``listening_socket``'s) until ``stop`` is set."""

    async def stop_serving() -> None:
        await stop.wait()
        server.should_exit = True

    stopper = asyncio.create_task(stop_serving(), name="stop-http")
    try:
        await server.serve(sockets)
    finally:
        stopper.cancel()
