"""``turnstream worker``: a fold worker (and a reaper) as a service.

Run as many as you like against one NATS: they share the durable ``fold`` and ``reaper``
consumers, so JetStream spreads the work and hands a dead process's share to the others.
SIGINT / SIGTERM stop fetching, finish the sessions already taken, and exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import asdict

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from consumers import FoldWorker, FoldWorkerSettings, Reaper, ReaperSettings
from eventlog import JetStreamImageStore, JetStreamPublisher, LogSettings
from eventlog.metrics import ConsumerMetrics
from turnstream.stack.event_log import EventLog, open_log, require_log_url
from turnstream.stack.process import run_service, stop_on_signals
from turnstream.stack.settings import PublishingSettings

__all__ = ["WorkerCommand", "WorkerSettings", "fold_workers", "run_workers"]

log = logging.getLogger(__name__)


class WorkerSettings(PublishingSettings):
    """Fold closed sessions into trajectories (TRAJ); close idle sessions (reaper)."""

    model_config = SettingsConfigDict(cli_prog_name="turnstream worker")

    fold: FoldWorkerSettings = FoldWorkerSettings()
    reaper: ReaperSettings = ReaperSettings()
    progress_interval_s: float = Field(10.0, gt=0, description="seconds between progress lines")
    metrics_port: int | None = Field(
        None, ge=0, le=65535, description="serve Prometheus /metrics on this port; unset: off"
    )


async def fold_workers(
    event_log: EventLog,
    publisher: JetStreamPublisher,
    fold: FoldWorkerSettings,
    reaper: ReaperSettings,
    log_settings: LogSettings,
    metrics: ConsumerMetrics | None = None,
) -> tuple[FoldWorker, Reaper | None]:
    """A fold worker, and a reaper when enabled, on ``event_log`` (not started). The worker
    reads the log's image store, to hold back trajectories naming an image it lacks."""
    names, max_payload = log_settings.names, log_settings.max_payload
    images = await JetStreamImageStore.open(event_log.nc, log_settings)
    worker = FoldWorker(
        event_log.js,
        publisher,
        fold,
        names,
        max_payload=max_payload,
        metrics=metrics,
        images=images,
    )
    if not reaper.enabled:
        return worker, None
    return worker, Reaper(
        event_log.js, publisher, reaper, names, max_payload=max_payload, metrics=metrics
    )


async def run_workers(
    settings: WorkerSettings, event_log: EventLog, stop: asyncio.Event
) -> tuple[FoldWorker, Reaper | None]:
    """Run a fold worker (and a reaper, when enabled) on ``event_log`` until ``stop`` is set."""
    publisher = await JetStreamPublisher(event_log.nc, settings.publisher).start()
    metrics = ConsumerMetrics()
    if settings.metrics_port is not None:
        metrics.serve(settings.metrics_port)
    worker, reaper = await fold_workers(
        event_log, publisher, settings.fold, settings.reaper, settings.log, metrics
    )
    runs = [worker.run(stop)] + ([reaper.run(stop)] if reaper is not None else [])
    progress = asyncio.create_task(_report(worker, reaper, settings.progress_interval_s, stop))
    try:
        await asyncio.gather(*runs)
    finally:
        progress.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await progress
        await publisher.close()
    return worker, reaper


async def _report(
    worker: FoldWorker, reaper: Reaper | None, interval_s: float, stop: asyncio.Event
) -> None:
    last: tuple[object, ...] = ()
    while not stop.is_set():
        await asyncio.sleep(interval_s)
        now = (
            asdict(worker.stats),
            asdict(worker.loop.stats),
            asdict(reaper.stats) if reaper else None,
        )
        if now != last:
            log.info("fold: %s %s | reaper: %s", *now)
            last = now


class WorkerCommand(WorkerSettings):
    __doc__ = WorkerSettings.__doc__

    def cli_cmd(self) -> None:
        require_log_url(self, "worker")
        run_service(self._run())

    async def _run(self) -> None:
        stop = stop_on_signals()
        async with open_log(self, name="turnstream-worker") as event_log:
            log.info("fold worker on %s (reaper %s)", event_log.url, self.reaper.enabled)
            worker, reaper = await run_workers(self, event_log, stop)
        log.info("worker stopped: fold %s, reaper %s", worker.stats, reaper and reaper.stats)
