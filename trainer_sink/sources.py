"""Where the sink's trajectories come from: the live TRAJ feed, shards, or a TRAJ range.

Every source hands out ``Received`` items; the sink acknowledges them through the source once
their batch is committed (or once it dropped them):

- ``LiveSource``: a durable pull consumer on TRAJ, flow-controlled by ``max_ack_pending``
  (JetStream delivers no more than that many uncommitted trajectories). What is not committed
  is redelivered after ``ack_wait_s`` (a trainer crash), and the sink drops repeated
  trajectory ids. Uncommitted items are kept alive with ``in_progress`` while the trainer holds
  them, so a long step is not taken for a crash.
- ``OfflineSource``: the Parquet shards through ``pyarrow.dataset`` with filters (run, reward,
  weight version, time). Finite; nothing to acknowledge.
- ``ReplaySource``: a range of TRAJ sequences, read with an ordered consumer. Finite; nothing to
  acknowledge (the stream is not changed).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import itertools
import logging
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import nats.errors
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js import api as js_api

from eventlog import (
    FetchSizer,
    JetStreamPublisher,
    LogSettings,
    Publisher,
    PullConsumer,
    connect,
    fetch,
    release,
    stream_seq,
)
from eventlog.dead_letters import publish_dead_letter
from eventlog.shard_store import open_shards_dataset
from schemas.codec import Codec
from schemas.dead_letter import DeadLetter, schema_reason
from schemas.errors import (
    EventLogUnavailable,
    SchemaError,
    UndecodableEvent,
)
from schemas.events import TrajectoryReady
from schemas.ids import TRAJ_SUBJECT_PREFIX
from schemas.shards import table_to_trajectories
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
    """One trajectory and what acknowledges it (``handle``: the TRAJ message, live only)."""

    trajectory: TrajectoryReady
    seq: int | None = None  # TRAJ sequence, where known
    handle: Msg | None = None


class Source(Protocol):
    """What the sink reads from."""

    @property
    def max_unacked(self) -> int | None:
        """How many received items may wait unacknowledged before delivery stops (the live
        feed's flow control); None: no such limit."""
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


class LiveSource:
    """The TRAJ feed, from a durable pull consumer shared by nobody but this training job."""

    def __init__(
        self,
        js: JetStreamContext,
        publisher: Publisher,
        settings: LiveSourceSettings | None = None,
        *,
        stream: str = "TRAJ",
        run: str | None = None,
        codec: Codec | None = None,
    ) -> None:
        self._js = js
        self._publisher = publisher
        self.settings = settings or LiveSourceSettings()
        self.stream = stream
        self.run = run
        self._codec = codec or Codec()
        self._sizer = FetchSizer(self.settings.fetch_max_bytes)
        self._sub: JetStreamContext.PullSubscription | None = None
        self._outstanding: dict[int, Msg] = {}  # delivered, not yet acked, by TRAJ sequence
        self._keeper: asyncio.Task[None] | None = None
        self._owned: tuple[NATS, JetStreamPublisher] | None = None
        self.stats = LiveStats()

    @property
    def max_unacked(self) -> int | None:
        return self.settings.max_ack_pending

    def consumer(self) -> PullConsumer:
        s = self.settings
        subject = f"{TRAJ_SUBJECT_PREFIX}.{self.run}" if self.run else f"{TRAJ_SUBJECT_PREFIX}.>"
        return PullConsumer(
            stream=self.stream,
            durable=s.durable,
            filter_subjects=[subject],
            max_ack_pending=s.max_ack_pending,
            ack_wait_s=s.ack_wait_s,
        )

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
        )
        source._owned = (nc, publisher)
        return await source.start()

    async def start(self) -> LiveSource:
        self._sub = await self.consumer().bind(self._js)
        self._keeper = asyncio.create_task(self._keep_alive(), name="sink-in-progress")
        return self

    async def receive(self, max_items: int, wait_s: float) -> list[Received] | None:
        if self._sub is None:
            await self.start()
        assert self._sub is not None
        batch = self._sizer.batch(min(max_items, self.settings.fetch_batch))
        msgs = await fetch(self._sub, batch, wait_s)
        self._sizer.observe(msgs)
        received = []
        for msg in msgs:
            seq = stream_seq(msg)
            try:
                event = self._codec.decode(msg.data)
                if not isinstance(event, TrajectoryReady):
                    raise UndecodableEvent(
                        f"{msg.subject} carries a {type(event).__name__}; TRAJ holds "
                        f"TrajectoryReady"
                    )
            except SchemaError as exc:
                await self._dead_letter(msg, seq, exc)
                continue
            self._outstanding[seq] = msg
            received.append(Received(event, seq, msg))
        self.stats.received += len(received)
        return received

    async def ack(self, items: Sequence[Received]) -> None:
        """Acknowledge with confirmation: a commit returns once JetStream has the acks."""
        for done, item in enumerate(items):
            if item.handle is None:
                continue
            try:
                await item.handle.ack_sync(timeout=self.settings.ack_timeout_s)
            except (TimeoutError, nats.errors.Error, OSError) as exc:
                # No longer kept alive: what JetStream did not get is delivered again after
                # ack_wait_s (the sink drops repeated ids); acking again meanwhile is harmless.
                for left in items[done:]:
                    if left.seq is not None:
                        self._outstanding.pop(left.seq, None)
                raise EventLogUnavailable(
                    f"ack of {item.trajectory.trajectory_id} (TRAJ seq {item.seq}) and "
                    f"{len(items) - done - 1} after it was not confirmed: {exc}; commit again "
                    f"or release the batch; unconfirmed, it is delivered again after "
                    f"ack_wait_s={self.settings.ack_wait_s:g}"
                ) from exc
            if item.seq is not None:
                self._outstanding.pop(item.seq, None)
            self.stats.acked += 1

    async def nak(self, items: Sequence[Received]) -> None:
        for item in items:
            if item.seq is not None:
                self._outstanding.pop(item.seq, None)
            if item.handle is not None:
                with contextlib.suppress(nats.errors.Error, OSError):  # else after ack_wait
                    await item.handle.nak()

    async def close(self) -> None:
        if self._keeper is not None:
            self._keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keeper
        if self._sub is not None:
            await release(self._sub)
            self._sub = None
        if self._owned is not None:
            nc, publisher = self._owned
            self._owned = None
            await publisher.close()
            with contextlib.suppress(nats.errors.Error, OSError):
                await nc.close()

    async def _keep_alive(self) -> None:
        # A trajectory waits in a GRPO group or in the trainer's hands for minutes; tell
        # JetStream it is being worked on so it is not redelivered meanwhile.
        interval = self.settings.ack_wait_s / 3
        while True:
            await asyncio.sleep(interval)
            for msg in list(self._outstanding.values()):
                with contextlib.suppress(nats.errors.Error, OSError):
                    await msg.in_progress()

    async def _dead_letter(self, msg: Msg, seq: int, error: SchemaError) -> None:
        letter = DeadLetter(
            source="sink",
            reason=schema_reason(error) or "undecodable",
            error=f"{type(error).__name__}: {error}",
            stream=self.stream,
            subject=msg.subject,
            seq=seq,
            deliveries=int(msg.metadata.num_delivered),
            payload=bytes(msg.data),
        )
        try:
            await publish_dead_letter(self._publisher, letter, self._codec.max_payload)
        except EventLogUnavailable as exc:
            log.warning("TRAJ seq %d: cannot dead-letter it yet: %s", seq, exc)
            return  # not acked: it comes again after ack_wait
        self.stats.dead_lettered += 1
        with contextlib.suppress(nats.errors.Error, OSError):
            await msg.ack()


# -- offline --------------------------------------------------------------------------------


class _ReadOnly:
    """A finite source that changes nothing it reads: nothing to acknowledge or hand back."""

    max_unacked: int | None = None

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
        js: JetStreamContext,
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
        sub = await self._js.subscribe(
            f"{TRAJ_SUBJECT_PREFIX}.>",
            stream=self.stream,
            ordered_consumer=True,
            config=js_api.ConsumerConfig(
                deliver_policy=js_api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=self.first
            ),
        )
        try:
            while True:
                try:
                    msg = await sub.next_msg(timeout=5.0)
                except (TimeoutError, nats.errors.TimeoutError):
                    return  # the range ends past the stream's last message
                seq = stream_seq(msg)
                if seq > self.last:
                    return
                event = self._codec.decode(msg.data)
                if isinstance(event, TrajectoryReady):
                    yield Received(event, seq)
                if seq == self.last or msg.metadata.num_pending == 0:
                    return
        finally:
            with contextlib.suppress(nats.errors.Error, OSError):
                await sub.unsubscribe()

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
