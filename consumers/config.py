"""Settings of the consumers: fold worker, reaper, shard writer (plain pydantic models).

The composition root (``turnstream``) nests these in each service's settings, so they are filled
from CLI flags, ``TURNSTREAM_*`` env vars or a TOML file; nothing here reads the environment.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from eventlog.config import ConsumerSettings

__all__ = ["FoldWorkerSettings", "ReaperSettings", "ShardWriterSettings"]

MiB = 1024 * 1024


class FoldWorkerSettings(ConsumerSettings):
    """``turnstream worker``: closes in, trajectories out."""

    durable: str = "fold"
    # 32, not 8: paired full runs of benchmarks/pipeline_throughput.py folded 7-32% more
    # tokens per second with 32, for ~10% less CPU per token, most of it nats-server's
    # (docs/PERFORMANCE.md, section 1, tenth round). Each session being folded holds its
    # events and its samples' arrays: a few MB for a 128k-token session.
    concurrency: int = Field(32, ge=1, description="sessions folded at once per process")
    per_turn: bool = Field(
        False,
        description="every turn its own sample (a session's metadata.fold.per_turn overrides)",
    )
    final_reward_scope: Literal["last", "all"] = Field(
        "all", description="'all': every segment carries the final reward; 'last': the last only"
    )
    rehydrate_batch: int = Field(
        1024, ge=1, description="events per direct-get batch when reading a session back"
    )

    @model_validator(mode="after")
    def _concurrency_fits(self) -> FoldWorkerSettings:
        if self.concurrency > self.max_ack_pending:
            raise ValueError("concurrency must be <= max_ack_pending")
        return self


class ReaperSettings(BaseModel):
    """The reaper closes sessions nobody closed, so they are folded, not lost."""

    model_config = ConfigDict(frozen=True)

    enabled: bool = Field(True, description="run the reaper in this worker process")
    idle_timeout_s: float = Field(
        1800.0, gt=0, description="a session with no event for this long is closed as 'timeout'"
    )
    scan_interval_s: float = Field(10.0, gt=0, description="how often idle sessions are looked for")
    durable: str = Field("reaper", description="durable consumer that tracks session activity")
    ack_wait_s: float = Field(
        30.0, gt=0, description="events a dead reaper had taken are redelivered after this"
    )
    batch: int = Field(256, ge=1, description="events per fetch")
    max_ack_pending: int = Field(4096, ge=1, description="events in flight")
    forget_closed_after_s: float = Field(
        3600.0,
        gt=0,
        description="a closed session's entry is deleted this long after its last event "
        "(events later than that are no longer flagged late)",
    )


class ShardWriterSettings(BaseModel):
    """``turnstream shard-writer``: TRAJ in, Parquet shards out, each trajectory exactly once."""

    model_config = ConfigDict(frozen=True)

    target: str | None = Field(
        None,
        description="directory or pyarrow filesystem URI (s3://bucket/prefix); "
        "unset: <data_dir>/shards",
    )
    durable: str = Field("shard-writer", description="durable consumer on TRAJ")
    batch: int = Field(256, ge=1, description="most trajectories per fetch")
    fetch_max_bytes: int = Field(
        16 * MiB, ge=1, description="fetches are sized to stay under this many bytes"
    )
    max_rows: int = Field(20_000, ge=1, description="rotate a shard at this many rows")
    max_bytes: int = Field(128 * MiB, ge=1, description="rotate at this much buffered data")
    max_age_s: float = Field(30.0, gt=0, description="rotate a non-empty shard at this age")
    compression_level: int | None = Field(None, description="zstd level; unset: pyarrow default")
    fetch_timeout_s: float = Field(1.0, gt=0, description="longest wait of one fetch")
    ack_wait_s: float | None = Field(
        None,
        gt=0,
        description="an unacked trajectory is redelivered after this (also how long the "
        "buffer of a killed writer waits to be redelivered); unset: 2 x max_age_s + 30",
    )

    def target_in(self, data_dir: Path) -> str:
        """``target``, else ``<data_dir>/shards``."""
        return self.target or str(data_dir / "shards")

    @property
    def max_ack_pending(self) -> int:
        # Trajectories are acked only once their shard is committed, so a full buffer plus one
        # fetch must fit; otherwise the consumer stalls before the row limit is reached. The
        # writer caps the rows *filling* buffers over all runs at max_rows, so this holds with
        # many runs; rows being written (up to as many again) past it only pause deliveries
        # until a write commits.
        return self.max_rows + self.batch

    @property
    def effective_ack_wait_s(self) -> float:
        # A buffered trajectory waits up to max_age_s for its shard; redelivering it meanwhile
        # would only make work. Progress is not signalled per message, so wait long enough.
        return self.ack_wait_s if self.ack_wait_s is not None else self.max_age_s * 2 + 30.0

    @model_validator(mode="after")
    def _ack_wait_outlasts_age(self) -> ShardWriterSettings:
        if self.ack_wait_s is not None and self.ack_wait_s <= self.max_age_s:
            raise ValueError(
                "ack_wait_s must exceed max_age_s, or every buffered trajectory is redelivered "
                "before its shard is written"
            )
        return self
