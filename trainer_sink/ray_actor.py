"""The trainer sink as a Ray actor, for trainers that run on Ray (verl, OpenRLHF, ...).

The actor builds its ``TrainerSink`` from a picklable ``SinkSpec`` on its own event loop (an
async actor: every method is ``async def``, so the NATS connection and the in-progress keeper
live there) and hands out batches by token::

    import ray
    from trainer_sink.ray_actor import LiveSpec, SinkSpec, sink_actor

    sink = sink_actor(SinkSpec(LiveSpec("nats://head:4222"), BatchingSettings(batch_size=64)))
    while (got := ray.get(sink.next_batch.remote())) is not None:
        token, tensors = got                   # a TensorDict with verl's keys
        train_step(tensors)
        ray.get(sink.commit.remote(token))     # only now are its trajectories acknowledged

The TensorDict travels through Ray's object store by pickling: dense, nested (jagged layout) and
non-tensor (``NonTensorStack``) entries all come back equal. The actor keeps each batch until
its token is committed or released. The actor belongs to the process that started it and dies
with it, closing its connection, so a crashed trainer's uncommitted batches are redelivered
after the ack wait, as with the plain sink. A ``lifetime="detached"`` actor outlives its trainer
and keeps what it holds alive (the source tells JetStream it is in progress): call ``close()``,
which releases held batches, before a new trainer takes over. Ray is imported only by
``sink_actor``: ``import trainer_sink`` does not need it.

Shards and Ray Data: ``ray.data.read_parquet(root)`` reads the shard tree
(``<root>/run=<run>/part-….parquet``) as it is. Ray's hive partitioning types a partition value
as a string unless ``field_types`` says otherwise, so ``run=0042`` reads as ``"0042"``, like the
``run`` column inside the files (pyarrow's inferred partitioning would make it an int, hence
``shardstore.RUN_PARTITIONING``). To state it rather than rely on the default, pass
``partitioning=Partitioning("hive", field_types={"run": str})``; ``partitioning=None`` takes
``run`` from the files alone. Unfinished shards (``.part-….parquet.tmp``) are skipped by the
default ``file_extensions=["parquet"]``. Pick runs by path, without opening the other shards,
with ``partition_filter=PathPartitionFilter.of(lambda run: run["run"] == "0042", style="hive")``.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from typing import Any

from tensordict import TensorDict

from eventlog import JetStreamImageStore, LogSettings
from trainer_sink.batching import BatchingStats
from trainer_sink.config import AssemblySettings, BatchingSettings, LiveSourceSettings
from trainer_sink.errors import BatchCommitted
from trainer_sink.sink import Batch, SinkStats, TrainerSink
from trainer_sink.sources import LiveSource, OfflineSource, ShardFilter
from trainer_sink.vision import ImageDirectory, SinkVision, VisionModel

__all__ = [
    "ImagesSpec",
    "LiveSpec",
    "OfflineSpec",
    "SinkActor",
    "SinkActorStats",
    "SinkSpec",
    "sink_actor",
]


@dataclass(frozen=True)
class LiveSpec:
    """The live TRAJ feed: a durable consumer on a connection of the actor's own."""

    url: str
    settings: LiveSourceSettings = field(default_factory=LiveSourceSettings)
    log_settings: LogSettings | None = None
    run: str | None = None  # only this run's trajectories; None: every run


@dataclass(frozen=True)
class OfflineSpec:
    """The Parquet shards under ``uri`` (a directory the actor can see, or a pyarrow URI)."""

    uri: str
    where: ShardFilter = field(default_factory=ShardFilter)
    read_rows: int = 1024


@dataclass(frozen=True)
class ImagesSpec:
    """Batches with images (``trainer_sink.vision``): the vision-language model's directory
    (its image processor and config), and where the images' bytes are: ``directory`` (files
    named by digest), else the log's image store over the live feed's own connection."""

    model_dir: str
    directory: str | None = None


@dataclass(frozen=True)
class SinkSpec:
    """Everything the actor needs to build its sink; picklable, so it can cross to the actor."""

    source: LiveSpec | OfflineSpec
    batching: BatchingSettings = field(default_factory=BatchingSettings)
    assembly: AssemblySettings = field(default_factory=AssemblySettings)
    receive_max: int = 256
    wait_s: float = 1.0
    images: ImagesSpec | None = None

    async def open(self) -> TrainerSink:
        """The sink, its source connected (call it on the loop that will run the sink)."""
        src = self.source
        if isinstance(src, LiveSpec):
            source: LiveSource | OfflineSource = await LiveSource.connect(
                src.url, src.settings, log_settings=src.log_settings, run=src.run
            )
        else:
            source = OfflineSource(src.uri, src.where, src.read_rows)
        return TrainerSink(
            source,
            self.batching,
            self.assembly,
            receive_max=self.receive_max,
            wait_s=self.wait_s,
            vision=await self._vision(source),
        )

    async def _vision(self, source: LiveSource | OfflineSource) -> SinkVision | None:
        spec = self.images
        if spec is None:
            return None
        model = await asyncio.to_thread(VisionModel.load, spec.model_dir)
        if spec.directory is not None:
            return SinkVision(model, ImageDirectory(spec.directory))
        if not isinstance(source, LiveSource) or source.connection is None:
            raise ValueError(
                "ImagesSpec without a directory reads the log's image store over the live "
                "feed's connection: give an offline sink ImagesSpec(model_dir, directory=...)"
            )
        settings = self.source.log_settings if isinstance(self.source, LiveSpec) else None
        store = await JetStreamImageStore.open(source.connection, settings or LogSettings())
        return SinkVision(model, store)


@dataclass(frozen=True)
class SinkActorStats:
    sink: SinkStats
    batching: BatchingStats
    held: int  # batches handed out, neither committed nor released
    exhausted: bool  # a finite source has been read to its end and every batch handed out


class SinkActor:
    """A ``TrainerSink`` behind batch tokens; use it through ``sink_actor`` (or
    ``ray.remote(SinkActor)``). Plain Python too: awaiting its methods directly works."""

    def __init__(self, spec: SinkSpec) -> None:
        self._spec = spec
        self._sink: TrainerSink | None = None
        self._held: dict[str, Batch] = {}
        self._tokens = itertools.count(1)
        self._lock: asyncio.Lock | None = None  # made on the actor's loop, not in __init__
        self._pending: asyncio.Task[Batch | None] | None = None
        self._exhausted = False

    async def next_batch(self, timeout_s: float | None = None) -> tuple[str, TensorDict] | None:
        """The next batch as ``(token, tensors)``; None once a finite source is exhausted.

        With ``timeout_s``, None also when no batch was ready in time (``stats().exhausted``
        tells the two apart). The wait is not abandoned: the next call takes it up, so a
        batch that becomes ready meanwhile is neither lost nor held without a token.
        """
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:  # one batch at a time: the sink is not re-entrant
            if self._exhausted:
                return None
            if self._pending is None:
                self._pending = asyncio.create_task(self._next(await self._opened()))
            done, _ = await asyncio.wait({self._pending}, timeout=timeout_s)
            if not done:
                return None
            task, self._pending = self._pending, None
            batch = task.result()
            if batch is None:
                self._exhausted = True
                return None
            token = f"batch-{next(self._tokens)}"
            self._held[token] = batch
            return token, batch.tensors

    async def commit(self, token: str) -> None:
        """Acknowledge the batch's trajectories: they will not be delivered again. When the log
        does not confirm (EventLogUnavailable), the token stays held: commit it again."""
        await (await self._opened()).commit(self._held_batch(token))
        del self._held[token]

    async def release(self, token: str) -> None:
        """Hand the batch back uncommitted: the live source delivers it again at once."""
        await (await self._opened()).release(self._held_batch(token))
        del self._held[token]

    async def set_trainer_version(self, version: int | None) -> None:
        """The trainer's weight version, from which the staleness bound is measured."""
        (await self._opened()).trainer_version = version

    async def stats(self) -> SinkActorStats:
        if self._sink is None:  # nothing asked yet: no reason to connect
            return SinkActorStats(SinkStats(), BatchingStats(), 0, self._exhausted)
        sink = self._sink
        return SinkActorStats(sink.stats, sink.batcher.stats, len(self._held), self._exhausted)

    async def close(self) -> None:
        """Release the batches still held (delivered again at once) and close the source."""
        if self._pending is not None:
            self._pending.cancel()
            await asyncio.gather(self._pending, return_exceptions=True)
            self._pending = None
        for token in list(self._held):
            await self.release(token)
        if self._sink is not None:
            await self._sink.close()
            self._sink = None

    async def _opened(self) -> TrainerSink:
        if self._sink is None:
            self._sink = await self._spec.open()
        return self._sink

    @staticmethod
    async def _next(sink: TrainerSink) -> Batch | None:
        try:
            return await sink.__anext__()
        except StopAsyncIteration:
            return None

    def _held_batch(self, token: str) -> Batch:
        try:
            return self._held[token]
        except KeyError:
            raise BatchCommitted(
                f"no batch {token!r} is held by this sink actor: it was already committed or "
                f"released, or the token came from another actor"
            ) from None


def sink_actor(spec: SinkSpec, **options: Any) -> Any:
    """A ``SinkActor`` started on the current Ray cluster; ``options`` go to ``.options()``
    (``name``, ``num_cpus``, ``lifetime``, ...).

    The handle is typed ``Any``: Ray types an actor's methods only when they are decorated
    with ``@ray.method``, which would import Ray with this module; ``ActorHandle[SinkActor]``
    would make every ``handle.next_batch.remote()`` a ``Never`` to mypy.
    """
    import ray  # here, not at the top: the rest of trainer_sink does not need Ray

    actor_class = ray.remote(SinkActor)
    if options:
        actor_class = actor_class.options(**options)
    return actor_class.remote(spec)
