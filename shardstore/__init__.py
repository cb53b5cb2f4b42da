"""The shard store: Parquet shard files written, listed and read (pyarrow), on a local
directory or any pyarrow filesystem (``s3://...``).

Why a package of its own, beside ``eventlog`` rather than in it or in a consumer: shards are
the data tools' ground (DESIGN §6): the shard writer and export (``consumers``), the offline
reader and the Ray actor (``trainer_sink``) and ``turnstream``'s status, demo and data commands
all read or write them. ``consumers`` and ``trainer_sink`` must not import each other, and
``schemas`` is pure (no file I/O), so the store sits at ``eventlog``'s layer and depends only on
``schemas`` (the shard format, ``schemas.shards``). It has nothing to do with NATS, which is
why it is not part of the log client either.

    schemas  <-  eventlog, shardstore  <-  gateway, consumers, trainer_sink  <-  turnstream

``ShardStore`` is the port the shard writer is given (``FileShardStore`` the implementation);
``open_shards_dataset`` is how readers (offline source, export, Ray Data) see the shards as
one ``pyarrow.dataset``, partitioned by run. pyarrow errors are translated in ``store`` into
``shardstore.errors``.
"""

from __future__ import annotations

from shardstore.errors import ShardStoreError, ShardUnreadable, ShardWriteFailed
from shardstore.store import (
    RUN_PARTITIONING,
    CommittedShard,
    FileShardStore,
    ShardStore,
    filesystem_of,
    open_shards_dataset,
)

__all__ = [
    "RUN_PARTITIONING",
    "CommittedShard",
    "FileShardStore",
    "ShardStore",
    "ShardStoreError",
    "ShardUnreadable",
    "ShardWriteFailed",
    "filesystem_of",
    "open_shards_dataset",
]
