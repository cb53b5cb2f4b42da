"""Where the sink's trajectories come from: the live TRAJ feed, shards, or a TRAJ range.

Every source hands out ``Received`` items; the sink acknowledges them through the source once
their batch is committed (or once it dropped them). The source alone tracks which items wait
unacknowledged (``unacked``):

- ``LiveSource``: a handler of the one pull loop (``eventlog.loop.PullLoop``) on a durable
  consumer on TRAJ, flow-controlled by ``max_ack_pending`` (JetStream delivers no more than
  that many uncommitted trajectories). The sink pulls at its own pace (``loop.step``). What is
  not committed is redelivered after ``ack_wait_s`` (a trainer crash), and the sink drops
  repeated trajectory ids. Uncommitted items are held, and the loop keeps them alive
  (``in_progress``) while the trainer holds them, so a long step is not taken for a crash. A
  message delivered again while its first copy is still held (a keep-alive that came too late)
  is not handed out twice: acking the first copy acknowledges it. A commit is recorded in the
  log before it is acknowledged (``eventlog.commits``): nats-server can forget acks it
  confirmed moments before a crash, and a committed trajectory it redelivers
  is dropped here, never handed to the trainer again.
- ``OfflineSource``: the Parquet shards through ``pyarrow.dataset`` with filters (run, reward,
  weight version, time). Finite; nothing to acknowledge.
- ``ReplaySource``: a range of TRAJ sequences, read with an ordered consumer. Finite; nothing to
  acknowledge (the stream is not changed). A message that is not a TrajectoryReady is skipped
  with a warning naming its sequence (it cannot be dead-lettered: replay changes nothing).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import itertools
import logging
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from eventlog import (
    Connection,
    ConsumerSpec,
    JetStream,
    JetStreamPublisher,
    LogSettings,
    Publisher,
    connect,
)
from eventlog.commits import CommitLedger
from eventlog.connection import close_connection
from eventlog.loop import ACK, HOLD, Delivery, Outcome, PullLoop, Reject
from eventlog.reader import read_range
from schemas.codec import Codec
from schemas.errors import EventLogUnavailable, SchemaError
from schemas.events import TrajectoryReady
from schemas.ids import TRAJ_SUBJECT_PREFIX
from schemas.shards import table_to_trajectories
from shardstore import open_shards_dataset
from trainer_sink.config import LiveSourceSettings

__all__ = [
    "LiveSource",
    "OfflineSource",
    "Received",
    "ReplaySource",
    "ShardFilter",
    "Source",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class Received:
    """One trajectory and what acknowledges it (``handle``: its delivery, live only)."""

    trajectory: TrajectoryReady
    seq: int | None = None  # TRAJ sequence, where known
    handle: Delivery | None = None


class Source(Protocol):
    """What the sink reads from."""

    @property
    def max_unacked(self) -> int | None:
        """How many received items may wait unacknowledged before delivery stops (the live
        feed's flow control); None: no such limit."""
        ...

    @property
    def unacked(self) -> int:
        """Items handed out and neither acknowledged nor handed back."""
        ...

    async def receive(self, max_items: int, wait_s: float) -> list[Received] | None:
        """Up to ``max_items`` items, waiting at most ``wait_s`` for the first; None at the end."""
        ...

    async def ack(self, items: Sequence[Received]) -> None:
        """The items are done with (committed or dropped): never deliver them again."""
        ...

    async def nak(self, items: Sequence[Received]) -> None:
        """Hand the items back: deliver them again (live); finite sources do not repeat."""
        ...

    async def close(self) -> None: ...


# -- live -----------------------------------------------------------------------------------


@dataclass
class LiveStats:
    received: int = 0
    acked: int = 0
    dead_lettered: int = 0
    already_committed: int = 0  # redelivered after their commit (eventlog.commits): dropped
    redelivered_held: int = 0  # delivered again while the first copy was held: not handed out
    ack_unconfirmed: int = 0  # committed (recorded) but the ack not confirmed: see ack()


class LiveSource:
    """The TRAJ feed, from a durable pull consumer shared by nobody but this training job."""

    def __init__(
        self,
        js: JetStream,
        publisher: Publisher,
        settings: LiveSourceSettings | None = None,
        *,
        stream: str = "TRAJ",
        run: str | None = None,
        codec: Codec | None = None,
        commits_bucket: str = "ts_commits",
    ) -> None:
        self.settings = s = settings or LiveSourceSettings()
        self.stream = stream
        self.run = run
        self._codec = codec or Codec()
        self._js = js
        self._commits_bucket = commits_bucket
        self._ledger: CommitLedger | None = None
        self._ready: list[Received] = []
        self._held: set[int] = set()  # TRAJ sequences handed out, not yet acked or handed back
        self._owned: tuple[Connection, JetStreamPublisher] | None = None
        self.stats = LiveStats()
        subject = f"{TRAJ_SUBJECT_PREFIX}.{run}" if run else f"{TRAJ_SUBJECT_PREFIX}.>"
        spec = ConsumerSpec(
            stream=stream,
            durable=s.durable,
            filter_subjects=(subject,),
            max_ack_pending=s.max_ack_pending,
            ack_wait_s=s.ack_wait_s,
            batch=s.fetch_batch,
            max_deliver=-1,  # a trajectory waits for its trainer, however long
            fetch_max_bytes=s.fetch_max_bytes,
        )
        self.loop = PullLoop(
            js, spec, self, publisher=publisher, source="sink", max_payload=self._codec.max_payload
        )

    @property
    def max_unacked(self) -> int | None:
        return self.settings.max_ack_pending

    @property
    def unacked(self) -> int:
        return len(self._held)

    @property
    def connection(self) -> Connection | None:
        """The connection ``connect`` made for this source (None: the caller's)."""
        return self._owned[0] if self._owned is not None else None

    @classmethod
    async def connect(
        cls,
        url: str,
        settings: LiveSourceSettings | None = None,
        *,
        log_settings: LogSettings | None = None,
        run: str | None = None,
    ) -> LiveSource:
        """A live source on its own connection to ``url``, closed with the source."""
        log_settings = log_settings or LogSettings()
        nc = await connect(url, log_settings, name="turnstream-sink")
        publisher = await JetStreamPublisher(nc).start()
        source = cls(
            nc.jetstream(),
            publisher,
            settings,
            stream=log_settings.names.trajectories,
            run=run,
            codec=Codec(max_payload=log_settings.max_payload),
            commits_bucket=log_settings.names.commits_bucket,
        )
        source._owned = (nc, publisher)
        return await source.start()

    async def start(self) -> LiveSource:
        """Read this durable's commit records back, then bind its consumer."""
        if self._ledger is None:
            self._ledger = await CommitLedger.open(
                self._js, self._commits_bucket, self.settings.durable
            )
        await self.loop.bind()
        return self

    async def handle(self, delivery: Delivery) -> Outcome:
        assert self._ledger is not None
        if delivery.seq in self._ledger:  # committed, but nats-server forgot the ack
            self.stats.already_committed += 1
            return ACK
        if delivery.seq in self._held:  # the first copy is still held: its ack covers this one
            self.stats.redelivered_held += 1
            return HOLD
        try:
            event = self._codec.decode_trajectory(delivery.data, delivery.subject)
        except SchemaError as exc:
            self.stats.dead_lettered += 1
            return Reject(exc.reason, f"{type(exc).__name__}: {exc}")
        self._ready.append(Received(event, delivery.seq, delivery))
        self._held.add(delivery.seq)
        return HOLD  # until the trainer commits its batch

    async def receive(self, max_items: int, wait_s: float) -> list[Received] | None:
        if self._ledger is None:
            await self.start()
        await self.loop.step(max_items, wait_s)
        received, self._ready = self._ready, []
        self.stats.received += len(received)
        return received

    async def ack(self, items: Sequence[Received]) -> None:
        """Commit: record the items' sequences (``eventlog.commits``: what survives a crash of
        nats-server), then acknowledge them; returns once the record is stored. Raises
        EventLogUnavailable (and nothing is committed) when the record is not stored.

        The record is the commit: a delivery of a recorded sequence is acknowledged on arrival
        and never handed out (``handle``). So an ack the server does not confirm within
        ``ack_timeout_s`` does not fail the commit: the item is no longer kept alive, and if the
        ack was lost it comes back once and is acknowledged then; the batch's later acks are sent
        without waiting for an answer, so one silent server costs ``ack_timeout_s`` once per
        commit, not once per item. Waiting for that confirmation instead could wait forever:
        nats-server answers no ack for a delivery it has since delivered again (seen in the
        soak after a nats-server restart, 2026-11-26)."""
        assert self._ledger is not None
        seqs = [i.seq for i in items if i.handle is not None and i.seq is not None]
        try:
            await self._ledger.record(seqs)
        except EventLogUnavailable as exc:
            raise EventLogUnavailable(
                f"the commit of {len(seqs)} trajectories was not stored: {exc}; commit again or "
                f"release the batch; uncommitted, it is delivered again after ack_wait_s="
                f"{self.settings.ack_wait_s:g}"
            ) from exc
        confirm: float | None = self.settings.ack_timeout_s
        for item in items:
            if item.handle is None:
                continue
            if confirm is None:  # the server left one unanswered: the rest are not waited for
                await self.loop.ack([item.handle])
                self.stats.ack_unconfirmed += 1
            else:
                try:
                    await self.loop.ack([item.handle], confirm_s=confirm)
                except EventLogUnavailable as exc:
                    confirm = None  # (loop.ack no longer keeps the item alive)
                    self.stats.ack_unconfirmed += 1
                    log.info(
                        "ack of %s (TRAJ seq %s) not confirmed (%s): committed all the same, a "
                        "delivery of it again is acknowledged on arrival; the batch's other "
                        "acks are sent without waiting",
                        item.trajectory.trajectory_id,
                        item.seq,
                        exc.__cause__,
                    )
            self._let_go([item])
            self.stats.acked += 1

    async def nak(self, items: Sequence[Received]) -> None:
        await self.loop.nak(i.handle for i in items if i.handle is not None)
        self._let_go(items)

    def _let_go(self, items: Sequence[Received]) -> None:
        for item in items:
            if item.seq is not None:
                self._held.discard(item.seq)

    async def close(self) -> None:
        await self.loop.close()
        if self._owned is not None:
            nc, publisher = self._owned
            self._owned = None
            await publisher.close()
            await close_connection(nc)


# -- offline --------------------------------------------------------------------------------


class _ReadOnly:
    """A finite source that changes nothing it reads: nothing to acknowledge or hand back."""

    max_unacked: int | None = None
    unacked: int = 0

    async def ack(self, items: Sequence[Received]) -> None:
        return None

    async def nak(self, items: Sequence[Received]) -> None:
        return None


@dataclass(frozen=True)
class ShardFilter:
    """Which shard rows to read; every bound is optional and inclusive."""

    runs: Sequence[str] = ()
    min_reward: float | None = None
    max_reward: float | None = None
    min_weight_version: int | None = None  # on the sample's oldest generated token
    max_weight_version: int | None = None  # on its newest
    since: dt.datetime | None = None  # created_at, timezone-aware
    until: dt.datetime | None = None

    def expression(self) -> ds.Expression | None:
        terms = []
        if self.runs:
            terms.append(pc.field("run").isin(list(self.runs)))
        if self.min_reward is not None:
            terms.append(pc.field("reward") >= self.min_reward)
        if self.max_reward is not None:
            terms.append(pc.field("reward") <= self.max_reward)
        if self.min_weight_version is not None:
            terms.append(pc.field("min_weight_version") >= self.min_weight_version)
        if self.max_weight_version is not None:
            terms.append(pc.field("max_weight_version") <= self.max_weight_version)
        if self.since is not None:
            terms.append(pc.field("created_at") >= self.since)
        if self.until is not None:
            terms.append(pc.field("created_at") <= self.until)
        if not terms:
            return None
        expression = terms[0]
        for term in terms[1:]:
            expression = expression & term
        return expression


@dataclass
class OfflineSource(_ReadOnly):
    """Trajectories from the Parquet shards under ``uri`` (a directory or a pyarrow URI)."""

    uri: str
    where: ShardFilter = field(default_factory=ShardFilter)
    read_rows: int = 1024  # rows decoded at a time
    _rows: Iterator[Received] | None = field(default=None, init=False, repr=False)

    def _iterate(self) -> Iterator[Received]:
        dataset = open_shards_dataset(self.uri)
        for record_batch in dataset.to_batches(
            filter=self.where.expression(), batch_size=self.read_rows
        ):
            table = pa.Table.from_batches([record_batch])
            for seq, trajectory in table_to_trajectories(table):
                yield Received(trajectory, seq)

    async def receive(self, max_items: int, wait_s: float) -> list[Received] | None:
        if self._rows is None:
            self._rows = self._iterate()
        rows = self._rows
        taken = await asyncio.to_thread(lambda: list(itertools.islice(rows, max_items)))
        return taken or None

    async def close(self) -> None:
        self._rows = None


# -- replay ---------------------------------------------------------------------------------


class ReplaySource(_ReadOnly):
    """TRAJ sequences ``first``..``last`` (inclusive), in order, read without changing TRAJ."""

    def __init__(
        self,
        js: JetStream,
        first: int,
        last: int,
        *,
        stream: str = "TRAJ",
        codec: Codec | None = None,
    ) -> None:
        if first < 1 or last < first:
            raise ValueError(f"replay range {first}..{last}: need 1 <= first <= last")
        self._js = js
        self.first, self.last = first, last
        self.stream = stream
        self._codec = codec or Codec()
        self._messages: AsyncIterator[Received] | None = None
        self._done = False

    async def _iterate(self) -> AsyncIterator[Received]:
        subject = f"{TRAJ_SUBJECT_PREFIX}.>"
        async for stored in read_range(self._js, self.stream, subject, self.first, self.last):
            try:
                event = self._codec.decode_trajectory(stored.data, stored.subject)
            except SchemaError as exc:
                log.warning("replay: %s seq %d skipped: %s", self.stream, stored.seq, exc)
                continue
            yield Received(event, stored.seq)

    async def receive(self, max_items: int, wait_s: float) -> list[Received] | None:
        if self._done:
            return None
        if self._messages is None:
            self._messages = self._iterate()
        taken: list[Received] = []
        async for item in self._messages:
            taken.append(item)
            if len(taken) >= max_items:
                return taken
        self._done = True
        return taken or None

    async def close(self) -> None:
        if self._messages is not None:
            await self._messages.aclose()  # type: ignore[attr-defined]
