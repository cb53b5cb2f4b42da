"""The gateway's session store: one load per key however many ask, bounded memory."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from eventlog import SessionTail
from gateway.core.aggregate import Kept, SessionState, TurnDraft, apply, turn_event
from gateway.core.session_store import ContextCache, Session, SessionLog, SessionStore
from schemas.events import SessionEvent, SessionOpened


class Log:
    """Sessions' events by key, and how often each was read (stands in for the EVENTS stream:
    the store only reads what follows a sequence; the real read is tested in integration)."""

    def __init__(self) -> None:
        self.events: dict[tuple[str, str], list[SessionEvent]] = {}
        self.reads = 0

    async def read_after(self, run: str, session: str, after_seq: int) -> SessionTail:
        self.reads += 1
        await asyncio.sleep(0.01)  # a round trip: concurrent requests overlap here
        events = list(enumerate(self.events.get((run, session), []), start=1))[after_seq:]
        return SessionTail(after_seq, events, events[-1][0] if events else after_seq)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_concurrent_first_requests_share_one_load_and_one_creation() -> None:
    log, created = Log(), []

    async def create() -> tuple[SessionState, int]:
        created.append(1)
        await asyncio.sleep(0.01)
        return SessionState(run="r", id="s"), 0

    store = SessionStore(log=SessionLog(log.read_after))
    sessions = await asyncio.gather(*(store.load(("r", "s"), create) for _ in range(8)))
    assert len(created) == 1 and log.reads == 1
    assert all(s is sessions[0] for s in sessions)  # one handle, one lock


async def test_runs_do_not_share_sessions() -> None:
    log = Log()
    log.events[("A", "x")] = [SessionOpened(run="A", session="x", metadata={"secret": 1})]
    store = SessionStore(log=SessionLog(log.read_after))
    assert await store.load(("B", "x")) is None
    found = await store.load(("A", "x"))
    assert found is not None and found.state.metadata == {"secret": 1}


async def test_closed_sessions_go_after_the_grace_period() -> None:
    clock = Clock()
    store = SessionStore(closed_grace_s=10, clock=clock)
    session = await store.load(("r", "s"), _create("s"))
    assert session is not None
    store.closed(session)
    clock.now = 5
    await store.load(("r", "t"), _create("t"))
    assert len(store) == 2
    clock.now = 11
    await store.load(("r", "u"), _create("u"))
    assert len(store) == 2 and store.evicted == 1


async def test_least_recently_used_open_sessions_are_evicted_but_never_one_in_use() -> None:
    store = SessionStore(max_sessions=2)
    busy = await store.load(("r", "busy"), _create("busy"))
    assert busy is not None
    release = store.hold(busy)
    for name in "abcd":
        await store.load(("r", name), _create(name))
    assert await _held(store, "busy"), "a session in use is never evicted"
    assert len(store) == 2
    release()
    for name in "ef":
        await store.load(("r", name), _create(name))
    assert not await _held(store, "busy"), "released, it is evicted like any other"


async def test_a_hold_keeps_a_session_until_released() -> None:
    store = SessionStore(max_sessions=1)
    session = await store.load(("r", "s"), _create("s"))
    assert session is not None
    release = store.hold(session)
    await store.load(("r", "t"), _create("t"))
    assert await _held(store, "s")
    release()
    release()  # once only
    assert session.users == 0


async def test_a_failed_load_reaches_every_waiter_and_the_next_request_tries_again() -> None:
    attempts = []

    async def read_after(run: str, session: str, after_seq: int) -> SessionTail:
        attempts.append(1)
        await asyncio.sleep(0.01)
        if len(attempts) == 1:
            raise OSError("log down")
        return SessionTail(after_seq, [], after_seq)

    store = SessionStore(log=SessionLog(read_after))
    results = await asyncio.gather(
        *(store.load(("r", "s")) for _ in range(3)), return_exceptions=True
    )
    assert all(isinstance(r, OSError) for r in results)
    assert await store.load(("r", "s")) is None


def _create(name: str) -> Callable[[], Awaitable[tuple[SessionState, int]]]:
    async def create() -> tuple[SessionState, int]:
        return SessionState(run="r", id=name), 0

    return create


async def _held(store: SessionStore, name: str) -> bool:
    return await store.load(("r", name)) is not None


def test_the_caches_live_beside_the_state_and_go_with_the_turns_they_serve() -> None:
    """The aggregate stays data: a kept turn's cache is the Session's, dropped when the turn is
    forgotten (``Kept``)."""
    opened = SessionOpened(run="r", session="s")
    state = apply(None, opened, kept=Kept(turns=1))
    assert state is not None
    session = Session(state)
    hi = {"role": "user", "content": "hi"}
    first = turn_event(state, TurnDraft([1], [hi], None, [2], [0.0]))
    session.apply(first)
    session.keep_context(0, ContextCache((b"hi", b"", b"yo"), (b"[1,2",)))
    assert session.contexts[0].text == (b"hi", b"", b"yo")
    assert not hasattr(session.state.nodes[0], "cache")  # nothing written into the node
    second = turn_event(session.state, TurnDraft([9], [hi], None, [3], [0.0]))  # a new branch
    session.apply(second)  # keeps one turn: turn 0 is forgotten, and its cache with it
    assert list(session.state.nodes) == [1] and session.contexts == {}
    session.keep_context(0, ContextCache((b"stale",)))  # a turn no longer kept holds none
    assert session.contexts == {}
    session.keep_context(1, ContextCache((b"x",)))
    assert session.take_context(1) == ContextCache((b"x",)) and session.take_context(1) is None
