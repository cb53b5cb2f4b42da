"""The reaper: a session nobody closed is closed as ``timeout`` once idle: folded, not lost.

Two loops per process:

- **track**: a handler of the one pull loop (``eventlog.loop.PullLoop``) on a durable consumer
  (``reaper``, headers only: the payloads are not needed) on every session event. Each
  event's server timestamp, turn index (from its Msg-Id) and sequence are merged into the
  session's entry in the ``ts_sessions`` bucket with a compare-and-set, so any number of
  reapers can track at once and a restart loses nothing (the entry is the state; the events
  are acked only after their entries are written).
- **scan**: every ``scan_interval_s``, read the bucket; for each open session idle longer than
  ``idle_timeout_s``, confirm with the stream and publish ``SessionClosed(status="timeout",
  num_turns=<turns in the stream>)``. The close's Msg-Id is deterministic, so reapers scanning at
  the same time store it once.

The entries can lag the stream: a reaper killed mid-batch holds events until ``ack_wait_s``, and
reapers back from an outage work through a backlog of old timestamps. So an entry only nominates
a session; the stream decides. The session's newest event (a last-by-subject get) must itself be
idle and not a close, and the turn count comes from its newest turn. Closing on the entry alone
would fold a session without the turns the reaper had not tracked yet.

An event that arrives after its session's close is *late*: it is not folded; the reaper counts
it and dead-letters a pointer to it (reason ``late_event``) so it stays visible.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import msgspec

from consumers.config import ReaperSettings
from eventlog import JetStream, Publisher, StreamNames
from eventlog.buckets import Bucket
from eventlog.connection import reconnects
from eventlog.loop import ACK, Delivery, Outcome, PullLoop, Reject
from eventlog.metrics import ConsumerMetrics, LoopMetrics
from eventlog.pull import ConsumerSpec
from eventlog.streams import newest_message
from schemas.errors import EventLogUnavailable
from schemas.events import SessionClosed
from schemas.ids import EVENT_SUBJECT_PREFIX, event_subject, session_subjects

__all__ = [
    "Observation",
    "Reaper",
    "ReaperStats",
    "SessionActivity",
    "forgettable",
    "idle_sessions",
    "observe",
]

log = logging.getLogger(__name__)

_CACHE_SIZE = 65_536
SOURCE = "reaper"


class SessionActivity(msgspec.Struct, frozen=True):
    """A session's entry in the ``ts_sessions`` bucket (key ``<run>.<session>``)."""

    last_at: float  # newest event, server time, epoch seconds
    turns: int = 0  # highest turn index seen + 1
    close_seq: int = 0  # EVENTS sequence of the close; 0 while open
    late: int = 0  # events seen after the close


class Observation(msgspec.Struct, frozen=True):
    """One event as the reaper sees it (headers only)."""

    seq: int
    kind: str  # open / turn / reward / close
    at: float
    turn: int | None = None


def observe(activity: SessionActivity | None, obs: Observation) -> tuple[SessionActivity, bool]:
    """Merge one event into a session's activity; also says whether the event is late.

    Commutative for everything but lateness: reapers may see events in any order, and an
    event is only known late when the close was recorded first.
    """
    current = activity or SessionActivity(last_at=obs.at)
    late = bool(current.close_seq) and obs.seq > current.close_seq and obs.kind != "close"
    turns = current.turns if obs.turn is None else max(current.turns, obs.turn + 1)
    close_seq = current.close_seq
    if obs.kind == "close":
        close_seq = min(close_seq, obs.seq) if close_seq else obs.seq
    return (
        SessionActivity(
            last_at=max(current.last_at, obs.at),
            turns=turns,
            close_seq=close_seq,
            late=current.late + late,
        ),
        late,
    )


def idle_sessions(
    entries: Iterable[tuple[str, SessionActivity]],
    now: float,
    idle_timeout_s: float,
    log_back_at: float = 0.0,
) -> list[tuple[str, SessionActivity]]:
    """The open sessions with no event for longer than ``idle_timeout_s``, counting only since
    ``log_back_at``: while the log was down (or this reaper was) no agent could add an event.

    >>> a = SessionActivity(last_at=100.0)
    >>> [k for k, _ in idle_sessions([("r.s", a)], now=200.0, idle_timeout_s=60.0)]
    ['r.s']
    >>> idle_sessions([("r.s", a)], now=200.0, idle_timeout_s=60.0, log_back_at=150.0)
    []
    """
    return [
        (key, a)
        for key, a in entries
        if not a.close_seq and now - max(a.last_at, log_back_at) > idle_timeout_s
    ]


def forgettable(
    entries: Iterable[tuple[str, SessionActivity]], now: float, after_s: float
) -> list[str]:
    """Closed sessions quiet for longer than ``after_s``: their entries can go, so a scan reads
    the open sessions and the recently closed ones, not every session ever seen."""
    return [key for key, a in entries if a.close_seq and now - a.last_at > after_s]


def _turn_index(msg_id: str | None) -> int | None:
    """A turn event's index, from its Msg-Id (``<run>.<session>.turn.<index>``)."""
    tail = (msg_id or "").rsplit(".", 1)[-1]
    return int(tail) if tail.isdigit() else None


def _observation(delivery: Delivery) -> tuple[str, Observation] | None:
    parts = delivery.subject.split(".")
    if len(parts) != 5 or ".".join(parts[:2]) != EVENT_SUBJECT_PREFIX:
        return None
    _, _, run, session, kind = parts
    turn = _turn_index(delivery.msg_id) if kind == "turn" else None
    return f"{run}.{session}", Observation(delivery.seq, kind, delivery.stored_at, turn)


@dataclass
class ReaperStats:
    events_tracked: int = 0
    sessions_reaped: int = 0
    late_events: int = 0
    conflicts: int = 0  # compare-and-set retries: another reaper wrote the same entry
    forgotten: int = 0  # entries of sessions closed long ago, deleted
    not_idle_yet: int = 0  # idle by their entry, but the stream holds newer events (or a close)
    closed_before: int = 0  # idle, open by their entry, but closed in the stream (entry forgotten)


_decoder = msgspec.json.Decoder(SessionActivity)


class Reaper:
    """Call ``run(stop)``; it returns once ``stop`` is set."""

    def __init__(
        self,
        js: JetStream,
        publisher: Publisher,
        settings: ReaperSettings | None = None,
        names: StreamNames | None = None,
        *,
        max_payload: int = 8 * 1024 * 1024,
        metrics: ConsumerMetrics | None = None,
    ) -> None:
        self._js = js
        self._publisher = publisher
        self.settings = settings or ReaperSettings()
        self.names = names or StreamNames()
        self.stats = ReaperStats()
        self._kv: Bucket | None = None
        # Idle time counts from the later of a session's last event and the moment this reaper
        # last saw the log come back (its start, or a reconnect): a nats-server outage stalls
        # every agent, and reaping them the moment it ends would close active sessions.
        self._log_back_at = time.time()
        self._reconnects = 0
        # key -> (revision, activity) of our last write: saves a read per update
        self._known: OrderedDict[str, tuple[int, SessionActivity]] = OrderedDict()
        s = self.settings
        spec = ConsumerSpec(
            stream=self.names.events,
            durable=s.durable,
            filter_subjects=(f"{EVENT_SUBJECT_PREFIX}.>",),
            max_ack_pending=s.max_ack_pending,
            ack_wait_s=s.ack_wait_s,
            batch=s.batch,
            max_deliver=-1,  # tracking is retried until the bucket takes it
            headers_only=True,
        )
        self.loop = PullLoop(
            js,
            spec,
            self,
            publisher=publisher,
            source=SOURCE,
            max_payload=max_payload,
            metrics=metrics.loop(SOURCE) if metrics else LoopMetrics.disabled(),
        )

    async def attach(self) -> None:
        """Open the bucket and bind the durable consumer (``run`` does it first); a caller
        may then drive the tracking itself with ``loop.step``."""
        self._kv = await Bucket.open(self._js, self.names.sessions_bucket)
        await self.loop.bind()

    async def run(self, stop: asyncio.Event) -> None:
        await self.attach()
        scanner = asyncio.create_task(self._scan_loop(stop), name="reaper-scan")
        try:
            await self.loop.run(stop)
        finally:
            scanner.cancel()
            await asyncio.gather(scanner, return_exceptions=True)

    # -- tracking ---------------------------------------------------------------------------

    async def handle_batch(self, deliveries: Sequence[Delivery]) -> Sequence[Outcome]:
        """Merge a fetch's events into their sessions' entries (one write per session); the
        loop acks them after. A lost ack redelivers an event; merging it again changes nothing
        but lateness."""
        by_key: dict[str, list[tuple[Observation, Delivery | None]]] = {}
        for delivery in deliveries:
            seen = _observation(delivery)
            if seen is not None:
                by_key.setdefault(seen[0], []).append((seen[1], delivery))
        await asyncio.gather(*(self._merge(key, seen) for key, seen in by_key.items()))
        self.stats.events_tracked += len(deliveries)
        return [ACK] * len(deliveries)

    async def _merge(self, key: str, seen: list[tuple[Observation, Delivery | None]]) -> None:
        assert self._kv is not None
        seen.sort(key=lambda pair: pair[0].seq)
        for _ in range(32):
            revision, current = self._known.get(key) or await self._read(key)
            activity, late = current, []
            for obs, delivery in seen:
                activity, is_late = observe(activity, obs)
                if is_late and delivery is not None:
                    late.append(delivery)
            assert activity is not None
            try:
                new_revision = await self._kv.swap(key, msgspec.json.encode(activity), revision)
            except EventLogUnavailable:
                self._known.pop(key, None)
                raise
            if new_revision is None:  # another reaper wrote it first: read and merge again
                self.stats.conflicts += 1
                self._known.pop(key, None)
                continue
            self._remember(key, new_revision, activity)
            for delivery in late:
                await self._report_late(key, delivery, activity)
            return
        raise EventLogUnavailable(f"session {key}: 32 write conflicts in a row in the bucket")

    async def _read(self, key: str) -> tuple[int, SessionActivity | None]:
        assert self._kv is not None
        entry = await self._kv.get(key)
        if entry is None:
            return 0, None
        return entry.revision, _decoder.decode(entry.value)

    def _remember(self, key: str, revision: int, activity: SessionActivity) -> None:
        self._known[key] = (revision, activity)
        self._known.move_to_end(key)
        while len(self._known) > _CACHE_SIZE:
            self._known.popitem(last=False)

    async def _report_late(self, key: str, delivery: Delivery, activity: SessionActivity) -> None:
        self.stats.late_events += 1
        run, session = key.split(".", 1)
        error = (
            f"run={run} session={session}: event after the session's close (EVENTS seq "
            f"{activity.close_seq}); it is not folded. The event is still in EVENTS at seq "
            f"{delivery.seq}"
        )
        await self.loop.dead_letter(delivery, Reject("late_event", error))

    # -- scanning ---------------------------------------------------------------------------

    async def _scan_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.scan()
            except EventLogUnavailable as exc:
                log.warning("reaper scan: %s", exc)
            except Exception:
                log.exception("reaper scan failed; trying again next interval")
            try:
                async with asyncio.timeout(self.settings.scan_interval_s):
                    await stop.wait()
            except TimeoutError:
                pass

    async def scan(self, now: float | None = None) -> int:
        """Close every idle open session; returns how many closes were published. Also deletes
        the entries of sessions closed long ago (``forget_closed_after_s``)."""
        now = time.time() if now is None else now
        if (count := reconnects(self._js)) != self._reconnects:
            self._reconnects, self._log_back_at = count, time.time()
        revisions = await self._entries()
        entries = [(key, activity) for key, activity, _ in revisions]
        await self._forget(
            forgettable(entries, now, self.settings.forget_closed_after_s), revisions
        )
        reaped = 0
        idle = idle_sessions(entries, now, self.settings.idle_timeout_s, self._log_back_at)
        for key, activity in idle:
            run, session = key.split(".", 1)
            turns = await self._confirm_idle(run, session, activity, now)
            if turns is None:
                continue
            close = SessionClosed(
                run=run, session=session, status="timeout", num_turns=turns, created_at=now
            )
            receipt = await self._publisher.publish(close)
            if receipt.duplicate:  # another reaper was first
                continue
            reaped += 1
            log.info(
                "reaped run=%s session=%s: idle %.0fs, %d turn(s)",
                run,
                session,
                now - activity.last_at,
                activity.turns,
            )
        self.stats.sessions_reaped += reaped
        return reaped

    async def _confirm_idle(
        self, run: str, session: str, activity: SessionActivity, now: float
    ) -> int | None:
        """The session's turn count if the stream agrees it is idle and open; None if its
        newest event is recent or a close (its entry has not caught up yet)."""
        newest = await self._newest(session_subjects(run, session))
        if newest is None:  # its events are gone from the stream: close on what was tracked
            return activity.turns
        since = max(newest.at, self._log_back_at)
        if newest.kind == "close" or now - since <= self.settings.idle_timeout_s:
            self.stats.not_idle_yet += 1
            return None
        # An event after a close whose entry was forgotten started a fresh entry: the session
        # is closed already. Record the close in the entry (it is forgotten again later).
        closed = await self._newest(event_subject(run, session, "close"))
        if closed is not None:
            self.stats.closed_before += 1
            await self._merge(f"{run}.{session}", [(closed, None)])
            return None
        if newest.kind != "turn":
            newest = await self._newest(event_subject(run, session, "turn"))
        turn = None if newest is None else newest.turn
        return max(activity.turns, 0 if turn is None else turn + 1)

    async def _newest(self, subject: str) -> Observation | None:
        """The newest event on ``subject`` (wildcards allowed), as the tracker would see it."""
        newest = await newest_message(self._js, self.names.events, subject)
        if newest is None:
            return None
        kind = newest.subject.rsplit(".", 1)[-1]
        turn = _turn_index(newest.msg_id) if kind == "turn" else None
        return Observation(newest.seq, kind, newest.stored_at, turn)

    async def _forget(
        self, keys: list[str], revisions: list[tuple[str, SessionActivity, int]]
    ) -> None:
        assert self._kv is not None
        revision_of = {key: revision for key, _, revision in revisions}
        for key in keys:
            self._known.pop(key, None)
            # Compare-and-delete: an event merged meanwhile (or another reaper forgetting the
            # same entry) keeps or removes it; either way not this scan's business.
            if await self._kv.delete(key, revision_of[key]):
                self.stats.forgotten += 1

    async def _entries(self) -> list[tuple[str, SessionActivity, int]]:
        assert self._kv is not None
        return [
            (entry.key, _decoder.decode(entry.value), entry.revision)
            for entry in await self._kv.entries()
        ]
