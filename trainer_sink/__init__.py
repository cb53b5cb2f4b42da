"""TensorDict batches for PPO/GRPO from the log or shards (DESIGN §7).

A pipeline of values: ``Source -> Batcher -> assemble -> Batch``, committed through the sink.

- ``sources``: where trajectories come from: the live TRAJ feed (a durable pull consumer),
  the Parquet shards (``pyarrow.dataset`` with filters), or a replayed TRAJ range. Only the
  source tracks what waits unacknowledged.
- ``batching``: the batching policies (count, token budget, GRPO groups, staleness) and the
  group instances (``uid``); pure.
- ``assembly``: trajectories -> one TensorDict in verl's padded layout or a jagged
  (``torch.nested``) layout, every key listed in its docstring; pure.
- ``buffers``: ``BatchBuffers``, the memory of earlier padded batches nothing refers to any more,
  which the sink assembles the next ones into (``AssemblySettings.reuse_memory``).
- ``sessions``: which rows of a batch are one session (``session_uid``): one row per session
  for GRPO's baseline, per-session values broadcast to the rows; pure.
- ``sink``: ``async for batch in TrainerSink(source, ...)`` ... ``await sink.commit(batch)``,
  and ``SyncSink`` / ``SinkDataset`` for code outside asyncio.
- ``dataproto``: ``to_dataproto(batch)``, verl's ``DataProto`` (verl imported when called).
- ``vision``: batches with images: verl's ``multi_modal_inputs`` and M-RoPE ``position_ids``,
  the bytes through an ``ImageBytes`` port (the log's image store, or an ``ImageDirectory``).
- ``ray_actor``: the sink as a Ray actor (``sink_actor``) for Ray-based trainers; Ray is
  imported only there, when an actor is made.
"""

from __future__ import annotations

from trainer_sink.assembly import assemble, assemble_jagged, assemble_padded, non_tensor_values
from trainer_sink.batching import (
    Batcher,
    BatchingStats,
    Decision,
    Dropped,
    DropReason,
    Sample,
    instance_uid,
)
from trainer_sink.buffers import BatchBuffers
from trainer_sink.config import AssemblySettings, BatchingSettings, LiveSourceSettings
from trainer_sink.dataproto import to_dataproto
from trainer_sink.errors import BatchCommitted, BatchError, PolicyError, SinkError
from trainer_sink.ray_actor import (
    ImagesSpec,
    LiveSpec,
    OfflineSpec,
    SinkActor,
    SinkActorStats,
    SinkSpec,
    sink_actor,
)
from trainer_sink.sessions import SessionRows, segment_of
from trainer_sink.sink import (
    AckToken,
    Batch,
    SinkDataset,
    SinkStats,
    SyncSink,
    TrainerSink,
)
from trainer_sink.sources import (
    LiveSource,
    OfflineSource,
    Received,
    ReplaySource,
    ShardFilter,
    Source,
)
from trainer_sink.vision import ImageBytes, ImageDirectory, SinkVision, VisionModel, add_images

__all__ = [
    "AckToken",
    "AssemblySettings",
    "Batch",
    "BatchBuffers",
    "BatchCommitted",
    "BatchError",
    "Batcher",
    "BatchingSettings",
    "BatchingStats",
    "Decision",
    "DropReason",
    "Dropped",
    "ImageBytes",
    "ImageDirectory",
    "ImagesSpec",
    "LiveSource",
    "LiveSourceSettings",
    "LiveSpec",
    "OfflineSource",
    "OfflineSpec",
    "PolicyError",
    "Received",
    "ReplaySource",
    "Sample",
    "SessionRows",
    "ShardFilter",
    "SinkActor",
    "SinkActorStats",
    "SinkDataset",
    "SinkError",
    "SinkSpec",
    "SinkStats",
    "SinkVision",
    "Source",
    "SyncSink",
    "TrainerSink",
    "VisionModel",
    "add_images",
    "assemble",
    "assemble_jagged",
    "assemble_padded",
    "instance_uid",
    "non_tensor_values",
    "segment_of",
    "sink_actor",
    "to_dataproto",
]
