"""The trainer sink: trajectories from a source, batched and assembled, committed by the trainer.

::

    sink = TrainerSink(LiveSource(js, publisher), BatchingSettings(policy="groups", group_size=8))
    async for batch in sink:
        loss = train_step(batch.tensors)         # a TensorDict with verl's keys
        await sink.commit(batch)                 # only now are its trajectories acknowledged

A pipeline of values: the ``Source`` hands out received trajectories (and alone tracks which
wait unacknowledged), the pure ``Batcher`` groups them into batches (and names each group
instance), the pure ``assemble`` turns a batch into its TensorDict (every key: see
``trainer_sink.assembly``), and a ``Batch`` is that TensorDict plus an ``AckToken``. The trainer
commits or releases a batch through the sink, which acknowledges or hands back the token's
items through the source.

A batch not committed (the trainer crashed) is redelivered by the live source after its ack
wait; the batcher drops repeated trajectory ids. Samples the batcher drops (stale, incomplete or
uniform groups, over budget, duplicates) are acknowledged at once and counted in
``sink.batcher.stats``. ``SyncSink`` and ``SinkDataset`` serve code outside asyncio.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from tensordict import TensorDict
from torch.utils.data import IterableDataset

from schemas.errors import EventLogError, EventLogUnavailable
from schemas.events import TrajectoryReady
from trainer_sink.assembly import assemble
from trainer_sink.batching import Batcher, Decision, Sample
from trainer_sink.buffers import BatchBuffers
from trainer_sink.config import AssemblySettings, BatchingSettings
from trainer_sink.errors import BatchCommitted, BatchError
from trainer_sink.sources import Received, Source
from trainer_sink.vision import SinkVision

__all__ = [
    "AckToken",
    "Batch",
    "SinkDataset",
    "SinkStats",
    "SyncSink",
    "TrainerSink",
]

T = TypeVar("T")

log = logging.getLogger(__name__)


@dataclass
class SinkStats:
    batches: int = 0
    committed: int = 0  # batches
    released: int = 0  # batches handed back uncommitted
    dropped_acked: int = 0  # samples the batcher dropped, acknowledged


@dataclass(frozen=True, eq=False)
class AckToken:
    """What commits or releases one batch: its samples as the batcher released them (each with
    the source's handle). ``number`` is unique within its sink."""

    number: int
    samples: tuple[Sample[Received], ...]


@dataclass(frozen=True, eq=False)
class Batch:
    """One batch: ``tensors`` for the trainer, ``token`` for ``sink.commit`` / ``sink.release``."""

    tensors: TensorDict
    token: AckToken

    @property
    def samples(self) -> tuple[Sample[Received], ...]:
        return self.token.samples

    @property
    def trajectories(self) -> list[TrajectoryReady]:
        return [s.trajectory for s in self.token.samples]

    @property
    def trajectory_ids(self) -> list[str]:
        return [s.trajectory.trajectory_id for s in self.token.samples]


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
        vision: SinkVision | None = None,
    ) -> None:
        self.source = source
        self.vision = vision
        self.batching = batching or BatchingSettings()
        self.assembly = assembly or AssemblySettings()
        self._buffers = BatchBuffers() if self.assembly.reuse_memory else None
        self.batcher: Batcher[Received] = Batcher(self.batching)
        self.stats = SinkStats()
        self._receive_max = receive_max
        self._wait_s = wait_s
        self._clock = clock
        self._ready: deque[list[Sample[Received]]] = deque()
        self._exhausted = False
        self._numbers = itertools.count()
        self._outstanding: dict[int, AckToken] = {}  # handed out, neither committed nor released
        self._window_warned = False
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
        trajectories = [s.trajectory for s in samples]
        try:
            tensors = assemble(
                trajectories,
                self.assembly,
                uids=[s.uid for s in samples],
                stale=[s.stale for s in samples],
                buffers=self._buffers,
            )
            tensors = await self._with_images(tensors, trajectories)
        except (BatchError, EventLogError):
            # Settings the samples do not fit (the error says which), or images that could not
            # be read (the store did not answer, or lacks one): hand them back rather than
            # strand them uncommitted; they come again once that is fixed.
            await self._hand_back(samples)
            raise
        token = AckToken(next(self._numbers), tuple(samples))
        self._outstanding[token.number] = token
        self.stats.batches += 1
        return Batch(tensors, token)

    async def _with_images(
        self, tensors: TensorDict, trajectories: list[TrajectoryReady]
    ) -> TensorDict:
        """The batch with its images' model inputs (``trainer_sink.vision``) where it has
        images; a batch with images and no ``vision`` to read them is a BatchError, not a
        batch that trains on placeholder tokens without their pixels."""
        if self.vision is not None:
            return await self.vision.add(tensors, trajectories)
        with_images = [t.trajectory_id for t in trajectories if t.images]
        if with_images:
            raise BatchError(
                f"{len(with_images)} trajectories have images (first {with_images[0]}) but the "
                f"sink was given no vision= (trainer_sink.SinkVision: the model's image "
                f"processor and the log's image store) to read them with"
            )
        return tensors

    async def commit(self, batch: Batch) -> None:
        """Acknowledge the batch's trajectories: they will not be delivered again. When the log
        does not confirm (EventLogUnavailable), commit again (acks are idempotent) or release;
        what stays unconfirmed is delivered again after the ack wait."""
        token = self._outstanding_token(batch)
        await self.source.ack([s.handle for s in token.samples])
        del self._outstanding[token.number]
        self.stats.committed += 1

    async def release(self, batch: Batch) -> None:
        """Give the batch back uncommitted: the live source delivers it again (finite sources
        do not repeat what they read)."""
        token = self._outstanding_token(batch)
        del self._outstanding[token.number]
        await self._hand_back(list(token.samples))
        self.stats.released += 1

    def _outstanding_token(self, batch: Batch) -> AckToken:
        token = batch.token
        if self._outstanding.get(token.number) is not token:
            raise BatchCommitted(
                f"batch {token.number} of {len(token.samples)} trajectories (first "
                f"{batch.trajectory_ids[:1]}) was already committed or released, or came from "
                f"another sink"
            )
        return token

    async def _pull(self) -> None:
        wait = self._wait_s
        deadline = self.batcher.deadline
        if deadline is not None:
            wait = max(0.01, min(wait, deadline - self._clock()))
        items = await self.source.receive(self._receive_max, wait)
        now = self._clock()
        if items is None:
            self._exhausted = True
            await self._apply(self.batcher.flush(now))
            return
        for item in items:
            await self._apply(self.batcher.add(Sample(item.trajectory, item), now))
        await self._apply(self.batcher.tick(now))
        await self._when_window_full(now)

    async def _when_window_full(self, now: float) -> None:
        """JetStream delivers nothing more while ``max_ack_pending`` trajectories wait
        uncommitted. Held by the batcher with no batch ready, they would wait forever."""
        limit, unacked = self.source.max_unacked, self.source.unacked
        if limit is None or self._ready or unacked < limit:
            self._window_warned = False
            return
        if self.batching.policy == "tokens":
            # Under the budget, but no more can come: release what is held as a batch.
            await self._apply(self.batcher.flush(now))
            return
        if not self._window_warned and self.batcher.pending:
            self._window_warned = True
            log.warning(
                "the live window is full: %d trajectories wait uncommitted (max_ack_pending=%d), "
                "%d of them held in incomplete batches or groups; nothing more is delivered "
                "until some are committed. Incomplete groups go by incomplete_groups=%s after "
                "group_timeout_s=%gs. Raise max_ack_pending to hold every group in flight at "
                "once (group_size x concurrent groups)",
                unacked,
                limit,
                self.batcher.pending,
                self.batching.incomplete_groups,
                self.batching.group_timeout_s,
            )

    async def _apply(self, decision: Decision[Received]) -> None:
        self._ready.extend(decision.batches)
        dropped = [d.sample.handle for d in decision.dropped]
        if not dropped:
            return
        try:
            await self.source.ack(dropped)
        except EventLogUnavailable as exc:
            # Dropped either way: handed back, they come again, are recognized as duplicates
            # (the batcher remembers them) and acknowledged then.
            log.warning("%d dropped trajectories not acknowledged yet: %s", len(dropped), exc)
            await self.source.nak(dropped)
            return
        self.stats.dropped_acked += len(dropped)

    async def _hand_back(self, samples: list[Sample[Received]]) -> None:
        self.batcher.forget(samples)
        await self.source.nak([s.handle for s in samples])

    async def close(self) -> None:
        """Hand back everything held (batches not committed, batches not yet taken, samples
        waiting in the batcher): the live source delivers it again at once rather than after
        its ack wait. Then close the source."""
        held = [s for token in self._outstanding.values() for s in token.samples]
        held += [s for batch in self._ready for s in batch]
        held += self.batcher.drain()
        self._outstanding.clear()
        self._ready.clear()
        if held:
            try:
                await self._hand_back(held)
            except EventLogUnavailable as exc:
                log.warning("%d held trajectories not handed back: %s", len(held), exc)
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
                sink.commit(batch)
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

    def __iter__(self) -> Iterator[Batch]:
        while True:
            try:
                yield self.run(self.sink.__anext__())
            except StopAsyncIteration:
                return

    def commit(self, batch: Batch) -> None:
        """``TrainerSink.commit``, waited for."""
        self.run(self.sink.commit(batch))

    def release(self, batch: Batch) -> None:
        """``TrainerSink.release``, waited for."""
        self.run(self.sink.release(batch))

    def close(self) -> None:
        if self._loop.is_running():
            self.run(self.sink.close())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

    def __enter__(self) -> SyncSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
            batches = iter(sink)
            while True:
                # Commit before asking for the next batch: asking first would need two batches
                # uncommitted at once, more than max_ack_pending may allow.
                batch = next(batches, None)
                if batch is None:
                    return
                yield batch.tensors
                sink.commit(batch)
