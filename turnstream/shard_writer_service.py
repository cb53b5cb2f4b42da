"""``turnstream shard-writer``: TRAJ to Parquet shards, each trajectory exactly once.

Run one per TRAJ stream and shard target (see ``consumers.shard_writer``). SIGINT / SIGTERM
stop it gracefully: what is buffered is committed and acked, then it exits 0. A SIGKILL loses
nothing either: the unacked trajectories are redelivered to the next writer after
``shards.ack_wait_s``, and whatever a committed shard already holds is skipped.
"""

from __future__ import annotations

import asyncio
import logging

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from consumers.config import ShardWriterSettings
from consumers.shard_store import FileShardStore
from consumers.shard_writer import ShardWriter
from schemas.codec import Codec
from schemas.log import JetStreamPublisher
from turnstream.settings import ServiceSettings
from turnstream.stack import open_log, require_log_url, stop_on_signals

__all__ = ["ShardWriterCommand"]

log = logging.getLogger(__name__)


class ShardWriterCommand(ServiceSettings):
    """Write the trajectories of TRAJ to Parquet shards (zstd), each exactly once."""

    model_config = SettingsConfigDict(cli_prog_name="turnstream shard-writer")

    shards: ShardWriterSettings = Field(ShardWriterSettings())

    @property
    def shard_target(self) -> str:
        """``shards.target``, else ``<data_dir>/shards``."""
        return self.shards.target or str(self.data_dir / "shards")

    def cli_cmd(self) -> None:
        require_log_url(self, "shard-writer")
        asyncio.run(self._run())

    async def _run(self) -> None:
        stop = stop_on_signals()
        codec = Codec(max_payload=self.log.max_payload)
        store = FileShardStore(self.shard_target, compression_level=self.shards.compression_level)
        async with open_log(self, name="turnstream-shard-writer") as event_log:
            publisher = await JetStreamPublisher(event_log.nc, self.publisher, codec).start()
            try:
                writer = ShardWriter(
                    event_log.js,
                    publisher,
                    store,
                    self.shards,
                    stream=self.log.names.trajectories,
                    codec=codec,
                )
                log.info("shard writer: %s -> %s", self.log.names.trajectories, store.uri)
                stats = await writer.run(stop)
            finally:
                await publisher.close()
        log.info(
            "shard writer stopped: %d trajectories in %d shards, %d duplicate deliveries "
            "skipped, %d dead-lettered",
            stats.rows_written,
            stats.shards_written,
            stats.duplicates_skipped,
            stats.dead_lettered,
        )
