"""The trainer sink: trajectories from a source, batched and assembled, committed by the trainer.

::

    sink = TrainerSink(LiveSource(js, publisher), BatchingSettings(policy="groups", group_size=8))
    async for batch in sink:
        loss = train_step(batch.tensors)         # a TensorDict with verl's keys
        await batch.commit()                     # only now are its trajectories acknowledged

A batch not committed (the trainer crashed) is redelivered by the live source after its ack
wait; the batcher drops repeated trajectory ids. Samples the batcher drops (stale, incomplete or
uniform groups, over budget, duplicates) are acknowledged at once and counted in
``sink.batcher.stats``. ``SyncSink`` and ``SinkDataset`` serve code outside asyncio.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from tensordict import TensorDict
from torch.utils.data import IterableDataset

from schemas.events import TrajectoryReady
from trainer_sink.assembly import assemble
from trainer_sink.batching import Batcher, Decision, Sample
from trainer_sink.config import AssemblySettings, BatchingSettings
from trainer_sink.errors import BatchCommitted
from trainer_sink.sources import Received, Source

__all__ = ["Batch", "SinkDataset", "SinkStats", "SyncBatch", "SyncSink", "TrainerSink"]

T = TypeVar("T")


@dataclass
class SinkStats:
    batches: int = 0
    committed: int = 0  # batches
    released: int = 0  # batches handed back uncommitted
    dropped_acked: int = 0  # samples the batcher dropped, acknowledged


class Batch:
    """One batch: ``tensors`` for the trainer, ``commit()`` once the step is done."""

    def __init__(self, sink: TrainerSink, samples: list[Sample[Received]], tensors: TensorDict):
        self._sink = sink
        self.samples = samples
        self.tensors = tensors
        self._done = False

    @property
    def trajectories(self) -> list[TrajectoryReady]:
        return [s.trajectory for s in self.samples]

    @property
    def trajectory_ids(self) -> list[str]:
        return [s.trajectory.trajectory_id for s in self.samples]

    async def commit(self) -> None:
        """Acknowledge the batch's trajectories: they will not be delivered again."""
        self._finish()
        await self._sink._commit(self)

    async def release(self) -> None:
        """Give the batch back uncommitted: the live source delivers it again (finite sources
        do not repeat what they read)."""
        self._finish()
        await self._sink._release(self)

    def _finish(self) -> None:
        if self._done:
            raise BatchCommitted(
                f"batch of {len(self.samples)} trajectories (first {self.trajectory_ids[:1]}) "
                f"was already committed or released"
            )
        self._done = True


class TrainerSink:
    """``async for batch in sink``; see the module docstring."""

    def __init__(
        self,
        source: Source,
        batching: BatchingSettings | None = None,
        assembly: AssemblySettings | None = None,
        *,
        receive_max: int = 256,
        wait_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.source = source
        self.batching = batching or BatchingSettings()
        self.assembly = assembly or AssemblySettings()
        self.batcher: Batcher[Received] = Batcher(self.batching)
        self.stats = SinkStats()
        self._receive_max = receive_max
        self._wait_s = wait_s
        self._clock = clock
        self._ready: deque[list[Sample[Received]]] = deque()
        self._exhausted = False
        self._unacked: set[int] = set()  # TRAJ sequences received, not yet acknowledged
        _check_flow(self.source, self.batching)

    @property
    def trainer_version(self) -> int | None:
        return self.batcher.trainer_version

    @trainer_version.setter
    def trainer_version(self, version: int | None) -> None:
        """The weight version the trainer is at: the staleness bound is measured from it."""
        self.batcher.trainer_version = version

    def __aiter__(self) -> TrainerSink:
        return self

    async def __anext__(self) -> Batch:
        while not self._ready:
            if self._exhausted:
                raise StopAsyncIteration
            await self._pull()
        samples = self._ready.popleft()
        tensors = assemble([s.trajectory for s in samples], self.assembly)
        tensors["stale"] = torch.tensor([s.stale for s in samples], dtype=torch.bool)
        self.stats.batches += 1
        return Batch(self, samples, tensors)

    async def _pull(self) -> None:
        wait = self._wait_s
        deadline = self.batcher.deadline
        if deadline is not None:
            wait = max(0.01, min(wait, deadline - self._clock()))
        items = await self.source.receive(self._receive_max, wait)
        now = self._clock()
        if items is None:
            self._exhausted = True
            await self._apply(self.batcher.flush(now), ())
            return
        for item in items:
            # The same TRAJ message delivered again while its first copy waits uncommitted (in
            # a group, a batch, the trainer's hands): the batcher drops it as a duplicate, and
            # acking it would acknowledge the original, so it is left alone.
            again = item.seq is not None and item.seq in self._unacked
            if item.seq is not None:
                self._unacked.add(item.seq)
            await self._apply(
                self.batcher.add(Sample(item.trajectory, item), now), (item,) if again else ()
            )
        await self._apply(self.batcher.tick(now), ())

    async def _apply(self, decision: Decision[Received], keep: tuple[Received, ...]) -> None:
        self._ready.extend(decision.batches)
        to_ack = [d.sample.handle for d in decision.dropped if d.sample.handle not in keep]
        if to_ack:
            await self._ack(to_ack)
            self.stats.dropped_acked += len(to_ack)

    async def _ack(self, items: list[Received]) -> None:
        await self.source.ack(items)
        for item in items:
            if item.seq is not None:
                self._unacked.discard(item.seq)

    async def _commit(self, batch: Batch) -> None:
        await self._ack([s.handle for s in batch.samples])
        self.stats.committed += 1

    async def _release(self, batch: Batch) -> None:
        self.batcher.forget(batch.samples)
        items = [s.handle for s in batch.samples]
        await self.source.nak(items)
        for item in items:
            if item.seq is not None:
                self._unacked.discard(item.seq)
        self.stats.released += 1

    async def close(self) -> None:
        await self.source.close()


def _check_flow(source: Source, batching: BatchingSettings) -> None:
    """A batch must fit in what the live feed delivers uncommitted, or the sink waits forever."""
    limit = source.max_unacked
    if limit is None or batching.policy == "tokens":
        return
    per_batch = batching.batch_size * (batching.group_size if batching.policy == "groups" else 1)
    if per_batch > limit:
        raise ValueError(
            f"a batch needs {per_batch} trajectories ({batching.policy} policy) but the live "
            f"source delivers at most max_ack_pending={limit} uncommitted: raise "
            f"max_ack_pending or lower batch_size / group_size"
        )


# -- outside asyncio --------------------------------------------------------------------------


class SyncSink:
    """A TrainerSink driven from plain Python: it runs on its own event loop in a thread.

    ``make_sink`` is called on that loop (connections belong to the loop that made them)::

        with SyncSink(lambda: open_live_sink(url, ...)) as sink:
            for batch in sink:
                step(batch.tensors)
                batch.commit()
    """

    def __init__(self, make_sink: Callable[[], Awaitable[TrainerSink]]) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()

        async def make() -> TrainerSink:
            return await make_sink()

        self.sink = self.run(make())

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def __iter__(self) -> Iterator[SyncBatch]:
        while True:
            try:
                batch = self.run(self.sink.__anext__())
            except StopAsyncIteration:
                return
            yield SyncBatch(self, batch)

    def close(self) -> None:
        if self._loop.is_running():
            self.run(self.sink.close())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

    def __enter__(self) -> SyncSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class SyncBatch:
    _owner: SyncSink
    batch: Batch

    @property
    def tensors(self) -> TensorDict:
        return self.batch.tensors

    @property
    def trajectory_ids(self) -> list[str]:
        return self.batch.trajectory_ids

    def commit(self) -> None:
        self._owner.run(self.batch.commit())

    def release(self) -> None:
        self._owner.run(self.batch.release())


class SinkDataset(IterableDataset[TensorDict]):
    """A torch ``IterableDataset`` of batches: ``DataLoader(dataset, batch_size=None,
    collate_fn=lambda batch: batch)`` (each item already is a batch; the default conversion
    would try to index the TensorDict), or iterate the dataset itself.

    A DataLoader has no commit hook, so a batch is committed when the next one is requested: the
    trainer has finished its step with it. The last batch is committed when the iteration ends.
    """

    def __init__(self, make_sink: Callable[[], Awaitable[TrainerSink]]) -> None:
        self._make_sink = make_sink

    def __iter__(self) -> Iterator[TensorDict]:
        with SyncSink(self._make_sink) as sink:
            previous: SyncBatch | None = None
            for batch in sink:
                if previous is not None:
                    previous.commit()
                previous = batch
                yield batch.tensors
            if previous is not None:
                previous.commit()
