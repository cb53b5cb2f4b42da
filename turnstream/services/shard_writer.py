"""``turnstream shard-writer``: TRAJ to Parquet shards, each trajectory exactly once.

Run one per TRAJ stream and shard target (see ``consumers.shard_writer``). SIGINT / SIGTERM
stop it gracefully: what is buffered is committed and acked, then it exits 0. A SIGKILL loses
nothing either: the unacked trajectories are redelivered to the next writer after
``shards.ack_wait_s``, and whatever a committed shard already holds is skipped.
"""

from __future__ import annotations

import logging

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from consumers.config import ShardWriterSettings
from consumers.shard_writer import ShardWriter
from eventlog import JetStreamPublisher, LogSettings
from eventlog.metrics import ConsumerMetrics
from schemas.codec import Codec
from shardstore import FileShardStore
from turnstream.stack.event_log import EventLog, open_log, require_log_url
from turnstream.stack.process import run_service, stop_on_signals
from turnstream.stack.settings import PublishingSettings

__all__ = ["ShardWriterCommand", "shard_writer"]

log = logging.getLogger(__name__)


def shard_writer(
    event_log: EventLog,
    publisher: JetStreamPublisher,
    shards: ShardWriterSettings,
    log_settings: LogSettings,
    target: str,
    metrics: ConsumerMetrics | None = None,
) -> ShardWriter:
    """A shard writer on ``event_log`` writing to ``target`` (not started)."""
    return ShardWriter(
        event_log.js,
        publisher,
        FileShardStore(target, compression_level=shards.compression_level),
        shards,
        stream=log_settings.names.trajectories,
        codec=Codec(max_payload=log_settings.max_payload),
        metrics=metrics,
    )


class ShardWriterCommand(PublishingSettings):
    """Write the trajectories of TRAJ to Parquet shards (zstd), each exactly once."""

    model_config = SettingsConfigDict(cli_prog_name="turnstream shard-writer")

    shards: ShardWriterSettings = Field(ShardWriterSettings())
    metrics_port: int | None = Field(
        None, ge=0, le=65535, description="serve Prometheus /metrics on this port; unset: off"
    )

    def cli_cmd(self) -> None:
        require_log_url(self, "shard-writer")
        run_service(self._run())

    async def _run(self) -> None:
        stop = stop_on_signals()
        target = self.shards.target_in(self.data_dir)
        async with open_log(self, name="turnstream-shard-writer") as event_log:
            publisher = await JetStreamPublisher(event_log.nc, self.publisher).start()
            try:
                metrics = ConsumerMetrics()
                if self.metrics_port is not None:
                    metrics.serve(self.metrics_port)
                writer = shard_writer(event_log, publisher, self.shards, self.log, target, metrics)
                log.info("shard writer: %s -> %s", self.log.names.trajectories, target)
                stats = await writer.run(stop)
            finally:
                await publisher.close()
        log.info(
            "shard writer stopped: %d trajectories in %d shards, %d duplicate deliveries "
            "skipped, dead letters %s",
            stats.rows_written,
            stats.shards_written,
            stats.duplicates_skipped,
            writer.loop.stats.dead_letters,
        )
