"""``turnstream up``: the whole stack in one process (DESIGN §9).

A nats-server of its own (unless ``--log.url``), the gateway on ``--host``/``--port``, a fold
worker with its reaper, and a shard writer, until Ctrl-C. Once the log, the fold worker and the
shard writer run, and before the gateway answers (so a script that waits for ``/health`` finds
it; with ``--workers N``, N > 1, the gateway processes start first), ``up`` writes
``<data_dir>/stack.json`` (``turnstream.stack.stack_file``: URLs, run, pids) and removes it on exit.
``embedded_stack`` is what ``turnstream demo`` runs its agents and trainer against.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from consumers import FoldWorker, FoldWorkerSettings, Reaper, ReaperSettings, ShardWriterSettings
from consumers.shard_writer import ShardWriter
from eventlog import JetStreamPublisher
from turnstream.services.gateway.assembly import (
    Gateway,
    build_gateway,
    import_gateway_modules,
    require_local_backend,
)
from turnstream.services.gateway.http import http_server, http_url, listening_socket
from turnstream.services.gateway.settings import GatewaySettings
from turnstream.services.gateway.workers import gateway_workers
from turnstream.services.shard_writer import shard_writer
from turnstream.services.worker import fold_workers
from turnstream.stack.event_log import EventLog, open_log
from turnstream.stack.process import run_service, settle_heap, stop_on_signals
from turnstream.stack.stack_file import (
    new_stack_file,
    remove_stack_file,
    stack_file_path,
    write_stack_file,
)

__all__ = ["Stack", "UpCommand", "UpSettings", "embedded_stack"]

log = logging.getLogger(__name__)


class UpSettings(GatewaySettings):
    """Everything in one process: nats-server, gateway, fold worker + reaper, shard writer."""

    model_config = SettingsConfigDict(cli_prog_name="turnstream up")

    port: int = Field(8000, ge=0, le=65535, description="gateway port; 0 picks a free one")
    fold: FoldWorkerSettings = FoldWorkerSettings()
    reaper: ReaperSettings = ReaperSettings()
    shards: ShardWriterSettings = ShardWriterSettings()

    @property
    def shard_target(self) -> str:
        return self.shards.target_in(self.data_dir)


@dataclass
class Stack:
    event_log: EventLog
    gateway: Gateway | None  # None: in worker processes (--workers N)
    url: str  # the gateway's base URL
    worker: FoldWorker
    reaper: Reaper | None
    writer: ShardWriter
    shard_target: str


@contextlib.asynccontextmanager
async def embedded_stack(
    settings: UpSettings,
    *,
    stop: asyncio.Event | None = None,
    announce: Callable[[Stack], Callable[[], object] | None] | None = None,
) -> AsyncIterator[Stack]:
    """Start the stack; on exit (a gateway that could not start included) stop taking work,
    finish what was taken, and close.

    ``announce`` is called with the stack once the log, the fold worker and the shard writer
    run, before the gateway serves (with ``--workers N`` the gateway processes are up already);
    what it returns, if anything, is called first on the way out. The embedded nats-server is
    restarted when it dies; if it keeps dying, ``stop`` is set and ``ServerCrashLoop`` is raised
    on exit.
    """
    async with contextlib.AsyncExitStack() as exits:
        # Bound first: a port in use is said before the log starts and the model loads.
        listener = exits.enter_context(
            listening_socket(settings.host, settings.port, reuse_port=settings.reuses_port)
        )
        if settings.workers == 1:
            import_gateway_modules(settings)  # before connecting: its gateway is built here
        event_log = await exits.enter_async_context(
            open_log(settings, name="turnstream-up", stop=stop)
        )
        gateway: Gateway | None = None
        server = None
        if settings.workers > 1:  # gateway worker processes (turnstream.services.gateway.workers)
            pool = await exits.enter_async_context(
                gateway_workers(settings, event_log, stop or asyncio.Event(), listener)
            )
            url = pool.url
        else:
            gateway = await exits.enter_async_context(build_gateway(settings, event_log))
            server = http_server(gateway.app)
            url = http_url(settings.host, listener.getsockname()[1])
        publisher = await JetStreamPublisher(event_log.nc, settings.publisher).start()
        worker, reaper = await fold_workers(
            event_log, publisher, settings.fold, settings.reaper, settings.log
        )
        writer = shard_writer(
            event_log, publisher, settings.shards, settings.log, settings.shard_target
        )
        done = asyncio.Event()
        settle_heap()
        tasks = [
            asyncio.create_task(worker.run(done), name="fold-worker"),
            asyncio.create_task(writer.run(done), name="shard-writer"),
        ]
        if reaper is not None:
            tasks.append(asyncio.create_task(reaper.run(done), name="reaper"))
        stack = Stack(event_log, gateway, url, worker, reaper, writer, settings.shard_target)
        withdraw = announce(stack) if announce is not None else None
        try:
            if server is not None:
                serving = asyncio.create_task(server.serve([listener]), name="gateway")
                tasks.append(serving)
                while not server.started:
                    if serving.done():
                        serving.result()  # the gateway could not start: say why
                    await asyncio.sleep(0.02)
            yield stack
        finally:
            if withdraw is not None:
                withdraw()  # first thing, error or not: nobody should join a stack that stops
            if server is not None:
                server.should_exit = True
            done.set()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            await publisher.close()
            for task, result in zip(tasks, results, strict=True):
                if isinstance(result, Exception):
                    log.error("%s ended with %r", task.get_name(), result)


class UpCommand(UpSettings):
    __doc__ = UpSettings.__doc__

    # stack.json is written here, not in ``embedded_stack``: it invites other processes
    # (``train``, ``status``, ``inspect``) to join, and the demo's stack is private to its run.

    def cli_cmd(self) -> None:
        if self.backend == "local":
            require_local_backend()
        run_service(self._run())

    async def _run(self) -> None:
        stop = stop_on_signals()
        written = False

        def announce(stack: Stack) -> Callable[[], object] | None:
            nonlocal written
            written = self._write_stack_file(stack)
            # Removed on the way out; only our own file: another stack's stays.
            return (
                functools.partial(remove_stack_file, self.data_dir, os.getpid())
                if written
                else None
            )

        async with embedded_stack(self, stop=stop, announce=announce) as stack:
            log.info(
                "turnstream up: gateway %s (OpenAI API at %s/v1, run %s), log %s, shards "
                "%s%s; Ctrl-C stops",
                stack.url,
                stack.url,
                self.run,
                stack.event_log.url,
                stack.shard_target,
                f"; other processes join through {stack_file_path(self.data_dir)}"
                if written
                else "",
            )
            await stop.wait()
        log.info("stopped: fold %s, shards %s", stack.worker.stats, stack.writer.stats)

    def _write_stack_file(self, stack: Stack) -> bool:
        """``<data_dir>/stack.json`` for this stack; False when it was not written (another
        running ``up`` owns the file, or it cannot be written: the stack runs without it)."""
        path = stack_file_path(self.data_dir)
        server = stack.event_log.server
        try:
            written = write_stack_file(
                self.data_dir,
                new_stack_file(
                    gateway_url=stack.url,
                    nats_url=stack.event_log.url,
                    data_dir=self.data_dir,
                    shards=stack.shard_target,
                    run=self.run,
                    model_dir=self.model_dir,
                    nats_server_pid=server.pid if server is not None else None,
                ),
            )
        except OSError as exc:
            log.warning("could not write %s (%s); other processes need --log.url", path, exc)
            return False
        if not written:
            log.warning("%s names another turnstream up that is still running; left as it is", path)
        return written
