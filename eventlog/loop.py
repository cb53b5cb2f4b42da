"""The one pull loop: every consumer of the log runs inside it (DESIGN §2).

::

    fetch (sized to a byte budget) -> Delivery -> handler -> Outcome
        Ack     -> ack now
        Hold    -> the handler settles it later (``ack``/``nak``/``reject``); kept alive meanwhile
        Reject  -> dead letter (reason, error), then ack
        raised  -> ``disposition(error)``: nak with backoff, or dead letter at the last delivery

Handlers — the fold worker, the shard writer, the reaper's tracker, the live trainer feed — take
a decoded ``Delivery`` (subject, bytes, stream sequence, delivery count, Msg-Id) and return an
outcome; none of them sees a nats message. The loop owns what they used to write four times:
fetch sizing, keep-alive (``in_progress`` for messages being handled or held), stop and drain,
ack/nak/term, the one dead-letter builder and its retry policy (``when_dead_letter_fails``), and
the translation of nats errors. An error marked ``fatal`` (the shard target failed) is not the
message's fault: it ends ``run`` and nothing is acknowledged for it. A handler with
``handle_batch`` gets a fetch's deliveries at once (the reaper merges a session's events in one
write); one with ``handle`` gets them one by one, up to ``concurrency`` at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import nats.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from eventlog.dead_letters import publish_dead_letter
from eventlog.dispositions import Retry, disposition, when_dead_letter_fails
from eventlog.metrics import LoopMetrics
from eventlog.publisher import Publisher
from eventlog.pull import ConsumerSpec, FetchSizer, fetch, release
from schemas.dead_letter import DeadLetter
from schemas.errors import EventLogUnavailable, TurnstreamError
from schemas.ids import EVENT_SUBJECT_PREFIX, TRAJ_SUBJECT_PREFIX
from schemas.trust import StoredMessage

__all__ = [
    "ACK",
    "HOLD",
    "Ack",
    "BatchHandler",
    "Delivery",
    "Handler",
    "Hold",
    "LoopStats",
    "Outcome",
    "PullLoop",
    "Reject",
]

log = logging.getLogger(__name__)

_MSG_ID = "Nats-Msg-Id"


@dataclass(frozen=True, eq=False)
class Delivery:
    """One delivered message, as a handler sees it."""

    subject: str
    data: bytes
    seq: int  # stream sequence
    delivery: int  # 1 on the first delivery
    stored_at: float  # when the stream stored it (server clock, epoch seconds)
    msg_id: str | None
    pending: int  # messages the stream holds for the consumer after this one (its lag)
    _msg: Msg = field(repr=False)

    @classmethod
    def of(cls, msg: Msg) -> Delivery:
        meta = msg.metadata
        return cls(
            subject=msg.subject,
            data=msg.data,
            seq=int(meta.sequence.stream),
            delivery=int(meta.num_delivered),
            stored_at=meta.timestamp.timestamp(),
            msg_id=(msg.headers or {}).get(_MSG_ID),
            pending=int(meta.num_pending or 0),
            _msg=msg,
        )

    @property
    def stored(self) -> StoredMessage:
        return StoredMessage(self.seq, self.subject, self.data, self.msg_id)

    @property
    def run_session(self) -> tuple[str | None, str | None]:
        """Run and session as the subject names them (for dead letters)."""
        parts = self.subject.split(".")
        prefix = ".".join(parts[:2])
        if prefix == EVENT_SUBJECT_PREFIX and len(parts) == 5:
            return parts[2], parts[3]
        if prefix == TRAJ_SUBJECT_PREFIX and len(parts) == 3:
            return parts[2], None
        return None, None


class Ack:
    """Done with: acknowledge now."""


class Hold:
    """The handler keeps it and settles it later through the loop; kept alive meanwhile."""


@dataclass(frozen=True)
class Reject:
    """Dead-letter (``about``, or the delivery itself), then acknowledge the delivery."""

    reason: str
    error: str
    about: StoredMessage | None = None  # the message at fault, when it is not the delivery
    session: str | None = None


ACK = Ack()
HOLD = Hold()
Outcome = Ack | Hold | Reject


class Handler(Protocol):
    async def handle(self, delivery: Delivery) -> Outcome: ...


@runtime_checkable
class BatchHandler(Protocol):
    async def handle_batch(self, deliveries: Sequence[Delivery]) -> Sequence[Outcome]: ...


@dataclass
class LoopStats:
    handled: int = 0
    retried: int = 0
    dead_letters: dict[str, int] = field(default_factory=dict)  # by reason


class PullLoop:
    """Runs ``handler`` on the durable pull consumer ``spec`` describes. ``run(stop)`` for
    services; ``step()`` for a caller that pulls at its own pace (the trainer's live feed)."""

    def __init__(
        self,
        js: JetStreamContext,
        spec: ConsumerSpec,
        handler: Handler | BatchHandler,
        *,
        publisher: Publisher,
        source: str,
        max_payload: int,
        concurrency: int = 1,
        metrics: LoopMetrics | None = None,
    ) -> None:
        self._js = js
        self.spec = spec
        self._handler = handler
        self._publisher = publisher
        self.source = source
        self._max_payload = max_payload
        self._concurrency = concurrency
        self._sizer = FetchSizer(spec.fetch_max_bytes) if spec.fetch_max_bytes else None
        self.metrics = metrics or LoopMetrics.disabled()
        self.stats = LoopStats()
        self._sub: JetStreamContext.PullSubscription | None = None
        self._alive: dict[int, Delivery] = {}  # being handled or held, by stream sequence
        self._keeper: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self._fatal: TurnstreamError | None = None  # ends run(): the consumer cannot go on

    # -- life cycle -------------------------------------------------------------------------

    async def bind(self) -> None:
        """Create or update the durable consumer and subscribe (``run`` and ``step`` do it)."""
        if self._sub is None:
            self._sub = await self.spec.bind(self._js)
            self._keeper = asyncio.create_task(self._keep_alive(), name=f"{self.source}-alive")

    async def close(self) -> None:
        """Stop keeping messages alive and unsubscribe; what was not acked comes again."""
        if self._keeper is not None:
            self._keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keeper
            self._keeper = None
        if self._sub is not None:
            await release(self._sub)
            self._sub = None

    async def run(
        self,
        stop: asyncio.Event,
        *,
        tick: Callable[[], Awaitable[None]] | None = None,
        wait_s: Callable[[], float] | None = None,
    ) -> None:
        """Fetch and handle until ``stop`` is set; then finish what was taken and unsubscribe.

        ``tick`` runs after every fetch (a writer's time-based rotation); ``wait_s`` bounds the
        next fetch's wait (so the tick is not late).
        """
        self._stopping = stop
        await self.bind()
        working: set[asyncio.Task[None]] = set()
        stopping = asyncio.create_task(stop.wait())
        # In order, one fetch at a time (a batch handler, or one message at a time): a fetch is
        # as large as the settings allow. Concurrent handlers: no more than the free slots, so
        # nothing waits unhandled (and unkept) in this process while another could take it.
        in_order = self._concurrency == 1 or isinstance(self._handler, BatchHandler)
        try:
            while not stop.is_set():
                free = self.spec.fetch_batch if in_order else self._concurrency - len(working)
                if free <= 0:
                    await asyncio.wait({*working, stopping}, return_when=asyncio.FIRST_COMPLETED)
                    continue
                wait = wait_s() if wait_s is not None else self.spec.fetch_timeout_s
                try:
                    deliveries = await self._fetch(free, wait)
                except EventLogUnavailable as exc:
                    log.warning("%s: %s; retrying", self.source, exc)
                    await asyncio.wait({stopping}, timeout=1.0)
                    continue
                if self._fatal is not None:
                    raise self._fatal
                if in_order:
                    await self._dispatch(deliveries)
                else:
                    for delivery in deliveries:
                        task = asyncio.create_task(self._dispatch([delivery]))
                        working.add(task)
                        task.add_done_callback(working.discard)
                if tick is not None:
                    await tick()
        finally:
            stopping.cancel()
            if working:
                await asyncio.gather(*working, return_exceptions=True)
            await self.close()

    async def step(self, max_items: int, wait_s: float) -> int:
        """One fetch of up to ``max_items``, handled; how many messages came."""
        await self.bind()
        deliveries = await self._fetch(max_items, wait_s)
        await self._dispatch(deliveries)
        return len(deliveries)

    async def _fetch(self, room: int, wait_s: float) -> list[Delivery]:
        assert self._sub is not None
        batch = min(room, self.spec.fetch_batch)
        if self._sizer is not None:
            batch = self._sizer.batch(batch)
        msgs = await fetch(self._sub, batch, max(wait_s, 0.0))
        if self._sizer is not None:
            self._sizer.observe(msgs)
        deliveries = [Delivery.of(m) for m in msgs]
        for delivery in deliveries:
            self._alive[delivery.seq] = delivery
        if deliveries:
            self.metrics.fetched(deliveries[-1].pending)
        return deliveries

    # -- handling ---------------------------------------------------------------------------

    async def _dispatch(self, deliveries: Sequence[Delivery]) -> None:
        if not deliveries:
            return
        started = time.perf_counter()
        if isinstance(self._handler, BatchHandler):
            try:
                outcomes = list(await self._handler.handle_batch(deliveries))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                await asyncio.gather(*(self._fail(d, exc) for d in deliveries))
                return
            for delivery, outcome in zip(deliveries, outcomes, strict=True):
                await self._settle(delivery, outcome)
        else:
            for delivery in deliveries:
                try:
                    outcome = await self._handler.handle(delivery)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    if isinstance(exc, TurnstreamError) and exc.fatal:
                        self._fatal = exc
                        raise
                    await self._fail(delivery, exc)
                else:
                    await self._settle(delivery, outcome)
        self.metrics.handled(len(deliveries), time.perf_counter() - started)
        self.stats.handled += len(deliveries)

    async def _settle(self, delivery: Delivery, outcome: Outcome) -> None:
        if isinstance(outcome, Ack):
            await self.ack([delivery])
        elif isinstance(outcome, Reject):
            await self.reject(delivery, outcome)
        # Hold: the handler settles it

    async def _fail(self, delivery: Delivery, exc: Exception) -> None:
        decision = disposition(exc, delivery=delivery.delivery, spec=self.spec)
        if isinstance(decision, Retry):
            self.stats.retried += 1
            log.info(
                "%s: %s seq %d (delivery %d): %s; retry in %.1fs",
                self.source,
                delivery.subject,
                delivery.seq,
                delivery.delivery,
                exc,
                decision.delay_s,
            )
            await self.nak([delivery], decision.delay_s)
            return
        if not isinstance(exc, EventLogUnavailable) and decision.reason == "worker_error":
            log.error("%s: %s seq %d", self.source, delivery.subject, delivery.seq, exc_info=exc)
        await self.reject(delivery, Reject(decision.reason, f"{type(exc).__name__}: {exc}"))

    # -- settling (also called by handlers for what they hold) ------------------------------

    async def ack(self, deliveries: Iterable[Delivery], *, confirm_s: float | None = None) -> None:
        """Acknowledge. With ``confirm_s``, wait for JetStream to confirm each ack (raises
        EventLogUnavailable naming the first unconfirmed one: it will come again)."""
        for delivery in deliveries:
            self._alive.pop(delivery.seq, None)
            try:
                if confirm_s is None:
                    await delivery._msg.ack()
                else:
                    await delivery._msg.ack_sync(timeout=confirm_s)
            except (TimeoutError, nats.errors.Error, OSError) as exc:
                if confirm_s is not None:
                    raise EventLogUnavailable(
                        f"ack of {self.spec.stream} seq {delivery.seq} was not confirmed: "
                        f"{exc}; it is delivered again after ack_wait_s="
                        f"{self.spec.ack_wait_s:g}"
                    ) from exc
                # A lost ack means a redelivery, which every handler recognizes.
                log.info("%s: ack of seq %d failed: %s", self.source, delivery.seq, exc)

    def drop(self, deliveries: Iterable[Delivery]) -> None:
        """Stop keeping them alive, neither acked nor naked: JetStream delivers them again
        after its ack wait."""
        for delivery in deliveries:
            self._alive.pop(delivery.seq, None)

    async def nak(self, deliveries: Iterable[Delivery], delay_s: float | None = None) -> None:
        """Hand back: JetStream delivers them again (after ``delay_s``)."""
        for delivery in deliveries:
            self._alive.pop(delivery.seq, None)
            try:
                await delivery._msg.nak(delay=delay_s)
            except (nats.errors.Error, OSError) as exc:  # it comes back after ack_wait anyway
                log.info("%s: nak of seq %d failed: %s", self.source, delivery.seq, exc)

    def letter(self, delivery: Delivery, outcome: Reject) -> DeadLetter:
        """The one dead-letter builder: the message at fault, why, and where it is."""
        fault = outcome.about or delivery.stored
        run, session = delivery.run_session
        return DeadLetter(
            source=self.source,
            reason=outcome.reason,
            error=outcome.error,
            stream=self.spec.stream,
            subject=fault.subject,
            seq=fault.seq,
            deliveries=delivery.delivery,
            run=run,
            session=outcome.session or session,
            payload=bytes(fault.data),
            created_at=time.time(),
        )

    async def dead_letter(self, delivery: Delivery, outcome: Reject) -> None:
        """Store a dead letter only (a handler's side finding, e.g. one bad event of the session
        a close folds); raises when the log refuses it."""
        letter = self.letter(delivery, outcome)
        await publish_dead_letter(self._publisher, letter, self._max_payload)
        self._count_letter(letter.reason)

    def _count_letter(self, reason: str) -> None:
        self.stats.dead_letters[reason] = self.stats.dead_letters.get(reason, 0) + 1
        self.metrics.dead_lettered(reason)

    async def reject(self, delivery: Delivery, outcome: Reject) -> None:
        """Store the dead letter, then ack; a letter the log refuses is retried as
        ``when_dead_letter_fails`` says (a nak before the last delivery, else in process)."""
        letter = self.letter(delivery, outcome)
        self._alive[delivery.seq] = delivery  # kept alive while the letter is retried
        for attempt in itertools.count(1):
            try:
                await publish_dead_letter(self._publisher, letter, self._max_payload)
                break
            except Exception as exc:  # the DLQ is in the same log
                decision = when_dead_letter_fails(
                    delivery=delivery.delivery,
                    attempt=attempt,
                    stopping=self._stopping.is_set(),
                    spec=self.spec,
                )
                log.warning(
                    "%s: cannot dead-letter %s seq %d (delivery %d, try %d): %s; %s",
                    self.source,
                    letter.subject,
                    letter.seq,
                    delivery.delivery,
                    attempt,
                    exc,
                    decision,
                )
                if isinstance(decision, Retry):
                    await self.nak([delivery], decision.delay_s)
                    return
                await self._pause(decision.delay_s)
        self._count_letter(letter.reason)
        await self.ack([delivery])

    async def _pause(self, delay_s: float) -> None:
        """Sleep ``delay_s``, cut short by a stop request (but not once stopping already)."""
        if self._stopping.is_set():
            await asyncio.sleep(delay_s)
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(delay_s):
                await self._stopping.wait()

    async def _keep_alive(self) -> None:
        # A fold of a long session, a trajectory waiting in a GRPO group or in a shard buffer:
        # tell JetStream they are being worked on, or it redelivers them meanwhile.
        interval = self.spec.ack_wait_s / 3
        while True:
            await asyncio.sleep(interval)
            for delivery in list(self._alive.values()):
                with contextlib.suppress(nats.errors.Error, OSError):
                    await delivery._msg.in_progress()
