"""The sessions a gateway holds in memory, keyed by (run, session id), bounded.

A ``Session`` is a handle: the session's state (``gateway.core.aggregate.SessionState``, changed
only by applying its events), the lock that serializes its appends (turns of one session are
generated concurrently, DESIGN §4: sub-agents run together; only building, publishing and
applying each turn's event, where its index is assigned, is one at a time), the requests in
flight (``Flight``: a client's retry of one waits for it), the count of requests started (the
derived seeds') and the number of requests using it. The store:

- loads a session atomically per key: concurrent requests for a session not in memory wait for
  one load (from the log, or a creation), so they all share one handle and one lock;
- holds beside each state the caches its live turns leave (``ContextCache``): the state stays
  data only, and what the log does not say is not in it;
- evicts closed sessions after a grace period, and open ones least-recently-used beyond
  ``max_sessions``; a session in use (``users``: a request, a streamed turn until it has
  appended) is never evicted (two handles would mean two locks). An
  evicted session is recovered from the log on its next request, by the same fold (keeping the
  same ``kept`` turns of it continuable as the live session kept).

The log decides, not this memory (DESIGN §4): a held state is a cache of the log. Beside it the
handle keeps ``Session.seq``, the stream sequence of the last message on the session's subjects
that this gateway knows of (from the read that loaded it, its own appends' acks, its catch-up
reads). ``SessionLog`` is what the gateway asks the log: every append states that sequence
(``expectation``; JetStream checks it), and an append refused because another writer (a second
gateway, the reaper, a client's close elsewhere) stored something after it is followed by
``catch_up``: one read of only what follows ``seq``, applied with the same ``apply`` recovery
folds; the caller re-derives its event and appends again. Any number of gateways, any routing:
affinity only saves catch-up reads. A catch-up is also asked for before a turn is prepared where
the copy may not be enough to build its prompt token for token (``gateway.serving.turn_service``).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from eventlog import Expectation, PublishReceipt, SessionTail
from gateway.core.aggregate import JSON, Kept, SessionState, apply, fold
from gateway.core.conversation import MessageKey
from gateway.errors import SessionClosed
from gateway.metrics import GatewayMetrics
from schemas.events import SessionEvent, TurnCompleted

__all__ = [
    "Asked",
    "ContextCache",
    "Flight",
    "ReadAfter",
    "Session",
    "SessionKey",
    "SessionLog",
    "SessionStore",
]

SessionKey = tuple[str, str]  # (run, session id)
# (run, session, after_seq) -> the session's events stored after after_seq (0: all of them)
ReadAfter = Callable[[str, str, int], Awaitable[SessionTail]]
# Opens a session the log does not hold: its state and the stream sequence of its open (0: unknown)
Create = Callable[[], Awaitable[tuple[SessionState, int]]]
# A catch-up that must reach a sequence the log named (a refusal's ``last_seq``) reads again
# this many times: a replica answering direct gets may be a moment behind the stream's leader.
_REACH_TRIES = 5
_REACH_BACKOFF_S = 0.02


@dataclass(frozen=True)
class ContextCache:
    """What the turn that continues a kept turn reuses of it, built when that turn ran:

    * ``text``: the UTF-8 of the text its context ids stand for, in parts (its prompt's
      render, any forced tool-call opening, its completion decoded with special tokens: not
      joined, a copy of the whole context saved), so that the next turn renders its
      conversation once and keeps the ids of this text where the render starts with it
      (``ChatTemplate.extension_ids``). UTF-8, not ``str``: a byte a character where one emoji
      in the render would make Python hold it at four (~400 KB at 100k characters);
    * ``json_head``: the JSON text of its context ids without the closing bracket
      (``b"[1,2,3"``), in parts, built when its prompt went to an HTTP backend
      (``gateway.backends.interface.Prompt``), so the next turn encodes only its new ids.

    A cache, not state: none after recovery, and handed on (``Session.take_context``) to the
    turn that continues it, so a chain of turns holds one (a second continuation of a turn
    finds none and renders and encodes in full)."""

    text: tuple[bytes, ...] | None = None
    json_head: tuple[bytes | memoryview, ...] = ()  # gateway.backends.interface.JsonHead


@dataclass(frozen=True)
class Asked:
    """What makes two requests of a session the same request: the agent that sent it (None:
    none named), its record (``TurnRequest.record``), the tools offered, its messages' keys."""

    agent: str | None
    request: JSON
    tools: list[JSON] | None
    keys: tuple[MessageKey, ...]


@dataclass(eq=False)
class Flight:
    """A turn being generated, findable by a same-agent retry of its request (a client that
    timed out and sent it again), which waits for it rather than sampling a second time.

    ``landed`` resolves to its event once appended, None if it failed (the retry then runs
    itself); ``joined`` counts the retries waiting for it: they will show the client its reply,
    so a streamed turn whose first client left is not recorded as ``client_gone``."""

    asked: Asked
    landed: asyncio.Future[TurnCompleted | None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future(), repr=False
    )
    joined: int = 0

    def land(self, event: TurnCompleted | None) -> None:
        if not self.landed.done():
            self.landed.set_result(event)


@dataclass(eq=False)
class Session:
    state: SessionState
    # Serializes appends (an event's index is the state's turns when it is built) with each
    # other and with a close or a reward; held from building a turn's event to applying it.
    lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)
    users: int = 0  # requests holding this handle: never evicted while > 0
    closed_at: float | None = None
    # The caches of kept turns, by turn index (beside the state, not in its frozen nodes).
    contexts: dict[int, ContextCache] = field(default_factory=dict, repr=False)
    flights: list[Flight] = field(default_factory=list, repr=False)  # turns in flight
    # Requests started (each its own derived seed, TurnEngine.params): from the turns the
    # state holds, so a session served one request at a time derives seed t for turn t.
    started: int = field(default=-1, repr=False)
    # The stream sequence of the last message on the session's subjects this gateway knows of
    # (what its next append expects), and when it last heard from the log about it (monotonic).
    seq: int = 0
    synced_at: float = field(default=0.0, repr=False)

    def __post_init__(self) -> None:
        if self.started < 0:
            self.started = self.state.turns

    def next_request(self) -> int:
        """The number of this request among the session's started ones (its seed's)."""
        n = self.started
        self.started += 1
        return n

    def flight(self, asked: Asked) -> Flight | None:
        """The turn in flight whose request this one repeats, else None."""
        return next((f for f in self.flights if f.asked == asked), None)

    def take_off(self, asked: Asked) -> Flight:
        """Register a turn as in flight until it lands (``landed``)."""
        flight = Flight(asked)
        self.flights.append(flight)
        return flight

    def landed(self, flight: Flight, event: TurnCompleted | None) -> None:
        """``flight`` appended ``event`` (None: it failed); its waiters get it."""
        if flight in self.flights:
            self.flights.remove(flight)
        flight.land(event)

    def apply(self, event: SessionEvent, keys: Sequence[MessageKey] | None = None) -> None:
        """The live path: ``event``, published and acknowledged, applied to the state (the same
        ``apply`` recovery folds; ``keys``: the turn's message keys, from its request). The
        caches of turns no longer kept go with them."""
        state = apply(self.state, event, keys=keys)
        assert state is not None  # applied to a state: never None
        self.state = state
        contexts = self.contexts
        if contexts:
            for turn in [t for t in contexts if t not in state.nodes]:
                del contexts[turn]

    def keep_context(self, turn: int, cache: ContextCache) -> None:
        """What kept turn ``turn`` leaves for the turn that will continue it."""
        if turn in self.state.nodes:
            self.contexts[turn] = cache

    def take_context(self, turn: int) -> ContextCache | None:
        """The cache of kept turn ``turn``, taken: the turn continuing it will hold the next."""
        return self.contexts.pop(turn, None)

    @property
    def key(self) -> SessionKey:
        return (self.state.run, self.state.id)

    @property
    def name(self) -> str:
        """How messages name it: ``run/session``."""
        return f"{self.state.run}/{self.state.id}"

    def ensure_open(self) -> None:
        if self.state.closed:
            raise SessionClosed(
                f"session {self.state.id} (run {self.state.run}) is closed "
                f"({self.state.status}); open a new session for a new episode"
            )


class SessionLog:
    """What a gateway asks the log about the sessions it holds, over ``read_after``."""

    # Appends of one event refused in a row (each after a catch-up) before the client gets a
    # 503. Each refusal means another writer's append landed, so an event is refused at most as
    # often as others append to its session meanwhile: a fan-out of parallel sub-agents over a
    # fleet stays well inside it.
    max_refusals = 32

    def __init__(
        self,
        read_after: ReadAfter,
        *,
        stream: str = "EVENTS",
        metrics: GatewayMetrics | None = None,
        idle_sync_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._read_after = read_after
        self.stream = stream
        self.metrics = metrics
        self.idle_sync_s = idle_sync_s
        self._clock = clock

    async def load(self, key: SessionKey, kept: Kept) -> tuple[SessionState | None, int]:
        """The session's state as the log holds it (None: no events), and its last sequence."""
        tail = await self._read_after(*key, 0)
        return fold((event for _, event in tail.events), kept=kept), tail.last_seq

    def expectation(self, session: Session) -> Expectation:
        """What the session's next append states: the last sequence this gateway knows."""
        return Expectation.session(session.state.run, session.state.id, session.seq, self.stream)

    def appended(self, session: Session, receipt: PublishReceipt) -> None:
        """An expected append of the session was stored at ``receipt.seq``: nothing else was
        stored in between (JetStream checked), so that is the session's last sequence now."""
        if receipt.seq is not None:
            session.seq = max(session.seq, receipt.seq)
        session.synced_at = self._clock()

    def idle(self, session: Session) -> bool:
        """Whether this gateway has not heard from the log about the session for
        ``idle_sync_s``: another writer may have taken turns or closed it meanwhile."""
        return self._clock() - session.synced_at >= self.idle_sync_s

    async def catch_up(
        self, session: Session, reason: str, *, reach: int | None = None
    ) -> list[SessionEvent]:
        """Apply what the log stored on the session after ``session.seq`` (the caller holds
        ``session.lock``); returns those events. ``reach``: a sequence the log said it holds (a
        refusal's ``last_seq``), read again (briefly) until reached. ``reason``: the metric's
        label (refused, unsure, idle)."""
        events: list[SessionEvent] = []
        for attempt in range(_REACH_TRIES):
            tail = await self._read_after(session.state.run, session.state.id, session.seq)
            if self.metrics is not None:
                self.metrics.catch_up_reads.labels(reason).inc()
            for _, event in tail.events:
                session.apply(event)  # a turn the copy holds already changes nothing
                events.append(event)
            session.seq = max(session.seq, tail.last_seq)
            if reach is None or session.seq >= reach:
                break
            await asyncio.sleep(_REACH_BACKOFF_S * 2**attempt)
        session.synced_at = self._clock()
        session.started = max(session.started, session.state.turns)
        if self.metrics is not None and events:
            self.metrics.caught_up_events.inc(len(events))
        return events


class SessionStore:
    def __init__(
        self,
        *,
        log: SessionLog | None = None,
        max_sessions: int = 10_000,
        closed_grace_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        kept: Kept | None = None,
    ) -> None:
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1: {max_sessions}")
        self.kept = kept or Kept()  # what each session keeps continuable (SessionState.kept)
        self.log = log  # None: no log to read (sessions live only here; tests of the core)
        self._max = max_sessions
        self._grace_s = closed_grace_s
        self._clock = clock
        self._sessions: OrderedDict[SessionKey, Session] = OrderedDict()  # least recent first
        self._closed: deque[Session] = deque()  # in the order they closed
        self._loading: dict[SessionKey, asyncio.Future[Session | None]] = {}
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def hold(self, session: Session) -> Callable[[], None]:
        """Hold ``session`` (not evicted) until the returned release is called; a second call
        of it does nothing. Requests hold their session; a streamed turn holds it until it has
        appended (whether or not its client stayed), a replayed one until its last chunk."""
        session.users += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                session.users -= 1
                self._evict()

        return release

    async def load(self, key: SessionKey, create: Create | None = None) -> Session | None:
        """The session of ``key``, loading it once however many requests ask at a time."""
        session = self._sessions.get(key)
        if session is not None:
            self._sessions.move_to_end(key)
            return session
        pending = self._loading.get(key)
        if pending is not None:
            found = await asyncio.shield(pending)
            if found is not None or create is None:
                return found
            return await self.load(key, create)  # that load found nothing and created nothing
        future: asyncio.Future[Session | None] = asyncio.get_running_loop().create_future()
        self._loading[key] = future
        try:
            session = await self._load(key, create)
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: waiters re-raise it, nobody else must
            raise
        else:
            future.set_result(session)
            return session
        finally:
            del self._loading[key]

    async def _load(self, key: SessionKey, create: Create | None) -> Session | None:
        state, seq = None, 0
        if self.log is not None:
            state, seq = await self.log.load(key, self.kept)
        if state is None and create is not None:
            state, seq = await create()
        if state is None:
            return None
        session = Session(state, seq=seq, synced_at=self._clock())
        if state.closed:
            session.closed_at = self._clock()
            self._closed.append(session)
        self._sessions[key] = session
        self._evict()
        return session

    async def catch_up(
        self, session: Session, reason: str, *, reach: int | None = None
    ) -> list[SessionEvent]:
        """``SessionLog.catch_up`` (nothing without a log); a session it finds closed is
        closed here too (held for the grace period, then evicted)."""
        if self.log is None:
            return []
        was_closed = session.state.closed
        events = await self.log.catch_up(session, reason, reach=reach)
        if session.state.closed and not was_closed:
            self.closed(session)
        return events

    def closed(self, session: Session) -> None:
        """``session`` was closed: it stays for the grace period (a retried close is answered
        from memory), then goes."""
        if session.closed_at is not None:
            return  # already in the closed queue
        session.closed_at = self._clock()
        self._closed.append(session)
        self._evict()

    def _evict(self) -> None:
        cutoff = self._clock() - self._grace_s
        while self._closed and (self._closed[0].closed_at or 0.0) <= cutoff:
            session = self._closed[0]
            if session.users:
                break  # in use (a retried close); the next eviction tries again
            self._closed.popleft()
            self._drop(session)
        excess = len(self._sessions) - self._max
        if excess <= 0:
            return
        victims = []
        for session in self._sessions.values():  # least recently used first
            if not session.users and not session.lock.locked():
                victims.append(session)
                if len(victims) == excess:
                    break
        for session in victims:
            self._drop(session)

    def _drop(self, session: Session) -> None:
        if self._sessions.get(session.key) is session:
            del self._sessions[session.key]
            self.evicted += 1
