"""The fold worker: each SessionClosed in, that session's trajectories out to TRAJ (DESIGN §1, §5).

A thin loop around pure decisions::

    fetch close -> already folded? -> read the session back -> fold -> publish trajectories
                -> mark folded -> ack the close

Every process runs this loop on one shared durable pull consumer (``fold``) filtered on
``ts.ev.*.*.close``, so JetStream spreads the closes over the processes and gives a dead
process's unacked closes to the others. Exactly-once into TRAJ comes from four layers:

- the close is acked only after JetStream acknowledged every TrajectoryReady;
- each TrajectoryReady carries ``Nats-Msg-Id`` = trajectory id, so a fold repeated inside the
  duplicate window is absorbed by the stream;
- a marker in the ``ts_folded`` bucket, written before the ack, makes a close redelivered after
  the window (a worker stalled for minutes) a no-op;
- a close redelivered without a marker and old enough that an earlier delivery's trajectories may
  be past the window (the worker or nats-server died between the TRAJ acks and the marker, and
  the close came back minutes later) first looks in TRAJ for what that delivery stored
  (``republish_could_duplicate``, ``stored_msg_ids``) and publishes only the rest. Only such
  redeliveries pay for the look; a first delivery reads and writes nothing more.

What happens to a close whose handling failed is ``eventlog.dispositions.disposition``: bad input
is dead-lettered at once, anything else retried with backoff and dead-lettered on delivery
``max_deliver``. If the log refuses the dead letter then, the worker keeps the close (in progress)
and retries the letter (``when_dead_letter_fails``): a nak there could be the close's last.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import itertools
import logging
import time
from dataclasses import dataclass, field

import msgspec
import nats.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js import errors as js_errors
from nats.js.kv import KeyValue

from consumers.config import FoldWorkerSettings
from consumers.errors import FoldError
from consumers.fold import FoldOptions, FoldResult, fold
from eventlog import Publisher, StoredMessage, StreamNames, read_session_messages
from eventlog.dead_letters import dead_letter_for, publish_dead_letter
from eventlog.dispositions import (
    DeadLetterIt,
    Retry,
    consumer_max_deliver,
    disposition,
    reason_of,
    when_dead_letter_fails,
)
from eventlog.pull import PullConsumer, delivery_count, fetch, keep_alive, release
from eventlog.reader import stored_msg_ids
from schemas.codec import Codec
from schemas.dead_letter import DeadLetter
from schemas.errors import EventLogUnavailable, SchemaError
from schemas.events import SessionClosed, SessionEvent, SessionOpened, TrajectoryReady
from schemas.ids import EVENT_SUBJECT_PREFIX, traj_subject

__all__ = ["FoldMarker", "FoldWorker", "WorkerStats", "fold_options", "republish_could_duplicate"]

log = logging.getLogger(__name__)

CLOSE_FILTER = f"{EVENT_SUBJECT_PREFIX}.*.*.close"
SOURCE = "fold"
# How far before a close TRAJ is searched for an earlier delivery's trajectories: the close and
# the trajectories may be stamped by different servers' clocks (streams led by different nodes).
CLOCK_SKEW_S = 5.0


class FoldMarker(msgspec.Struct, frozen=True):
    """What the ``ts_folded`` bucket keeps per folded session (key ``<run>.<session>``)."""

    trajectories: int
    fold_version: int
    close_seq: int
    forks: int = 0
    late_events: int = 0
    folded_at: float = 0.0


@dataclass
class WorkerStats:
    sessions_folded: int = 0
    trajectories: int = 0
    already_folded: int = 0  # closes redelivered after their session was folded
    already_published: int = 0  # trajectories an earlier delivery stored past the dup window
    retried: int = 0
    dead_letters: dict[str, int] = field(default_factory=dict)  # by reason
    late_events: int = 0  # events the fold left out because they came after the close
    forks: int = 0


class _PoisonEvent(Exception):
    """An event of the session cannot be decoded: dead-letter that event, not only the close."""

    def __init__(self, stored: StoredMessage, error: SchemaError) -> None:
        super().__init__(str(error))
        self.stored = stored
        self.error = error


def fold_options(defaults: FoldWorkerSettings, opened: SessionOpened | None) -> FoldOptions:
    """The worker's fold options, overridden by the session's ``metadata["fold"]``.

    An agent (or whoever opens the session) may ask for step-wise samples of its own session:
    ``{"fold": {"per_turn": true}}``. A value of the wrong type is a FoldError.
    """
    override = opened.metadata.get("fold", {}) if opened is not None else {}
    where = f"run={opened.run} session={opened.session}" if opened is not None else ""
    if not isinstance(override, dict):
        raise FoldError(f"{where}: metadata.fold must be an object, got {override!r}")
    unknown = set(override) - {"per_turn", "final_reward_scope"}
    per_turn = override.get("per_turn", defaults.per_turn)
    scope = override.get("final_reward_scope", defaults.final_reward_scope)
    if unknown or not isinstance(per_turn, bool) or scope not in ("last", "all"):
        raise FoldError(
            f"{where}: metadata.fold={override!r} is not valid: it takes per_turn (true/false) "
            f"and final_reward_scope ('last' or 'all') only"
        )
    return FoldOptions(per_turn=per_turn, final_reward_scope=scope)


def republish_could_duplicate(*, delivery: int, close_age_s: float, window_s: float) -> bool:
    """Could an earlier delivery's trajectories be outside TRAJ's duplicate window by the time
    this delivery's republish is stored? Then TRAJ must be searched before publishing.

    An earlier delivery published after the close was stored, so a republish stored within one
    window of the close is absorbed by its Msg-Id. Half the window is kept for what lies between
    this check and the stored republish (rehydrating and folding the session, the publisher's
    retry horizon, ~10 s by default) and for skew between this host's clock and the server's:
    with the default 120 s window, redeliveries of closes older than 60 s are checked.

    >>> republish_could_duplicate(delivery=3, close_age_s=90.0, window_s=120.0)
    True
    >>> republish_could_duplicate(delivery=1, close_age_s=900.0, window_s=120.0)  # no earlier one
    False
    """
    return delivery > 1 and close_age_s >= window_s / 2


class FoldWorker:
    """One process's share of the fold: call ``run(stop)``; it returns after ``stop`` is set
    and the closes it had taken are finished."""

    def __init__(
        self,
        js: JetStreamContext,
        publisher: Publisher,
        settings: FoldWorkerSettings | None = None,
        names: StreamNames | None = None,
        *,
        codec: Codec | None = None,
        max_payload: int = 8 * 1024 * 1024,
    ) -> None:
        self._js = js
        self._publisher = publisher
        self.settings = settings or FoldWorkerSettings()
        self.names = names or StreamNames()
        self._codec = codec or Codec(max_payload=max_payload)
        self._max_payload = max_payload
        self.stats = WorkerStats()
        self._markers: KeyValue | None = None
        self._traj_window_s: float | None = None
        self._stop = asyncio.Event()

    def consumer(self) -> PullConsumer:
        s = self.settings
        return PullConsumer(
            stream=self.names.events,
            durable=s.durable,
            filter_subjects=[CLOSE_FILTER],
            max_ack_pending=s.max_ack_pending,
            ack_wait_s=s.ack_wait_s,
            max_deliver=consumer_max_deliver(s),
        )

    async def run(self, stop: asyncio.Event) -> None:
        s = self.settings
        self._stop = stop
        sub = await self.consumer().bind(self._js)
        self._markers = await self._js.key_value(self.names.folded_bucket)
        working: set[asyncio.Task[None]] = set()
        stopping = asyncio.create_task(stop.wait())
        try:
            while not stop.is_set():
                free = s.concurrency - len(working)
                if free <= 0:
                    await asyncio.wait({*working, stopping}, return_when=asyncio.FIRST_COMPLETED)
                    continue
                try:
                    msgs = await fetch(sub, min(free, s.fetch_batch), s.fetch_timeout_s)
                except EventLogUnavailable as exc:
                    log.warning("fold worker: %s; retrying", exc)
                    await asyncio.wait({stopping}, timeout=1.0)
                    continue
                for msg in msgs:
                    task = asyncio.create_task(self._handle(msg))
                    working.add(task)
                    task.add_done_callback(working.discard)
        finally:
            stopping.cancel()
            if working:
                await asyncio.gather(*working, return_exceptions=True)
            await release(sub)

    async def _handle(self, msg: Msg) -> None:
        run = session = None
        try:
            async with keep_alive([msg], self.settings.ack_wait_s / 3):
                close = self._codec.decode(msg.data)
                if not isinstance(close, SessionClosed):
                    raise FoldError(
                        f"{msg.subject} holds a {type(close).__name__}; only SessionClosed "
                        f"belongs on a close subject"
                    )
                run, session = close.run, close.session
                await self._fold_session(close, msg)
            await self._ack(msg)
        except asyncio.CancelledError:
            raise
        except _PoisonEvent as exc:
            await self._dead_letter_poison(msg, exc, run, session)
        except Exception as exc:
            await self._fail(msg, exc, run, session)

    async def _fold_session(self, close: SessionClosed, msg: Msg) -> None:
        assert self._markers is not None
        key = f"{close.run}.{close.session}"
        try:
            await self._markers.get(key)
        except js_errors.KeyNotFoundError:  # KeyDeletedError (an expired marker) included
            pass
        except (TimeoutError, nats.errors.Error) as exc:
            raise EventLogUnavailable(f"reading the fold marker of {key}: {exc}") from exc
        else:
            self.stats.already_folded += 1
            return
        stored = await read_session_messages(
            self._js,
            close.run,
            close.session,
            stream=self.names.events,
            batch=self.settings.rehydrate_batch,
        )
        events = [self._decode(m) for m in stored]
        opened = next((e for e in events if isinstance(e, SessionOpened)), None)
        result = fold(events, fold_options(self.settings, opened))
        await self._publish_unstored(msg, close, result.trajectories)
        marker = FoldMarker(
            trajectories=len(result.trajectories),
            fold_version=result.trajectories[0].fold_version if result.trajectories else 0,
            close_seq=int(msg.metadata.sequence.stream),
            forks=result.forks,
            late_events=result.late_events,
            folded_at=time.time(),
        )
        await self._write_marker(key, marker)
        self._count(close, result)

    async def _publish_unstored(
        self, msg: Msg, close: SessionClosed, trajectories: list[TrajectoryReady]
    ) -> None:
        """Publish the trajectories that no earlier delivery of this close stored in TRAJ."""
        if not trajectories:
            return
        stamped = msg.metadata.timestamp  # when the close was stored (server clock)
        if republish_could_duplicate(
            delivery=delivery_count(msg),
            close_age_s=time.time() - stamped.timestamp(),
            window_s=await self._traj_duplicate_window_s(),
        ):
            stored = await stored_msg_ids(
                self._js,
                self.names.trajectories,
                traj_subject(close.run),
                [t.trajectory_id for t in trajectories],
                since=stamped - datetime.timedelta(seconds=CLOCK_SKEW_S),
            )
            if stored:
                self.stats.already_published += len(stored)
                log.warning(
                    "run=%s session=%s: %d of %d trajectories already in %s from an earlier "
                    "delivery of the close (past the duplicate window); not published again",
                    close.run,
                    close.session,
                    len(stored),
                    len(trajectories),
                    self.names.trajectories,
                )
                trajectories = [t for t in trajectories if t.trajectory_id not in stored]
        if trajectories:
            await self._publisher.publish_many(trajectories)

    async def _traj_duplicate_window_s(self) -> float:
        """TRAJ's duplicate window as the server has it (an operator may have changed it)."""
        if self._traj_window_s is None:
            stream = self.names.trajectories
            try:
                info = await self._js.stream_info(stream)
            except (TimeoutError, nats.errors.Error) as exc:
                raise EventLogUnavailable(f"reading the config of stream {stream}: {exc}") from exc
            self._traj_window_s = float(info.config.duplicate_window or 0.0)
        return self._traj_window_s

    async def _write_marker(self, key: str, marker: FoldMarker) -> None:
        assert self._markers is not None
        try:
            await self._markers.put(key, msgspec.json.encode(marker))
        except (TimeoutError, nats.errors.Error) as exc:
            raise EventLogUnavailable(f"writing the fold marker of {key}: {exc}") from exc

    def _decode(self, stored: StoredMessage) -> SessionEvent:
        try:
            event = self._codec.decode(stored.data)
        except SchemaError as exc:
            raise _PoisonEvent(stored, exc) from exc
        if isinstance(event, TrajectoryReady):
            raise _PoisonEvent(stored, _NotASessionEvent(stored.subject))
        return event

    def _count(self, close: SessionClosed, result: FoldResult) -> None:
        st = self.stats
        st.sessions_folded += 1
        st.trajectories += len(result.trajectories)
        st.forks += result.forks
        if result.late_events:
            st.late_events += result.late_events
            log.warning(
                "run=%s session=%s: %d late event(s) (after the close) not folded",
                close.run,
                close.session,
                result.late_events,
            )

    # -- failures ---------------------------------------------------------------------------

    async def _fail(self, msg: Msg, exc: Exception, run: str | None, session: str | None) -> None:
        decision = disposition(exc, delivery=delivery_count(msg), settings=self.settings)
        if isinstance(decision, Retry):
            self.stats.retried += 1
            log.info(
                "close %s (delivery %d): %s; retry in %.1fs",
                msg.subject,
                delivery_count(msg),
                exc,
                decision.delay_s,
            )
            await self._nak(msg, decision.delay_s)
            return
        assert isinstance(decision, DeadLetterIt)
        letter = dead_letter_for(
            msg, source=SOURCE, reason=decision.reason, error=exc, run=run, session=session
        )
        await self._send_dead_letter(msg, letter)

    async def _dead_letter_poison(
        self, msg: Msg, exc: _PoisonEvent, run: str | None, session: str | None
    ) -> None:
        """The letter names the bad event (its bytes, subject, seq); the close is acked."""
        letter = DeadLetter(
            source=SOURCE,
            reason=reason_of(exc.error),
            error=f"{type(exc.error).__name__}: {exc.error} (the session is not folded; its "
            f"close is {msg.subject} seq {msg.metadata.sequence.stream})",
            stream=self.names.events,
            subject=exc.stored.subject,
            seq=exc.stored.seq,
            deliveries=delivery_count(msg),
            run=run,
            session=session,
            payload=exc.stored.data,
            created_at=time.time(),
        )
        await self._send_dead_letter(msg, letter)

    async def _send_dead_letter(self, msg: Msg, letter: DeadLetter) -> None:
        """Store the letter, then ack; what a refused letter gets is ``when_dead_letter_fails``."""
        delivery = delivery_count(msg)
        async with keep_alive([msg], self.settings.ack_wait_s / 3):
            for attempt in itertools.count(1):
                try:
                    await publish_dead_letter(self._publisher, letter, self._max_payload)
                    break
                except Exception as exc:  # the DLQ is in the same log
                    decision = when_dead_letter_fails(
                        delivery=delivery,
                        attempt=attempt,
                        stopping=self._stop.is_set(),
                        settings=self.settings,
                    )
                    log.warning(
                        "cannot dead-letter %s seq %d (delivery %d, try %d): %s; %s",
                        letter.subject,
                        letter.seq,
                        delivery,
                        attempt,
                        exc,
                        decision,
                    )
                    if isinstance(decision, Retry):
                        await self._nak(msg, decision.delay_s)
                        return
                    await self._pause(decision.delay_s)
        self.stats.dead_letters[letter.reason] = self.stats.dead_letters.get(letter.reason, 0) + 1
        await self._ack(msg)

    async def _pause(self, delay_s: float) -> None:
        """Sleep ``delay_s``, cut short by a stop request (but not once stopping already)."""
        if self._stop.is_set():
            await asyncio.sleep(delay_s)
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(delay_s):
                await self._stop.wait()

    async def _nak(self, msg: Msg, delay_s: float) -> None:
        try:
            await msg.nak(delay=delay_s)
        except (nats.errors.Error, OSError) as exc:  # it comes back after ack_wait anyway
            log.info("nak of %s failed: %s", msg.subject, exc)

    async def _ack(self, msg: Msg) -> None:
        try:
            await msg.ack()
        except (nats.errors.Error, OSError) as exc:  # redelivered; the marker makes it a no-op
            log.info("ack of %s failed: %s", msg.subject, exc)


class _NotASessionEvent(SchemaError):
    def __init__(self, subject: str) -> None:
        super().__init__(f"{subject} holds a TrajectoryReady; EVENTS takes session events only")
