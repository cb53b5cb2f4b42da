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
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from gateway.core.aggregate import JSON, Kept, SessionState, apply, fold
from gateway.core.conversation import MessageKey
from gateway.errors import SessionClosed
from schemas.events import SessionEvent, TurnCompleted

__all__ = ["Asked", "ContextCache", "Flight", "Session", "SessionKey", "SessionStore"]

SessionKey = tuple[str, str]  # (run, session id)
Recover = Callable[[str, str], Awaitable[Sequence[SessionEvent]]]
Create = Callable[[], Awaitable[SessionState]]


@dataclass(frozen=True)
class ContextCache:
    """What the turn that continues a kept turn reuses of it, built when that turn ran:

    * ``text``: the text its context ids stand for, in parts (its prompt's render, any forced
      tool-call opening, its completion decoded with special tokens: not joined, a copy of the
      whole context saved), so that the next turn renders its conversation once and keeps the
      ids of this text where the render starts with it (``ChatTemplate.extension_ids``);
    * ``json_head``: the JSON text of its context ids without the closing bracket
      (``b"[1,2,3"``), in parts, built when its prompt went to an HTTP backend
      (``gateway.backends.interface.Prompt``), so the next turn encodes only its new ids.

    A cache, not state: none after recovery, and handed on (``Session.take_context``) to the
    turn that continues it, so a chain of turns holds one (a second continuation of a turn
    finds none and renders and encodes in full)."""

    text: tuple[str, ...] | None = None
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

    def recovered(self, state: SessionState) -> None:
        """The log's state replaces this one (read back when the log is ahead); the caches go,
        as for a session loaded from the log. Requests started count on from the log's turns."""
        self.state = state
        self.contexts.clear()
        self.started = max(self.started, state.turns)

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


class SessionStore:
    def __init__(
        self,
        *,
        recover: Recover | None = None,
        max_sessions: int = 10_000,
        closed_grace_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        kept: Kept | None = None,
    ) -> None:
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1: {max_sessions}")
        self.kept = kept or Kept()  # what each session keeps continuable (SessionState.kept)
        self._recover = recover  # reads one session's events from the log
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
        state = None
        if self._recover is not None:
            state = fold(await self._recover(*key), kept=self.kept)
        if state is None and create is not None:
            state = await create()
        if state is None:
            return None
        session = Session(state)
        if state.closed:
            session.closed_at = self._clock()
            self._closed.append(session)
        self._sessions[key] = session
        self._evict()
        return session

    def closed(self, session: Session) -> None:
        """``session`` was closed: it stays for the grace period (a retried close is answered
        from memory), then goes."""
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
