"""The fold worker, the reaper and the dead-letter stream against a real nats-server."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence

import msgspec
import pytest

from consumers import (
    FoldWorker,
    FoldWorkerSettings,
    Reaper,
    ReaperSettings,
    fold,
)
from consumers.fold import FoldOptions
from consumers.worker import FoldMarker
from eventlog import JetStreamPublisher, Publisher, PublishReceipt, connect, provision
from schemas import (
    Codec,
    CompactTrajectory,
    Event,
    EventLogUnavailable,
    SessionClosed,
    SessionEvent,
    TrajectoryReady,
    TurnCompleted,
    route,
)
from tests.conftest import FAST_LOG, Log
from tests.helpers.sessions import RUN, append_only, reward, session_events
from tests.helpers.streams import (
    dead_letters,
    message_count,
    publish_events,
    stream_payloads,
    trajectories,
)
from tests.helpers.waiting import eventually

pytestmark = pytest.mark.integration

FAST_FOLD = FoldWorkerSettings(
    max_deliver=3, backoff_s=(0.05,), ack_wait_s=5.0, fetch_timeout_s=0.2, concurrency=4
)


async def publish_raw(log: Log, subject: str, payload: bytes, msg_id: str) -> None:
    await log.js.publish(subject, payload, headers={"Nats-Msg-Id": msg_id})


@contextlib.asynccontextmanager
async def running(
    log: Log,
    settings: FoldWorkerSettings = FAST_FOLD,
    reaper: ReaperSettings | None = None,
    *,
    worker_type: type[FoldWorker] = FoldWorker,
    publisher: Callable[[Publisher], Publisher] = lambda pub: pub,
) -> AsyncIterator[tuple[FoldWorker, Reaper | None]]:
    """A fold worker (and a reaper) in this process, on its own connection; ``worker_type`` and
    ``publisher`` (a wrapper of the real publisher) let a test inject a fault on the worker's
    side while the nats-server stays real."""
    nc = await connect(log.server.url, FAST_LOG, name="worker")
    pub = await JetStreamPublisher(nc).start()
    worker = worker_type(nc.jetstream(), publisher(pub), settings)
    rp = Reaper(nc.jetstream(), pub, reaper) if reaper is not None else None
    stop = asyncio.Event()
    tasks = [asyncio.create_task(worker.run(stop))]
    if rp is not None:
        tasks.append(asyncio.create_task(rp.run(stop)))
    try:
        yield worker, rp
    finally:
        stop.set()
        await asyncio.gather(*tasks)
        await pub.close()
        await nc.close()


async def until_trajectories(log: Log, n: int, within: float = 20.0) -> None:
    count = 0

    async def poll() -> None:
        nonlocal count
        count = await message_count(log.js, "TRAJ")

    deadline = asyncio.get_running_loop().time() + within
    while count < n:
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"{count} trajectories in TRAJ, expected {n}")
        await poll()
        await asyncio.sleep(0.05)


def good_sessions(n: int, turns: int = 3, **kw: object) -> list[list[SessionEvent]]:
    return [
        session_events(append_only(turns), session=f"good-{i}", final_reward=float(i), **kw)  # type: ignore[arg-type]
        for i in range(n)
    ]


async def test_closed_sessions_become_their_folded_trajectories_once(log: Log) -> None:
    sessions = good_sessions(6)
    per_turn = session_events(
        append_only(4), session="stepwise", metadata={"fold": {"per_turn": True}}
    )
    await publish_events(log.nc, [e for s in sessions for e in s] + per_turn)

    async with running(log) as (worker, _):
        await until_trajectories(log, 6 + 4)
        await eventually(lambda: worker.stats.sessions_folded == 7, 5, "7 sessions folded")

    found = {t.trajectory_id: t for t in await trajectories(log.js)}
    assert len(found) == 10
    for events in sessions:
        [want] = fold(events).trajectories
        got = found[want.trajectory_id]
        assert Codec().encode(got) == Codec().encode(want)  # byte-identical
    stepwise = [found[f"{RUN}/stepwise/{i}"] for i in range(4)]
    assert [t.num_turns for t in stepwise] == [1, 1, 1, 1]
    assert [t.trajectory_id for t in fold(per_turn, FoldOptions(per_turn=True)).trajectories] == [
        t.trajectory_id for t in stepwise
    ]
    marker = await (await log.js.key_value("ts_folded")).get(f"{RUN}.good-0")
    assert msgspec.json.decode(marker.value or b"")["trajectories"] == 1


async def test_a_close_redelivered_after_its_fold_publishes_nothing_new(log: Log) -> None:
    [events] = good_sessions(1)
    await publish_events(log.nc, events)
    async with running(log) as (worker, _):
        await until_trajectories(log, 1)
        await eventually(lambda: worker.stats.sessions_folded == 1, 5, "folded")
    # Past the duplicate window the stream would store a repeat; the marker must stop it.
    await log.js.purge_stream("TRAJ")
    close = events[-1]
    await publish_raw(log, route(close).subject, Codec().encode(close), "another-msg-id")

    async with running(log) as (worker, _):
        await eventually(lambda: worker.stats.already_folded == 1, 5, "close seen as folded")
    assert await message_count(log.js, "TRAJ") == 0


def _newer_schema(event: TurnCompleted) -> bytes:
    fields = msgspec.msgpack.decode(Codec().encode(event))
    fields["v"] = 99
    return msgspec.msgpack.encode(fields)


async def test_each_poison_case_is_dead_lettered_with_its_reason_while_good_sessions_flow(
    log: Log,
) -> None:
    good = good_sessions(4)
    junk_turn = session_events(append_only(2), session="junk-turn")
    newer = session_events(append_only(2), session="newer")
    lying = [
        msgspec.structs.replace(e, prefix_len=99)
        if isinstance(e, TurnCompleted) and e.turn == 1
        else e
        for e in session_events(append_only(2), session="lying")
    ]
    missing = [
        e
        for e in session_events(append_only(3), session="missing")
        if not (isinstance(e, TurnCompleted) and e.turn == 1)
    ]
    await publish_events(log.nc, [e for s in good for e in s])
    await publish_events(
        log.nc, [e for e in junk_turn if not (isinstance(e, TurnCompleted) and e.turn)]
    )
    junk_subject = route(junk_turn[2]).subject
    await publish_raw(log, junk_subject, b"\xc1 not msgpack", route(junk_turn[2]).msg_id)
    await publish_events(log.nc, [junk_turn[-1]])
    newer_turn = newer[2]
    assert isinstance(newer_turn, TurnCompleted)
    await publish_events(log.nc, [e for e in newer if e is not newer_turn])
    await publish_raw(
        log, route(newer_turn).subject, _newer_schema(newer_turn), route(newer_turn).msg_id
    )
    await publish_events(log.nc, lying + missing)
    await publish_raw(log, f"ts.ev.{RUN}.junk-close.close", b"\x93junk", "junk-close")

    async with running(log) as (worker, _):
        await until_trajectories(log, 4)
        await eventually(
            lambda: sum(worker.loop.stats.dead_letters.values()) == 5, 15, "5 dead letters"
        )

    letters = {letter.session or letter.subject: letter for letter in await dead_letters(log.js)}
    assert letters["junk-turn"].reason == "undecodable"
    assert letters["junk-turn"].subject == junk_subject
    assert letters["junk-turn"].payload == b"\xc1 not msgpack"
    assert letters["newer"].reason == "unsupported_version"
    assert "v=99" in letters["newer"].error
    assert letters["lying"].reason == "fold_error"
    assert "turn 1" in letters["lying"].error
    assert letters["missing"].reason == "missing_turns"
    assert letters["missing"].deliveries == FAST_FOLD.max_deliver  # retried before giving up
    assert "missing turn(s) 1" in letters["missing"].error
    closes = [letter for letter in letters.values() if letter.subject.endswith("junk-close.close")]
    assert [c.reason for c in closes] == ["undecodable"]
    assert all(letter.stream == "EVENTS" and letter.seq > 0 for letter in letters.values())
    assert worker.loop.stats.dead_letters == {
        "undecodable": 2,
        "unsupported_version": 1,
        "fold_error": 1,
        "missing_turns": 1,
    }
    assert sorted(t.session for t in await trajectories(log.js)) == [f"good-{i}" for i in range(4)]
    # Everything was acked: nothing is left for the next worker.
    info = await log.js.consumer_info("EVENTS", "fold")
    assert info.num_ack_pending == 0 and info.num_pending == 0


async def test_two_workers_share_the_closes_and_no_session_is_folded_twice(log: Log) -> None:
    sessions = good_sessions(80, turns=2)
    await publish_events(log.nc, [e for s in sessions for e in s])
    async with running(log) as (a, _), running(log) as (b, _):
        await until_trajectories(log, 80, within=30)
        await eventually(
            lambda: a.stats.sessions_folded + b.stats.sessions_folded == 80, 10, "80 folded"
        )
    assert a.stats.sessions_folded > 0 and b.stats.sessions_folded > 0
    assert a.stats.already_folded == b.stats.already_folded == 0
    ids = Counter(t.trajectory_id for t in await trajectories(log.js))
    assert len(ids) == 80 and set(ids.values()) == {1}


async def test_reapers_close_an_idle_session_once_and_it_is_folded_as_timeout(log: Log) -> None:
    never_closed = session_events(append_only(3), session="abandoned", close=False)
    closed = session_events(append_only(2), session="finished")
    await publish_events(log.nc, never_closed + closed)
    reaping = ReaperSettings(idle_timeout_s=1.0, scan_interval_s=0.2)

    async with (
        running(log, reaper=reaping) as (_, r1),
        running(log, reaper=reaping) as (_, r2),
        running(log, reaper=reaping) as (_, r3),
    ):
        await until_trajectories(log, 2, within=20)
        reapers = [r for r in (r1, r2, r3) if r is not None]
        await eventually(lambda: sum(r.stats.sessions_reaped for r in reapers) >= 1, 10, "a reap")

    found = {t.session: t for t in await trajectories(log.js)}
    assert found["abandoned"].status == "timeout"
    assert found["abandoned"].num_turns == 3
    assert found["finished"].status == "completed"
    closes = [
        s for _, s, _ in await stream_payloads(log.js, "EVENTS") if s.endswith("abandoned.close")
    ]
    assert len(closes) == 1  # several reapers, one stored close (deterministic Msg-Id)
    [close] = [e for e in await _session(log, "abandoned") if isinstance(e, SessionClosed)]
    assert close.num_turns == 3


async def _session(log: Log, session: str) -> list[SessionEvent]:
    from eventlog import read_session

    return await read_session(log.js, RUN, session)


async def test_an_event_after_the_close_is_counted_and_dead_lettered_as_late(log: Log) -> None:
    events = session_events(append_only(2), session="done")
    await publish_events(log.nc, events)
    reaping = ReaperSettings(idle_timeout_s=60.0, scan_interval_s=0.2)
    async with running(log, reaper=reaping) as (_, reaper):
        assert reaper is not None
        await until_trajectories(log, 1)
        await eventually(lambda: reaper.stats.events_tracked >= len(events), 10, "tracked")
        await publish_events(log.nc, [reward(1.0, session="done", key="late", created_at=10.0)])
        await eventually(lambda: reaper.stats.late_events == 1, 10, "late event seen")

    [letter] = await dead_letters(log.js)
    assert letter.reason == "late_event"
    assert letter.session == "done" and letter.subject.endswith(".done.reward")
    assert await message_count(log.js, "TRAJ") == 1  # not folded in
    entry = await (await log.js.key_value("ts_sessions")).get(f"{RUN}.done")
    assert msgspec.json.decode(entry.value or b"")["late"] == 1


async def test_the_entries_of_sessions_closed_long_ago_are_forgotten(log: Log) -> None:
    await publish_events(log.nc, session_events(append_only(2), session="old"))
    await publish_events(log.nc, session_events(append_only(1), session="open", close=False))
    reaping = ReaperSettings(idle_timeout_s=3600.0, scan_interval_s=60.0)
    async with running(log, reaper=reaping) as (_, reaper):
        assert reaper is not None
        await eventually(lambda: reaper.stats.events_tracked >= 6, 10, "events tracked")
        bucket = await log.js.key_value("ts_sessions")
        assert sorted(await bucket.keys()) == [f"{RUN}.old", f"{RUN}.open"]

        assert await reaper.scan(now=time.time() + 60) == 0  # nothing idle or old yet
        assert reaper.stats.forgotten == 0
        await reaper.scan(now=time.time() + 2 * 3600)  # the open one is reaped meanwhile
        assert reaper.stats.forgotten == 1
        assert await bucket.keys() == [f"{RUN}.open"]


async def test_a_reaper_behind_the_stream_closes_on_what_the_stream_holds(log: Log) -> None:
    """The entry says idle with 2 turns tracked; the stream holds a third turn (the reaper that
    fetched it died before merging it) and, for another session, the close: the stream wins."""
    slow = session_events(append_only(3), session="slow", close=False)
    done = session_events(append_only(2), session="done")
    await publish_events(log.nc, slow[:3] + done[:3])  # open + two turns of each
    nc = await connect(log.server.url, FAST_LOG, name="reaper")
    pub = await JetStreamPublisher(nc).start()
    reaper = Reaper(nc.jetstream(), pub, ReaperSettings(idle_timeout_s=1.0))
    try:
        await reaper.attach()
        assert await reaper.loop.step(6, 2.0) == 6
        await asyncio.sleep(1.2)  # both entries idle now
        await publish_events(log.nc, slow[3:] + done[3:])  # untracked: the third turn; the close
        assert await reaper.scan() == 0  # the stream has newer events: not idle
        assert reaper.stats.not_idle_yet == 2

        assert await reaper.scan(now=time.time() + 5) == 1  # idle for real; "done" is closed
    finally:
        await pub.close()
        await nc.close()
    [close] = [e for e in await _session(log, "slow") if isinstance(e, SessionClosed)]
    assert (close.status, close.num_turns) == ("timeout", 3)
    [close] = [e for e in await _session(log, "done") if isinstance(e, SessionClosed)]
    assert close.status == "completed"


class _DeadLettersRefused:
    """Test double around the worker's real publisher: its first ``times`` dead-letter publishes
    fail as if the log had no ack for them (the nats-server itself stays up and real)."""

    def __init__(self, inner: Publisher, times: int) -> None:
        self._inner = inner
        self._times = times
        self.tries = 0

    async def publish(self, event: Event) -> PublishReceipt:
        return await self._inner.publish(event)

    async def publish_many(self, events: Sequence[Event]) -> list[PublishReceipt]:
        return await self._inner.publish_many(events)

    async def publish_raw(self, subject: str, payload: bytes, msg_id: str) -> PublishReceipt:
        if subject.startswith("ts.dlq."):
            self.tries += 1
            if self.tries <= self._times:
                raise EventLogUnavailable(f"test double: no ack for {msg_id}")
        return await self._inner.publish_raw(subject, payload, msg_id)


def _missing_turn_1(session: str) -> list[SessionEvent]:
    return [
        e
        for e in session_events(append_only(3), session=session)
        if not (isinstance(e, TurnCompleted) and e.turn == 1)
    ]


LAST_TRY = FoldWorkerSettings(
    max_deliver=2, backoff_s=(0.05,), ack_wait_s=5.0, fetch_timeout_s=0.2, concurrency=4
)


async def test_a_dead_letter_refused_on_the_last_delivery_is_retried_until_stored(
    log: Log,
) -> None:
    """Delivery max_deliver fails (a turn is missing) and the log refuses the first dead letter:
    a nak there was the close's last delivery, and the close vanished without a trace."""
    await publish_events(log.nc, _missing_turn_1("missing"))
    refused: list[_DeadLettersRefused] = []

    def wrap(pub: Publisher) -> Publisher:
        refused.append(_DeadLettersRefused(pub, times=1))
        return refused[0]

    async with running(log, LAST_TRY, publisher=wrap) as (worker, _):
        await eventually(
            lambda: worker.loop.stats.dead_letters == {"missing_turns": 1}, 10, "letter"
        )

    assert refused[0].tries == 2
    [letter] = await dead_letters(log.js)
    assert (letter.reason, letter.session) == ("missing_turns", "missing")
    assert letter.deliveries == LAST_TRY.max_deliver  # retried in process, not redelivered
    info = await log.js.consumer_info("EVENTS", "fold")
    assert info.num_ack_pending == 0 and info.num_pending == 0


async def test_a_worker_stopped_while_its_last_dead_letter_is_refused_hands_the_close_on(
    log: Log,
) -> None:
    """The worker stops while the log refuses every dead letter of the close's delivery
    max_deliver; the consumer's spare delivery brings it to the next worker."""
    await publish_events(log.nc, _missing_turn_1("missing"))
    refusing: list[_DeadLettersRefused] = []

    def wrap(pub: Publisher) -> Publisher:
        # ~5 s of refusals at the 0.05 s retry delay: bounded, so a stop held by them ends.
        refusing.append(_DeadLettersRefused(pub, times=100))
        return refusing[0]

    async with running(log, LAST_TRY, publisher=wrap) as (first, _):
        await eventually(lambda: refusing[0].tries >= 3, 10, "dead letter retried in process")
        stopped_at = time.monotonic()
    assert time.monotonic() - stopped_at < 2.0  # the stop was not held by the refused letter
    assert first.loop.stats.dead_letters == {}

    async with running(log, LAST_TRY) as (second, _):
        await eventually(
            lambda: second.loop.stats.dead_letters == {"missing_turns": 1}, 10, "letter"
        )
    [letter] = await dead_letters(log.js)
    assert letter.deliveries == LAST_TRY.max_deliver + 1


class _MarkerLostOnce(FoldWorker):
    """Test double: the first fold-marker write fails, as when nats-server (or the worker) dies
    right after JetStream acknowledged the trajectories; the server stays up and real."""

    lost = 0

    async def _write_marker(self, key: str, marker: FoldMarker) -> None:
        if not self.lost:
            self.lost += 1
            raise EventLogUnavailable(f"test double: marker {key} lost")
        await super()._write_marker(key, marker)


class _TrajectoriesCut:
    """Test double around the worker's real publisher: the first batch of trajectories stops
    after its first one is stored, as if the worker died there (the server stays real)."""

    def __init__(self, inner: Publisher) -> None:
        self._inner = inner
        self.cut = False

    async def publish(self, event: Event) -> PublishReceipt:
        return await self._inner.publish(event)

    async def publish_many(self, events: Sequence[Event]) -> list[PublishReceipt]:
        if not self.cut and events and isinstance(events[0], TrajectoryReady | CompactTrajectory):
            self.cut = True
            await self._inner.publish_many(events[:1])
            raise EventLogUnavailable("test double: died after the first trajectory's ack")
        return await self._inner.publish_many(events)

    async def publish_raw(self, subject: str, payload: bytes, msg_id: str) -> PublishReceipt:
        return await self._inner.publish_raw(subject, payload, msg_id)


@pytest.mark.parametrize(
    ("fault", "stored_before"), [("marker lost", 3), ("publish cut", 1)], ids=str
)
async def test_a_close_redelivered_past_the_duplicate_window_publishes_each_trajectory_once(
    log: Log, fault: str, stored_before: int
) -> None:
    """The first delivery stores some or all trajectories but never writes the marker; the close
    comes back after TRAJ's duplicate window (shrunk to 0.5 s here, 120 s by default), where the
    Msg-Id no longer absorbs a repeat. Each trajectory must still be in TRAJ exactly once."""
    await provision(log.js, FAST_LOG.model_copy(update={"duplicate_window_s": 0.5}))
    stepwise = session_events(
        append_only(3), session="stepwise", metadata={"fold": {"per_turn": True}}
    )
    await publish_events(log.nc, stepwise)
    settings = FoldWorkerSettings(backoff_s=(1.2,), ack_wait_s=5.0, fetch_timeout_s=0.2)
    worker_type = _MarkerLostOnce if fault == "marker lost" else FoldWorker
    wrap: Callable[[Publisher], Publisher] = (
        _TrajectoriesCut if fault == "publish cut" else (lambda pub: pub)
    )

    async with running(log, settings, worker_type=worker_type, publisher=wrap) as (worker, _):
        await eventually(lambda: worker.stats.sessions_folded == 1, 10, "folded on redelivery")

    ids = Counter(t.trajectory_id for t in await trajectories(log.js))
    assert ids == {f"{RUN}/stepwise/{i}": 1 for i in range(3)}
    assert worker.loop.stats.retried == 1
    assert worker.stats.already_published == stored_before
    marker = await (await log.js.key_value("ts_folded")).get(f"{RUN}.stepwise")
    assert msgspec.json.decode(marker.value or b"")["trajectories"] == 3


async def test_untrusted_events_are_dead_lettered_with_their_reason_and_never_folded(
    log: Log,
) -> None:
    """DESIGN §3 "Trusting the log": a close whose subject names another session, a turn
    forged without a Msg-Id (dated earlier than the real one), a second different turn 0 under
    its own Msg-Id, a close without a Msg-Id — each dead-lettered with its reason while good
    sessions flow, and none of them changes a trajectory."""
    good = good_sessions(2)
    await publish_events(log.nc, [e for s in good for e in s])
    # A close for session g6 stored under session other6's subject.
    mismatched = session_events(append_only(1), session="g6")
    await publish_events(log.nc, mismatched[:-1])
    await publish_raw(
        log, f"ts.ev.{RUN}.other6.close", Codec().encode(mismatched[-1]), "other6-close"
    )
    # A live session, then a forged turn 0 by anyone: no Msg-Id, an earlier created_at.
    forged_session = session_events(append_only(2), session="forged")
    await publish_events(log.nc, forged_session[:-1])
    real_turn0 = next(e for e in forged_session if isinstance(e, TurnCompleted) and e.turn == 0)
    fake_turn0 = msgspec.structs.replace(
        real_turn0, completion_ids=real_turn0.completion_ids[::-1].copy(), created_at=1.0
    )
    await log.js.publish(route(fake_turn0).subject, Codec().encode(fake_turn0))
    # A different turn 0 with a Msg-Id of its own (past the duplicate window, say).
    await publish_raw(log, route(fake_turn0).subject, Codec().encode(fake_turn0), "other-id")
    await publish_events(log.nc, forged_session[-1:])
    # A close with no Msg-Id.
    anonymous = session_events(append_only(1), session="anonymous")
    await publish_events(log.nc, anonymous[:-1])
    await log.js.publish(route(anonymous[-1]).subject, Codec().encode(anonymous[-1]))

    async with running(log) as (worker, _):
        await until_trajectories(log, 3)
        await eventually(lambda: sum(worker.loop.stats.dead_letters.values()) == 4, 15, "4")

    assert worker.loop.stats.dead_letters == {
        "subject_mismatch": 1,
        "no_msg_id": 2,
        "conflicting_turn": 1,
    }
    letters = await dead_letters(log.js)
    by_reason = {(letter.reason, letter.subject) for letter in letters}
    assert by_reason == {
        ("subject_mismatch", f"ts.ev.{RUN}.other6.close"),
        ("no_msg_id", route(fake_turn0).subject),
        ("conflicting_turn", route(fake_turn0).subject),
        ("no_msg_id", route(anonymous[-1]).subject),
    }
    folded = {t.session: t for t in await trajectories(log.js)}
    assert sorted(folded) == ["forged", "good-0", "good-1"]  # g6, anonymous: not folded
    want = fold(forged_session).trajectories[0]
    assert folded["forged"].input_ids.tolist() == want.input_ids.tolist()  # the real turn 0
    assert folded["forged"].metadata["conflicting_turns"] == 1
    assert "conflicting_turns" not in folded["good-0"].metadata
