"""The embedded stack's event log: a nats-server of our own unless a URL is given."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from eventlog import (
    NatsServer,
    ProvisionAction,
    connect,
    ensure_log_security,
    provision,
    supervised,
)
from eventlog.connection import close_connection
from schemas.errors import TurnstreamError
from turnstream.stack.settings import ServiceSettings

__all__ = [
    "EventLog",
    "open_log",
    "require_log_url",
    "run_service",
    "settle_heap",
    "stop_on_signals",
    "without_progress_bars",
]

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class EventLog:
    nc: NATS
    js: JetStreamContext
    url: str
    server: NatsServer | None  # None when connected to an external server
    provisioned: list[ProvisionAction]


def _event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop where uvloop is installed (libuv: fewer Python frames per socket
    event than asyncio's selector loop), else None: asyncio's own."""
    try:
        import uvloop
    except ImportError:
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def run_service(main: Coroutine[Any, Any, T]) -> T:
    """Run a long-lived service's ``main`` to its end on ``_event_loop_factory``'s loop: the
    gateway, its ``--workers``, ``up``, the fold worker and the shard writer all run on it."""
    with asyncio.Runner(loop_factory=_event_loop_factory()) as runner:
        return runner.run(main)


# CPython's default is 700. A gateway under load holds many requests' objects at any moment, and
# each young collection promoted whatever they held then into the old generation, where it
# counted towards the next full collection: at c=64, 7-10 full collections a minute walked every
# session the gateway keeps (~7,500 in the benchmark: 150-220 ms each, the event loop stopped).
# At 50,000 a request's temporaries are mostly gone by the time a young collection runs.
YOUNG_GC_THRESHOLD = 50_000


def settle_heap() -> None:
    """Once a service has started, before it serves: collect, freeze what start-up left (torch,
    transformers and the tokenizer leave ~400k long-lived objects, which every full collection
    walked: 120-290 ms pauses under load) and raise the young generation's threshold to
    ``YOUNG_GC_THRESHOLD`` (the older generations' thresholds stay CPython's)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_GC_THRESHOLD, *gc.get_threshold()[1:])


def without_progress_bars() -> None:
    """transformers' progress bars off: a service's log is lines, and each model load (a
    gateway's at start and per policy version its local backend loads, a trainer's at start
    and from a checkpoint) drew a "Loading weights" bar. Imports transformers."""
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # untyped


def stop_on_signals() -> asyncio.Event:
    """An event set by SIGINT or SIGTERM: a service stops taking work, finishes, exits 0."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


def require_log_url(settings: ServiceSettings, command: str) -> None:
    """Consumers join an existing log: an embedded server of their own would hold nothing."""
    if settings.log.url is None:
        raise TurnstreamError(
            f"{command} needs the log's URL: --log.url nats://HOST:4222 (or TURNSTREAM_LOG__URL)"
        )


@contextlib.asynccontextmanager
async def open_log(
    settings: ServiceSettings, *, name: str, stop: asyncio.Event | None = None
) -> AsyncIterator[EventLog]:
    """Connect to ``settings.log.url``, or start an embedded nats-server; provision; yield.

    An embedded server is supervised while the block runs (restarted when it dies); if it keeps
    dying, ``stop`` is set and ``ServerCrashLoop`` is raised when the block ends.
    """
    server: NatsServer | None = None
    url = settings.log.url
    client = settings.log
    if url is None:
        security = ensure_log_security(settings.nats_auth_dir) if settings.log.secure else None
        server = NatsServer(
            settings.nats_store_dir,
            port=settings.log.port,
            max_payload=settings.log.max_payload,
            sync_always=settings.log.sync_always,
            extra_config=security.server_config(settings.log.names) if security else "",
        ).start()
        url = server.url
        if security is not None:
            # One connection serves every service in this process (up: gateway, workers,
            # shard writer), so it logs in as admin; the roles keep other processes apart.
            url = url.replace("nats://", "tls://", 1)
            client = security.client_settings(settings.log, "admin")
        log.info("embedded nats-server at %s, store %s", url, settings.nats_store_dir)
    try:
        nc = await connect(url, client, name=name)
        try:
            js = nc.jetstream()
            actions = await provision(js, settings.log)
            async with supervised(server, stop=stop) if server else contextlib.nullcontext():
                yield EventLog(nc, js, url, server, actions)
        finally:
            await close_connection(nc)
    finally:
        if server is not None:
            server.stop()
