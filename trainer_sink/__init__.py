"""TensorDict batches for PPO/GRPO from the log or shards (DESIGN §7).

- ``sources``: where trajectories come from: the live TRAJ feed (a durable pull consumer),
  the Parquet shards (``pyarrow.dataset`` with filters), or a replayed TRAJ range.
- ``batching``: the batching policies (count, token budget, GRPO groups, staleness); pure.
- ``assembly``: trajectories -> one TensorDict in verl's padded layout or a jagged
  (``torch.nested``) layout; pure.
- ``sink``: ``async for batch in TrainerSink(source, ...)`` ... ``await batch.commit()``, and
  ``SyncSink`` / ``SinkDataset`` for code outside asyncio.
- ``trainer``: a small reference GRPO/PPO trainer on the tiny model, fed live by the sink; it
  publishes each new policy (PolicyUpdated) for the gateway to load.
- ``ray_actor``: the sink as a Ray actor (``sink_actor``) for Ray-based trainers; Ray is
  imported only there, when an actor is made.
"""

from __future__ import annotations

from trainer_sink.assembly import assemble, assemble_jagged, assemble_padded, non_tensor_values
from trainer_sink.batching import Batcher, BatchingStats, Decision, Dropped, DropReason, Sample
from trainer_sink.config import AssemblySettings, BatchingSettings, LiveSourceSettings
from trainer_sink.errors import BatchCommitted, BatchError, PolicyError, SinkError
from trainer_sink.ray_actor import (
    LiveSpec,
    OfflineSpec,
    SinkActor,
    SinkActorStats,
    SinkSpec,
    sink_actor,
)
from trainer_sink.sink import Batch, SinkDataset, SinkStats, SyncBatch, SyncSink, TrainerSink
from trainer_sink.sources import (
    LiveSource,
    OfflineSource,
    Received,
    ReplaySource,
    ShardFilter,
    Source,
)
from trainer_sink.trainer import ReferenceTrainer, ReferenceTrainerSettings, StepReport

__all__ = [
    "AssemblySettings",
    "Batch",
    "BatchCommitted",
    "BatchError",
    "Batcher",
    "BatchingSettings",
    "BatchingStats",
    "Decision",
    "DropReason",
    "Dropped",
    "LiveSource",
    "LiveSourceSettings",
    "LiveSpec",
    "OfflineSource",
    "OfflineSpec",
    "PolicyError",
    "Received",
    "ReferenceTrainer",
    "ReferenceTrainerSettings",
    "ReplaySource",
    "Sample",
    "ShardFilter",
    "SinkActor",
    "SinkActorStats",
    "SinkDataset",
    "SinkError",
    "SinkSpec",
    "SinkStats",
    "Source",
    "StepReport",
    "SyncBatch",
    "SyncSink",
    "TrainerSink",
    "assemble",
    "assemble_jagged",
    "assemble_padded",
    "non_tensor_values",
    "sink_actor",
]
