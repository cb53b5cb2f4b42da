"""The shard writer: TRAJ in, Parquet shards out, every trajectory in exactly one shard.

A thin loop: fetch -> decode -> buffer per run -> rotate (rows, bytes, age) -> commit the
shard -> ack its messages. A message is acked only after the shard holding it is committed
(or after its dead letter is stored), so a kill at any point loses nothing: what was not acked
comes again.

**Exactly once.** What comes again must not be written twice. The writer keeps the set of TRAJ
sequences already committed (``SeqSet``: merged intervals) and acks-and-skips a delivery whose
sequence is in it, or replaces the buffered copy of one it holds. On start the set is rebuilt
from the committed shards: every sequence at or below the consumer's *ack floor* is done (acked
means committed or dead-lettered) and is never delivered again, so only shards reaching above
the floor are opened, and of those only the footer and the ``traj_seq`` column are read.

Why exact sequences and not a ``[first, last]`` watermark per shard: after a restart,
JetStream redelivers the killed writer's unacked messages only when their ack wait expires,
interleaved with new ones, so a run's buffer can hold seqs 6, 7, 8 and 11..15 while 9 and 10
are still waiting for redelivery. A shard claiming ``6..15`` would make the writer skip 9 and
10 when they come: lost. The range is still in every shard's name and footer, to prune.

**A row that cannot be written** (it decodes, but a value does not fit its column: a scalar
outside int32, a ``created_at`` beyond the timestamp range) is dead-lettered and acked like an
undecodable message, and the rest of its buffer is written: with ``max_deliver=-1`` a row
raised on would stop every writer that gets it, for good. A buffer is converted in one go; only
when that fails is each row tried alone to find the culprits (``writable_table``).

A shard's footer also names its TRAJ stream and that stream's creation time: sequences of a
stream deleted and made again restart at 1, and shards of the old one are not taken for it.

**One shard writer per TRAJ stream and target.** The committed set lives in this process; a
second writer on the same durable consumer would not know the first one's shards, and a
redelivery could then be written twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import nats.errors
import pyarrow as pa
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js import errors as js_errors

from consumers.config import ShardWriterSettings
from consumers.seqset import SeqSet
from eventlog import Publisher
from eventlog.dead_letters import dead_letter_for, publish_dead_letter
from eventlog.dispositions import reason_of
from eventlog.errors import ShardWriteFailed
from eventlog.pull import FetchSizer, PullConsumer, fetch, release, stream_seq
from eventlog.shard_store import CommittedShard, ShardStore
from schemas.codec import Codec
from schemas.errors import EventLogUnavailable, SchemaError, UndecodableEvent
from schemas.events import TrajectoryReady
from schemas.ids import TRAJ_SUBJECT_PREFIX
from schemas.shards import ROW_ERRORS, ShardMetadata, ShardRow, shard_row, writable_table

__all__ = ["ShardWriter", "ShardWriterStats"]

log = logging.getLogger(__name__)

SOURCE = "shard-writer"  # the dead letters' source
WRITE_ATTEMPTS = 3  # a shard write is tried this often (1 s, 2 s apart) before the writer stops
_MIN_WAIT_S = 0.05


@dataclass
class ShardWriterStats:
    rows_written: int = 0
    shards_written: int = 0
    duplicates_skipped: int = 0  # deliveries of a sequence already committed or buffered
    dead_lettered: int = 0
    write_retries: int = 0


@dataclass
class _RunBuffer:
    opened_at: float
    rows: dict[int, tuple[ShardRow, Msg]] = field(default_factory=dict)  # by TRAJ sequence
    nbytes: int = 0


@dataclass(frozen=True)
class _Recovered:
    committed: SeqSet
    shards_read: int
    foreign: list[CommittedShard]  # shards of another TRAJ stream (made again since)
    partial_removed: list[str]


class ShardWriter:
    """Consumes TRAJ and commits Parquet shards through a ``ShardStore``."""

    def __init__(
        self,
        js: JetStreamContext,
        publisher: Publisher,
        store: ShardStore,
        settings: ShardWriterSettings | None = None,
        *,
        stream: str = "TRAJ",
        codec: Codec | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._js = js
        self._publisher = publisher
        self.store = store
        self.settings = settings or ShardWriterSettings()
        self.stream = stream
        self._codec = codec or Codec()
        self._clock = clock
        self.stats = ShardWriterStats()
        self._committed = SeqSet()
        self._buffers: dict[str, _RunBuffer] = {}
        self._buffered_run: dict[int, str] = {}  # TRAJ sequence -> run of its buffer
        self._buffered_bytes = 0  # over all runs
        self._stream_created = ""
        self._sizer = FetchSizer(self.settings.fetch_max_bytes)

    def consumer(self) -> PullConsumer:
        s = self.settings
        return PullConsumer(
            stream=self.stream,
            durable=s.durable,
            filter_subjects=[f"{TRAJ_SUBJECT_PREFIX}.>"],
            max_ack_pending=s.max_ack_pending,
            ack_wait_s=s.effective_ack_wait_s,
            max_deliver=-1,  # a trajectory is never given up on: it waits for a writable target
        )

    # -- the loop ---------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> ShardWriterStats:
        """Write shards until ``stop`` is set, then commit what is buffered and return.

        An error (the target unwritable after WRITE_ATTEMPTS tries, the log gone at start)
        ends it; the writer is then spent, and what it had not acked goes to the next one.
        """
        sub = await self.consumer().bind(self._js)
        try:
            await self.recover()
            while not stop.is_set():
                try:
                    batch = self._sizer.batch(self.settings.batch)
                    msgs = await fetch(sub, batch, self._fetch_wait_s())
                    self._sizer.observe(msgs)
                except EventLogUnavailable as exc:
                    log.warning("shard writer: %s; retrying", exc)
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(1.0):
                            await stop.wait()
                    continue
                for msg in msgs:
                    await self._take(msg)
                await self._rotate_aged()
            await self.flush()
        finally:
            await release(sub)
        return self.stats

    async def recover(self) -> None:
        """Rebuild the committed set from the shards; remove half-written ones."""
        try:
            consumer = await self._js.consumer_info(self.stream, self.settings.durable)
            stream = await self._js.stream_info(self.stream)
        except (TimeoutError, nats.errors.Error, js_errors.Error, OSError) as exc:
            raise EventLogUnavailable(
                f"shard writer: cannot read consumer {self.settings.durable} of {self.stream}: "
                f"{exc}"
            ) from exc
        ack_floor = int(consumer.ack_floor.stream_seq) if consumer.ack_floor else 0
        self._stream_created = stream.created.isoformat() if stream.created else ""
        found = await asyncio.to_thread(self._read_committed, ack_floor)
        self._committed = found.committed
        for path in found.partial_removed:
            log.info("removed half-written shard %s (left by a killed writer)", path)
        if found.foreign:
            log.warning(
                "%d shard(s) belong to an earlier %s stream (not created %s), e.g. %s; their "
                "sequences are not this stream's and are ignored",
                len(found.foreign),
                self.stream,
                self._stream_created,
                found.foreign[0].path,
            )
        log.info(
            "shard writer on %s: ack floor %d, %d shard(s) above it read, committed %s",
            self.stream,
            ack_floor,
            found.shards_read,
            _show(self._committed),
        )

    def _read_committed(self, ack_floor: int) -> _Recovered:
        removed = self.store.remove_partial()
        committed = SeqSet()
        # Everything up to the floor was acked: committed or dead-lettered, never redelivered.
        committed.add_range(1, ack_floor)
        read = 0
        foreign = []
        for shard in self.store.committed():
            if shard.last_seq <= ack_floor:
                continue
            meta = self.store.read_metadata(shard)
            if (meta.stream, meta.stream_created) != (self.stream, self._stream_created):
                foreign.append(shard)
                continue
            committed.add_many(self.store.read_seqs(shard))
            read += 1
        return _Recovered(committed, read, foreign, removed)

    def _fetch_wait_s(self) -> float:
        wait = self.settings.fetch_timeout_s
        if self._buffers:
            oldest = min(b.opened_at for b in self._buffers.values())
            due = oldest + self.settings.max_age_s - self._clock()
            wait = min(wait, due)
        return max(wait, _MIN_WAIT_S)

    # -- one message ------------------------------------------------------------------------

    async def _take(self, msg: Msg) -> None:
        seq = stream_seq(msg)
        if seq in self._committed:
            self.stats.duplicates_skipped += 1
            await _ack(msg)
            return
        run = self._buffered_run.get(seq)
        if run is not None:  # redelivered while buffered: ack the newest delivery later
            buffer = self._buffers[run]
            buffer.rows[seq] = (buffer.rows[seq][0], msg)
            self.stats.duplicates_skipped += 1
            return
        try:
            event = self._codec.decode(msg.data)
            if not isinstance(event, TrajectoryReady):
                raise UndecodableEvent(
                    f"{msg.subject} carries a {type(event).__name__}; TRAJ holds TrajectoryReady"
                )
            try:
                row = shard_row(seq, event)
            except ValueError as exc:
                raise UndecodableEvent(str(exc)) from exc
        except SchemaError as exc:
            await self._dead_letter(msg, seq, reason_of(exc), exc)
            return
        self._buffer(event.run, row, msg)
        buffer = self._buffers[event.run]
        s = self.settings
        if len(buffer.rows) >= s.max_rows or buffer.nbytes >= s.max_bytes:
            await self._write(event.run)
        # Over all runs too: bounds memory and keeps the unacked below max_ack_pending.
        while self._buffered_run and (
            len(self._buffered_run) >= s.max_rows or self._buffered_bytes >= s.max_bytes
        ):
            await self._write(min(self._buffers, key=lambda r: self._buffers[r].opened_at))

    def _buffer(self, run: str, row: ShardRow, msg: Msg) -> None:
        buffer = self._buffers.get(run)
        if buffer is None:
            buffer = self._buffers[run] = _RunBuffer(self._clock())
        buffer.rows[row.traj_seq] = (row, msg)
        buffer.nbytes += row.nbytes
        self._buffered_bytes += row.nbytes
        self._buffered_run[row.traj_seq] = run

    async def _dead_letter(
        self,
        msg: Msg,
        seq: int,
        reason: str,
        error: SchemaError | str,
        session: str | None = None,
    ) -> None:
        prefix = f"{TRAJ_SUBJECT_PREFIX}."
        run = msg.subject[len(prefix) :] if msg.subject.startswith(prefix) else None
        letter = dead_letter_for(
            msg, source=SOURCE, reason=reason, error=error, run=run, session=session
        )
        try:
            await publish_dead_letter(self._publisher, letter, self._codec.max_payload)
        except EventLogUnavailable as exc:
            # Not acked: it comes again after the ack wait, and is dead-lettered then.
            log.warning("%s seq %d: cannot dead-letter it yet: %s", self.stream, seq, exc)
            return
        self._committed.add(seq)
        self.stats.dead_lettered += 1
        await _ack(msg)

    # -- shards -----------------------------------------------------------------------------

    async def _rotate_aged(self) -> None:
        now = self._clock()
        max_age = self.settings.max_age_s
        for run in [r for r, b in self._buffers.items() if now - b.opened_at >= max_age]:
            await self._write(run)

    async def flush(self) -> None:
        """Commit every buffer now (on stop)."""
        for run in list(self._buffers):
            await self._write(run)

    async def _write(self, run: str) -> None:
        buffer = self._buffers.pop(run)
        self._buffered_bytes -= buffer.nbytes
        entries = [buffer.rows[seq] for seq in sorted(buffer.rows)]
        try:
            table, unwritable = await asyncio.to_thread(writable_table, [r for r, _ in entries])
        except (*ROW_ERRORS, pa.ArrowException) as exc:  # no one row at fault: the settings
            raise ShardWriteFailed(
                f"cannot build the shard of run {run}, {self.stream} seq "
                f"{entries[0][0].traj_seq}..{entries[-1][0].traj_seq}: {exc}"
            ) from exc
        if unwritable:
            await self._dead_letter_unwritable(entries, unwritable)
            entries = [(row, msg) for row, msg in entries if row.traj_seq not in unwritable]
        if table is None:
            return
        rows = [row for row, _ in entries]
        meta = ShardMetadata.of_rows(
            rows, run=run, stream=self.stream, stream_created=self._stream_created
        )
        # A failure ends run(): none of these rows was acked, so they all come again.
        shard = await self._commit(table, meta)
        seqs = [row.traj_seq for row in rows]
        self._committed.add_many(seqs)
        for seq in seqs:
            del self._buffered_run[seq]
        for _, msg in entries:
            await _ack(msg)
        self.stats.shards_written += 1
        self.stats.rows_written += len(rows)
        log.info(
            "shard %s: %d trajectories of run %s, %s seq %d..%d",
            self.store.display(shard.path),
            len(rows),
            run,
            self.stream,
            meta.first_seq,
            meta.last_seq,
        )

    async def _dead_letter_unwritable(
        self, entries: Sequence[tuple[ShardRow, Msg]], unwritable: dict[int, str]
    ) -> None:
        for row, msg in entries:
            why = unwritable.get(row.traj_seq)
            if why is None:
                continue
            # Out of the buffer whatever comes of the dead letter: if it cannot be published,
            # the message is not acked and comes again, to be dead-lettered then.
            del self._buffered_run[row.traj_seq]
            t = row.trajectory
            error = (
                f"trajectory {t.trajectory_id} ({self.stream} seq {row.traj_seq}) cannot be a "
                f"shard row: {why}"
            )
            log.warning("%s; dead-lettering it", error)
            await self._dead_letter(msg, row.traj_seq, "unwritable_row", error, t.session)

    async def _commit(self, table: pa.Table, meta: ShardMetadata) -> CommittedShard:
        for attempt in range(WRITE_ATTEMPTS):
            try:
                return await asyncio.to_thread(self.store.write, table, meta)
            except ShardWriteFailed as exc:
                if attempt + 1 == WRITE_ATTEMPTS:
                    raise
                self.stats.write_retries += 1
                log.warning("%s; trying again", exc)
                await asyncio.sleep(2.0**attempt)
        raise AssertionError("unreachable")


async def _ack(msg: Msg) -> None:
    # A lost ack only means a redelivery, which the committed set then skips.
    with contextlib.suppress(nats.errors.Error, OSError):
        await msg.ack()


def _show(seqs: SeqSet) -> str:
    intervals = seqs.intervals
    shown = ", ".join(f"{lo}..{hi}" if hi > lo else str(lo) for lo, hi in intervals[:5])
    return shown + (f", … ({len(intervals)} intervals)" if len(intervals) > 5 else "") or "nothing"
