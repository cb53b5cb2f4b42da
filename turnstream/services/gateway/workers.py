"""``turnstream gateway --workers N``: N gateway processes behind one port.

The command's own process is the supervisor: it opens the log (the embedded nats-server lives
here, once), binds the port, and starts N worker processes (``python -m
turnstream.services.gateway.worker_process``) that each run a whole gateway (``build_gateway``)
on it. Which worker serves a request, ``--worker-routing``:

* ``owner`` (the default): the workers inherit the supervisor's listening socket. A session
  belongs to one worker (``schemas.ids.session_owner``), which holds its state in memory; a
  request that reaches another worker is moved there with its connection
  (``gateway.http.handoff``): no proxy hop, and no read of the log per turn. A worker makes the
  session ids it hands out (POST /v1/sessions, the Responses API) among those it owns.
* ``any``: the supervisor's socket only holds the port (SO_REUSEPORT, not listening); each worker
  listens on a socket of its own there (``http.reuse_port_listener``), the kernel hands each
  connection to one of them, and the worker serves whatever session it carries. The log decides
  (docs/ARCHITECTURE.md): a worker whose copy of a session is behind reads the events it missed
  before it continues, and an append made on a stale copy is refused and redone.

Per worker: its own outbox file (``<outbox_path>.worker-<i>``, drained by the same worker after a
restart), its share of ``--max-open-sessions`` (sessions spread evenly, so the limit stays the
gateway's total), its own ``/metrics`` (a scrape sees the worker it lands on; the label-free
counters are per process), log lines prefixed ``[worker i]``.

A worker that dies is started again; until it is back, connections for its sessions wait (up to
``gateway.http.handoff.OWNER_WAIT_S``, then a 503), and its sessions recover from the log on their
next request as after a gateway restart. SIGINT/SIGTERM: every worker stops taking connections and
finishes the requests it has (uvicorn's drain), then the supervisor exits. A worker whose
supervisor is gone (its stdin pipe closed) stops too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from prometheus_client import multiprocess

from eventlog.server import ensure_log_security
from gateway.http.handoff import Handoff
from schemas.errors import TurnstreamError
from turnstream.services.gateway.http import http_url, listening_socket
from turnstream.services.gateway.settings import GatewaySettings
from turnstream.stack.event_log import EventLog, open_log
from turnstream.stack.process import stop_on_signals

__all__ = [
    "METRICS_ENV",
    "WorkerPool",
    "WorkerSpec",
    "gateway_workers",
    "serve_workers",
    "worker_settings",
]

log = logging.getLogger(__name__)

STOP_GRACE_S = 60.0
"""How long the supervisor waits for a stopping worker to finish its requests before SIGKILL."""
CRASH_LOOP = (5, 30.0)
"""A worker that dies this many times, each within this many seconds of its start: give up."""
_PROJECT_ROOT = str(Path(__file__).resolve().parents[3])
METRICS_ENV = "PROMETHEUS_MULTIPROC_DIR"
"""prometheus_client's multiprocess mode: each worker's metrics in files of one directory, and
``/metrics`` on any worker sums them (gauges: one series per worker process, ``pid`` label)."""


def metrics_dir(handoff_dir: Path) -> Path:
    return handoff_dir / "metrics"


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker process is given on its stdin (pickled: settings keep their secrets)."""

    settings: GatewaySettings
    index: int
    workers: int
    listen_fd: int
    handoff_dir: Path


def worker_settings(settings: GatewaySettings, event_log: EventLog, index: int) -> GatewaySettings:
    """``settings`` as worker ``index`` runs them: the supervisor's log, its own outbox file,
    its share of the open sessions and of the kept request bodies."""
    log_settings = settings.log.model_copy(update={"url": event_log.url})
    if settings.log.url is None and settings.log.secure:  # the supervisor's embedded server
        security = ensure_log_security(settings.nats_auth_dir)
        log_settings = security.client_settings(log_settings, "admin")
    publisher = settings.publisher
    if publisher.outbox_path is not None:
        path = publisher.outbox_path
        publisher = publisher.model_copy(
            update={"outbox_path": path.with_name(f"{path.name}.worker-{index}")}
        )
    return settings.model_copy(
        update={
            "log": log_settings,
            "publisher": publisher,
            "max_open_sessions": max(1, math.ceil(settings.max_open_sessions / settings.workers)),
            "kept_body_bytes": settings.kept_body_bytes // settings.workers,
        }
    )


class _Worker:
    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.proc: asyncio.subprocess.Process | None = None
        self.started_at = 0.0
        self.quick_deaths = 0

    async def start(self) -> None:
        env = dict(os.environ)
        # The worker imports this project from where the supervisor did (a benchmark's
        # --source-tree, a checkout run without installing).
        root = _PROJECT_ROOT
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        env[METRICS_ENV] = str(metrics_dir(self.spec.handoff_dir))
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "turnstream.services.gateway.worker_process",
            stdin=subprocess.PIPE,
            pass_fds=(self.spec.listen_fd,),
            env=env,
        )
        self.started_at = time.monotonic()
        payload = pickle.dumps(self.spec)
        assert self.proc.stdin is not None
        self.proc.stdin.write(struct.pack("!Q", len(payload)) + payload)
        await self.proc.stdin.drain()  # the pipe stays open: its end tells the worker we are gone
        log.info("gateway worker %d started (pid %d)", self.spec.index, self.proc.pid)

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)

    async def stop(self) -> None:
        if self.proc is None:
            return
        self.signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(self.proc.wait(), STOP_GRACE_S)
        except TimeoutError:
            log.warning(
                "gateway worker %d did not stop in %.0f s: killed", self.spec.index, STOP_GRACE_S
            )
            self.signal(signal.SIGKILL)
            await self.proc.wait()
        if self.proc.stdin is not None:
            self.proc.stdin.close()


@dataclass
class WorkerPool:
    """The running workers of one gateway: its URL and each worker's process id."""

    url: str
    port: int
    workers: list[_Worker]
    restarts: int = 0

    @property
    def pids(self) -> list[int]:
        return [w.proc.pid for w in self.workers if w.proc is not None]


@contextlib.asynccontextmanager
async def gateway_workers(
    settings: GatewaySettings, event_log: EventLog, stop: asyncio.Event, listener: socket.socket
) -> AsyncIterator[WorkerPool]:
    """Run ``settings.workers`` gateway worker processes on ``listener`` (bound by the caller
    before anything slow starts: ``http.listening_socket``), restarting any that
    dies, until the block ends; then drain and stop them. A worker dying again and again sets
    ``stop`` and raises TurnstreamError at the end."""
    if settings.worker_routing == "owner":
        listener.listen(uvicorn.Config("unused:app").backlog)  # inherited by the workers
    port = listener.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="turnstream-gw-") as handoff_dir:
        workers = [
            _Worker(
                WorkerSpec(
                    worker_settings(settings, event_log, i),
                    i,
                    settings.workers,
                    listener.fileno(),
                    Path(handoff_dir),
                )
            )
            for i in range(settings.workers)
        ]
        pool = WorkerPool(http_url(settings.host, port), port, workers)
        failure: list[str] = []

        async def keep(worker: _Worker) -> None:
            while not stop.is_set():
                await worker.start()
                assert worker.proc is not None
                code = await worker.proc.wait()
                dead = worker.proc.pid
                multiprocess.mark_process_dead(dead, metrics_dir(Path(handoff_dir)))  # type: ignore[no-untyped-call]
                if worker.proc.stdin is not None:
                    worker.proc.stdin.close()
                if stop.is_set():
                    return
                quick = time.monotonic() - worker.started_at < CRASH_LOOP[1]
                worker.quick_deaths = worker.quick_deaths + 1 if quick else 0
                if worker.quick_deaths >= CRASH_LOOP[0]:
                    failure.append(
                        f"gateway worker {worker.spec.index} exited {worker.quick_deaths} times "
                        f"in a row within {CRASH_LOOP[1]:.0f} s of starting (last code {code})"
                    )
                    stop.set()
                    return
                pool.restarts += 1
                log.warning(
                    "gateway worker %d exited with code %s: starting it again (its sessions "
                    "recover from the log)",
                    worker.spec.index,
                    code,
                )
                await asyncio.sleep(min(5.0, 0.2 * 2**worker.quick_deaths))

        metrics_dir(Path(handoff_dir)).mkdir()
        keepers = [
            asyncio.create_task(keep(w), name=f"gateway-worker-{w.spec.index}") for w in workers
        ]
        try:
            # Ready once every worker serves (it listens for handoffs only then).
            paths = [Handoff.path(Path(handoff_dir), i) for i in range(settings.workers)]
            while not all(await asyncio.to_thread(lambda: [p.exists() for p in paths])):
                if stop.is_set():
                    break
                await asyncio.sleep(0.1)
            yield pool
        finally:
            stop.set()
            await asyncio.gather(*(w.stop() for w in workers))
            for task in keepers:
                task.cancel()
            await asyncio.gather(*keepers, return_exceptions=True)
            listener.close()
        if failure:
            raise TurnstreamError(failure[0])


async def serve_workers(settings: GatewaySettings) -> None:
    """``turnstream gateway --workers N`` (N > 1): the supervisor, until SIGINT/SIGTERM."""
    stop = stop_on_signals()
    async with contextlib.AsyncExitStack() as exits:
        # Bound first: a port in use is said before the log starts.
        listener = exits.enter_context(
            listening_socket(settings.host, settings.port, reuse_port=settings.reuses_port)
        )
        event_log = await exits.enter_async_context(
            open_log(settings, name="turnstream-gateway", stop=stop)
        )
        pool = await exits.enter_async_context(gateway_workers(settings, event_log, stop, listener))
        log.info(
            "gateway on %s: %d workers, %s (log %s, run %s)",
            pool.url,
            settings.workers,
            "sessions sticky to their owner"
            if settings.worker_routing == "owner"
            else "any worker serves any session",
            event_log.url,
            settings.run,
        )
        await stop.wait()
