"""One gateway worker process of ``turnstream gateway --workers N`` (``workers``: the supervisor).

Started as ``python -m turnstream.services.gateway.worker_process`` with its ``WorkerSpec``
pickled on stdin; it builds a whole gateway on the listening socket it inherits
(``--worker-routing owner``: taking over the connections of the sessions it owns from the other
workers, ``gateway.http.handoff``) or on a socket of its own on the same port (``any``: serving
every session), and stops on SIGINT / SIGTERM or when its supervisor's pipe closes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import socket
import struct
import sys
from typing import Any

import uvicorn
from prometheus_client import CollectorRegistry, multiprocess

from gateway.http.handoff import Handoff, owner_routed
from schemas.errors import TurnstreamError
from schemas.ids import own_new_session_ids
from turnstream.services.gateway.assembly import build_gateway, import_gateway_modules
from turnstream.services.gateway.http import http_server, reuse_port_listener, serve_until
from turnstream.services.gateway.workers import METRICS_ENV, WorkerSpec
from turnstream.stack.event_log import open_log
from turnstream.stack.process import configure_logging, run_service, settle_heap, stop_on_signals

__all__: list[str] = []  # an entry point (``python -m``), nothing to import

log = logging.getLogger(__name__)


async def _serve_worker(spec: WorkerSpec) -> None:
    settings = spec.settings
    # Each worker is its own writer of the sessions it serves: its own name among the fleet's.
    instance = settings.instance_id or f"{socket.gethostname()}:{settings.port}"
    settings = settings.model_copy(update={"instance_id": f"{instance}/{spec.index}"})
    import_gateway_modules(settings)
    own_new_session_ids(spec.index, spec.workers)
    stop = stop_on_signals()
    loop = asyncio.get_running_loop()
    loop.add_reader(sys.stdin.fileno(), _on_supervisor_pipe, stop)
    listener = socket.socket(fileno=spec.listen_fd)
    by_owner = settings.worker_routing == "owner"
    if not by_owner:  # the inherited socket only holds the port: listen on one of our own
        held = listener
        listener = reuse_port_listener(held, uvicorn.Config("unused:app").backlog)
        held.close()
    handoff = Handoff(spec.handoff_dir, spec.index, spec.workers)
    adopting: set[asyncio.Task[Any]] = set()
    async with (
        open_log(settings, name=f"turnstream-gateway-{spec.index}", stop=stop) as event_log,
        build_gateway(settings, event_log) as gateway,
    ):
        server = http_server(gateway.app)
        config = server.config
        config.load()
        routed = owner_routed(config.http_protocol_class, handoff)
        if METRICS_ENV in os.environ:  # /metrics answers for all the workers
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
            gateway.engine.metrics.registry = registry
        if by_owner:
            config.http_protocol_class = routed

        def adopt(conn: socket.socket, data: bytes) -> None:
            def protocol() -> asyncio.Protocol:
                return routed(
                    config=config,
                    server_state=server.server_state,
                    app_state=server.lifespan.state,
                    preload=data,
                )

            task = loop.create_task(loop.connect_accepted_socket(protocol, sock=conn))
            adopting.add(task)
            task.add_done_callback(_adopted(adopting, conn))

        settle_heap()
        serving = asyncio.create_task(serve_until(server, stop, [listener]))
        while not server.started:
            if serving.done():
                break  # it could not start: ``await serving`` says why
            await asyncio.sleep(0.01)
        else:
            # With ``any`` nothing is handed over; listening still tells the supervisor we serve.
            handoff.listen(adopt)
            log.info("serving (pid %d), %d workers", os.getpid(), spec.workers)
        try:
            await serving
        finally:
            handoff.close()
            log.info(
                "stopped: %d sessions held, %d connections moved out, %d in",
                len(gateway.sessions.store),
                handoff.moved,
                handoff.adopted,
            )


def _adopted(adopting: set[asyncio.Task[Any]], conn: socket.socket) -> Any:
    def done(task: asyncio.Task[Any]) -> None:
        adopting.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("adopting a connection failed: %r", task.exception())
            conn.close()

    return done


def _on_supervisor_pipe(stop: asyncio.Event) -> None:
    try:
        data = os.read(sys.stdin.fileno(), 4096)
    except OSError:
        data = b""
    if not data:
        asyncio.get_running_loop().remove_reader(sys.stdin.fileno())
        log.warning("the supervisor is gone: stopping")
        stop.set()


def _worker_main() -> int:
    stdin = sys.stdin.buffer
    (size,) = struct.unpack("!Q", stdin.read(8))
    spec: WorkerSpec = pickle.loads(stdin.read(size))
    configure_logging(f"[worker {spec.index}] %(message)s")
    try:
        run_service(_serve_worker(spec))
    except TurnstreamError as exc:
        log.error("%s", exc)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(_worker_main())
