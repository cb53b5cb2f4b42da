"""The shard writer: TRAJ in, Parquet shards out, every trajectory in exactly one shard.

A handler of the one pull loop (``eventlog.loop.PullLoop``): decode -> buffer per run (held,
kept alive by the loop) -> rotate (rows, bytes, age; after each fetch) -> commit the shard ->
ack its messages. A message is acked only after the shard holding it is committed (or after its
dead letter is stored), so a kill at any point loses nothing: what was not acked comes again.

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

**Encoding overlaps fetching.** A buffer that is due (full, or aged) is handed to a write task
of its run: the Arrow table and the zstd Parquet encode run in a thread while the loop goes on
fetching and decoding. One write at a time per run (its shards stay in sequence order); runs
write side by side. The buffers filling are capped by ``max_rows`` / ``max_bytes`` over all
runs as before, the rows being written by as much again (memory stays under twice the limits;
a new write waits for the run's previous one rather than cut small shards), and their messages
are acked only after the shard is renamed into place, as before. A write that fails for good
ends the writer at its next message or tick; stop waits for every write in flight, then writes
what is buffered. Decoding keeps the trajectory in its compact form
(``Codec.decode_compact_trajectory``): the token columns are built for the whole shard at once
(``schemas.shards``).

**One shard writer per TRAJ stream and target.** The committed set lives in this process; a
second writer on the same durable consumer would not know the first one's shards, and a
redelivery could then be written twice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pyarrow as pa

from consumers.config import ShardWriterSettings
from eventlog import JetStream, Publisher
from eventlog.loop import ACK, HOLD, Delivery, Outcome, PullLoop, Reject
from eventlog.metrics import ConsumerMetrics, LoopMetrics
from eventlog.pull import ConsumerSpec
from eventlog.seqset import SeqSet
from eventlog.streams import consumer_ack_floor, stream_facts
from schemas.codec import Codec
from schemas.errors import SchemaError, UndecodableEvent
from schemas.ids import TRAJ_SUBJECT_PREFIX
from schemas.shards import ROW_ERRORS, ShardMetadata, ShardRow, shard_row, writable_table
from shardstore import CommittedShard, ShardStore, ShardWriteFailed

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
    write_retries: int = 0


@dataclass(eq=False)
class _RunBuffer:
    run: str
    opened_at: float
    rows: dict[int, tuple[ShardRow, Delivery]] = field(default_factory=dict)  # by TRAJ sequence
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
        js: JetStream,
        publisher: Publisher,
        store: ShardStore,
        settings: ShardWriterSettings | None = None,
        *,
        stream: str = "TRAJ",
        codec: Codec | None = None,
        clock: Callable[[], float] = time.monotonic,
        metrics: ConsumerMetrics | None = None,
    ) -> None:
        self._js = js
        self.store = store
        self.settings = settings or ShardWriterSettings()
        self.stream = stream
        self._codec = codec or Codec()
        self._clock = clock
        self.stats = ShardWriterStats()
        self._committed = SeqSet()
        self._buffers: dict[str, _RunBuffer] = {}  # filling, by run
        self._writing: dict[str, asyncio.Task[None]] = {}  # a write in flight, by run
        self._failed: BaseException | None = None  # a write that failed for good
        self._by_seq: dict[int, _RunBuffer] = {}  # TRAJ sequence -> its buffer, until committed
        self._buffered_bytes = 0  # over all runs, buffers being written included
        self._writing_rows = self._writing_bytes = 0  # of the buffers being written
        self._stream_created = ""
        self._metrics = metrics.loop(SOURCE) if metrics else LoopMetrics.disabled()
        s = self.settings
        spec = ConsumerSpec(
            stream=stream,
            durable=s.durable,
            filter_subjects=(f"{TRAJ_SUBJECT_PREFIX}.>",),
            max_ack_pending=s.max_ack_pending,
            ack_wait_s=s.effective_ack_wait_s,
            batch=s.batch,
            max_deliver=-1,  # a trajectory is never given up on: it waits for a writable target
            fetch_timeout_s=s.fetch_timeout_s,
            fetch_max_bytes=s.fetch_max_bytes,
        )
        self.loop = PullLoop(
            js,
            spec,
            self,
            publisher=publisher,
            source=SOURCE,
            max_payload=self._codec.max_payload,
            metrics=self._metrics,
        )

    # -- the loop ---------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> ShardWriterStats:
        """Write shards until ``stop`` is set, then commit what is buffered and return.

        An error (the target unwritable after WRITE_ATTEMPTS tries, the log gone at start)
        ends it; the writer is then spent, and what it had not acked goes to the next one.
        """
        await self.loop.bind()
        try:
            await self.recover()
            # A failed write (ShardWriteFailed, fatal) ends the loop, never blamed on a message.
            await self.loop.run(stop, tick=self._rotate_aged, wait_s=self._fetch_wait_s)
            await self.flush()
        finally:
            # Writes in flight finish (and ack what they committed) before the loop is closed.
            if self._writing:
                await asyncio.gather(*self._writing.values(), return_exceptions=True)
            await self.loop.close()
        return self.stats

    async def recover(self) -> None:
        """Rebuild the committed set from the shards; remove half-written ones."""
        ack_floor = await consumer_ack_floor(self._js, self.stream, self.settings.durable)
        self._stream_created = (await stream_facts(self._js, self.stream)).created
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

    async def handle(self, delivery: Delivery) -> Outcome:
        self._raise_failed()
        seq = delivery.seq
        if seq in self._committed:
            self.stats.duplicates_skipped += 1
            return ACK
        held = self._by_seq.get(seq)
        if held is not None:  # redelivered while buffered or written: ack the newest later
            held.rows[seq] = (held.rows[seq][0], delivery)
            self.stats.duplicates_skipped += 1
            return HOLD
        try:
            event = self._codec.decode_compact_trajectory(delivery.data, delivery.subject)
            try:
                row = shard_row(seq, event)
            except ValueError as exc:
                raise UndecodableEvent(str(exc)) from exc
        except SchemaError as exc:
            return Reject(exc.reason, f"{type(exc).__name__}: {exc}")
        buffer = self._buffer(event.run, row, delivery)
        s = self.settings
        if len(buffer.rows) >= s.max_rows or buffer.nbytes >= s.max_bytes:
            await self._start_write(event.run)
        # Over all runs too: the buffers filling are capped by the same limits (the oldest is
        # cut), the rows being written besides them by as much again: memory stays under twice
        # the limits, and unacked rows past max_ack_pending only pause deliveries until a write
        # commits.
        while self._buffers and (
            len(self._by_seq) - self._writing_rows >= s.max_rows
            or self._buffered_bytes - self._writing_bytes >= s.max_bytes
        ):
            idle = [r for r in self._buffers if r not in self._writing]
            if idle:
                await self._start_write(min(idle, key=self._opened_at))
            else:  # every run that fills is being written: wait rather than cut small shards
                await self._wait(next(iter(self._writing.values())))
        while self._writing and (
            len(self._by_seq) >= 2 * s.max_rows or self._buffered_bytes >= 2 * s.max_bytes
        ):
            await self._wait(next(iter(self._writing.values())))
        return HOLD

    def _opened_at(self, run: str) -> float:
        return self._buffers[run].opened_at

    def _buffer(self, run: str, row: ShardRow, delivery: Delivery) -> _RunBuffer:
        buffer = self._buffers.get(run)
        if buffer is None:
            buffer = self._buffers[run] = _RunBuffer(run, self._clock())
        buffer.rows[row.traj_seq] = (row, delivery)
        buffer.nbytes += row.nbytes
        self._buffered_bytes += row.nbytes
        self._by_seq[row.traj_seq] = buffer
        return buffer

    # -- shards -----------------------------------------------------------------------------

    async def _rotate_aged(self) -> None:
        self._raise_failed()
        now = self._clock()
        max_age = self.settings.max_age_s
        for run in [r for r, b in self._buffers.items() if now - b.opened_at >= max_age]:
            await self._start_write(run)

    async def flush(self) -> None:
        """Commit every buffer now (on stop): the writes in flight, then the rest."""
        while self._writing:
            await self._wait(next(iter(self._writing.values())))
        for run in list(self._buffers):
            await self._start_write(run)
            task = self._writing.get(run)
            if task is not None:
                await self._wait(task)

    def _raise_failed(self) -> None:
        if self._failed is not None:
            raise self._failed

    async def _wait(self, task: asyncio.Task[None]) -> None:
        """Wait for a write task; its failure (ShardWriteFailed: fatal) ends the writer."""
        await asyncio.wait({task})
        if not task.cancelled() and task.exception() is not None and self._failed is None:
            self._failed = task.exception()
        self._raise_failed()

    async def _start_write(self, run: str) -> None:
        """Hand ``run``'s buffer to a write task, after the run's write in flight, if any."""
        previous = self._writing.get(run)
        if previous is not None:
            await self._wait(previous)
        buffer = self._buffers.pop(run, None)
        if buffer is None:  # written meanwhile
            return
        self._writing_rows += len(buffer.rows)
        self._writing_bytes += buffer.nbytes
        task = asyncio.create_task(self._write(buffer), name=f"shard-write-{run}")
        self._writing[run] = task
        task.add_done_callback(self._write_done)

    def _write_done(self, task: asyncio.Task[None]) -> None:
        for run, running in list(self._writing.items()):
            if running is task:
                del self._writing[run]
        if not task.cancelled() and task.exception() is not None and self._failed is None:
            self._failed = task.exception()

    async def _write(self, buffer: _RunBuffer) -> None:
        try:
            await self._write_shard(buffer)
        finally:
            self._buffered_bytes -= buffer.nbytes
            self._writing_rows -= len(buffer.rows)
            self._writing_bytes -= buffer.nbytes
            for seq in buffer.rows:  # committed or dead-lettered, or left to come again
                if self._by_seq.get(seq) is buffer:
                    del self._by_seq[seq]

    async def _write_shard(self, buffer: _RunBuffer) -> None:
        run = buffer.run
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
            entries = [(row, d) for row, d in entries if row.traj_seq not in unwritable]
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
        # The newest delivery of each row: one redelivered while the shard was written, too.
        await self.loop.ack(buffer.rows[seq][1] for seq in seqs)
        self._metrics.shard_committed(len(rows))
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
        self, entries: Sequence[tuple[ShardRow, Delivery]], unwritable: dict[int, str]
    ) -> None:
        for row, delivery in entries:
            why = unwritable.get(row.traj_seq)
            if why is None:
                continue
            # Out of the buffer whatever comes of the dead letter (``_write``): if it cannot be
            # published, the message is not acked and comes again, to be dead-lettered then.
            t = row.trajectory
            error = (
                f"trajectory {t.trajectory_id} ({self.stream} seq {row.traj_seq}) cannot be a "
                f"shard row: {why}"
            )
            log.warning("%s; dead-lettering it", error)
            await self.loop.reject(delivery, Reject("unwritable_row", error, session=t.session))

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


def _show(seqs: SeqSet) -> str:
    intervals = seqs.intervals
    shown = ", ".join(f"{lo}..{hi}" if hi > lo else str(lo) for lo, hi in intervals[:5])
    return shown + (f", … ({len(intervals)} intervals)" if len(intervals) > 5 else "") or "nothing"
