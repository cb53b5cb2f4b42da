"""The shard store: Parquet shard files written, listed and read (pyarrow)."""

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
    "filesystem_of",
    "open_shards_dataset",
]
