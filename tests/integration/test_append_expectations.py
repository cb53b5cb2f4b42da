"""Appends that state what they expect, and catch-up reads, against a real nats-server (issue 36).

An expected append carries the session's last stream sequence as the caller knows it; JetStream
refuses it when that is stale (err_code 10071), and the publisher raises ``AppendRefused`` with
the actual last sequence, never retrying or spooling it. ``read_session_after`` reads what a
refused caller must catch up on: the session's events after the sequence it had.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from nats.aio.msg import Msg

from eventlog import (
    AppendRefused,
    Expectation,
    JetStreamPublisher,
    Outbox,
    PublisherSettings,
    SessionTail,
    read_session_after,
    read_session_messages,
)
from eventlog.outbox import OutboxRecord
from schemas import Codec, EventLogUnavailable, SessionOpened, TurnCompleted, route
from tests.conftest import Log

pytestmark = pytest.mark.integration


def turn(session: str, index: int) -> TurnCompleted:
    return TurnCompleted(
        run="run",
        session=session,
        turn=index,
        prompt_ids=[1, 2, 3],
        completion_ids=[4, 5],
        logprobs=[-0.5, -0.25],
    )


def opened(session: str) -> SessionOpened:
    return SessionOpened(run="run", session=session)


def at(session: str, last_seq: int) -> Expectation:
    return Expectation.session("run", session, last_seq)


def ids(tail: SessionTail) -> list[tuple[int, str]]:
    """Each caught-up event's sequence and Msg-Id (decoded events hold arrays: no ``==``)."""
    return [(seq, route(event).msg_id) for seq, event in tail.events]


async def stored(log: Log) -> int:
    return (await log.js.stream_info("EVENTS")).state.messages


async def test_an_append_with_the_right_expectation_lands_and_returns_its_seq(log: Log) -> None:
    pub = await JetStreamPublisher(log.nc).start()
    try:
        first = await pub.publish(opened("s"), expect=at("s", 0))
        second = await pub.publish(turn("s", 0), expect=at("s", first.seq or 0))
    finally:
        await pub.close()
    assert (first.seq, second.seq) == (1, 2)
    assert not second.duplicate
    assert await stored(log) == 2


async def test_a_stale_expectation_is_refused_with_the_actual_last_seq(log: Log) -> None:
    pub = await JetStreamPublisher(log.nc).start()
    try:
        await pub.publish(opened("s"), expect=at("s", 0))
        await pub.publish(turn("s", 0), expect=at("s", 1))  # another gateway's turn 0
        with pytest.raises(AppendRefused, match=r"ts\.ev\.run\.s\.\*.*sequence 1.*is at 2") as exc:
            await pub.publish(turn("s", 1), expect=at("s", 1))  # one that had not seen it
    finally:
        await pub.close()
    refused = exc.value
    assert (refused.last_seq, refused.expected_seq) == (2, 1)
    assert refused.subjects == "ts.ev.run.s.*"
    assert refused.msg_id == route(turn("s", 1)).msg_id
    assert not refused.after_retry
    assert (pub.stats.refused, pub.stats.failed, pub.stats.retried) == (1, 1, 0)  # not retried
    assert await stored(log) == 2, "the refused append stored nothing"


async def test_another_sessions_events_in_between_do_not_disturb_an_expectation(log: Log) -> None:
    pub = await JetStreamPublisher(log.nc).start()
    try:
        mine = await pub.publish(opened("s"), expect=at("s", 0))
        theirs = await pub.publish(opened("t"), expect=at("t", 0))
        await pub.publish(turn("t", 0), expect=at("t", theirs.seq or 0))
        landed = await pub.publish(turn("s", 0), expect=at("s", mine.seq or 0))
    finally:
        await pub.close()
    assert (mine.seq, theirs.seq, landed.seq) == (1, 2, 4)


async def test_republishing_a_stored_event_with_a_stale_expectation_is_refused(log: Log) -> None:
    # Measured on nats-server 2.15.1: the expectation is checked before the Msg-Id's
    # de-duplication, so a stored event sent again with a now-stale expectation is refused,
    # not acknowledged as a duplicate. (A retry after a lost ack meets the same: after_retry.)
    pub = await JetStreamPublisher(log.nc).start()
    try:
        await pub.publish(opened("s"), expect=at("s", 0))
        await pub.publish(turn("s", 0), expect=at("s", 1))
        with pytest.raises(AppendRefused) as exc:
            await pub.publish(opened("s"), expect=at("s", 0))
        again = await pub.publish(opened("s"))  # without one: the duplicate window answers
    finally:
        await pub.close()
    assert exc.value.last_seq == 2
    assert (again.seq, again.duplicate) == (1, True)
    assert await stored(log) == 2


class _LosesAcks(JetStreamPublisher):
    """The real publisher on a real server, but the acks of its first ``lost`` tries never
    arrive (as when the connection drops right after the server stored the event)."""

    lost = 1

    async def _on_ack(self, msg: Msg) -> None:
        if self.lost:
            self.lost -= 1
            return
        await super()._on_ack(msg)


LOSSY = PublisherSettings(ack_timeout_s=0.3, max_attempts=3, backoff_initial_s=0.01)


async def test_a_retry_refused_because_its_lost_first_try_landed_is_that_event(log: Log) -> None:
    pub = await JetStreamPublisher(log.nc).start()
    lossy = await _LosesAcks(log.nc, LOSSY).start()
    try:
        await pub.publish(opened("s"), expect=at("s", 0))
        receipt = await lossy.publish(turn("s", 0), expect=at("s", 1))
    finally:
        await lossy.close()
        await pub.close()
    assert (receipt.seq, receipt.duplicate, receipt.stream) == (2, True, "EVENTS")
    assert (lossy.stats.retried, lossy.stats.refused, lossy.stats.failed) == (1, 0, 0)
    assert await stored(log) == 2, "stored once"


async def test_a_retry_refused_for_another_append_is_still_refused(log: Log) -> None:
    # The sequence moved for another gateway's append, not this one's lost try: after the
    # publisher has looked for its own Msg-Id and not found it, the refusal stands.
    pub = await JetStreamPublisher(log.nc).start()
    await pub.publish(opened("s"), expect=at("s", 0))
    lossy = await _LosesAcks(log.nc, LOSSY).start()
    lossy.lost = 0
    try:
        await pub.publish(turn("s", 0), expect=at("s", 1))  # the other gateway's turn 0
        with pytest.raises(AppendRefused) as exc:
            # expects 1, sees 2: refused on the first try, with no retry to blame
            await lossy.publish(turn("s", 1), expect=at("s", 1))
        assert not exc.value.after_retry
        lossy.lost = 1
        with pytest.raises(AppendRefused) as exc:
            # the first try (lost ack) was refused too; the retry's refusal is looked into
            await lossy.publish(turn("s", 1), expect=at("s", 1))
    finally:
        await lossy.close()
        await pub.close()
    assert exc.value.after_retry
    assert exc.value.last_seq == 2
    assert await stored(log) == 2


async def test_an_expected_append_behind_a_nonempty_outbox_is_unavailable_not_spooled(
    log: Log, tmp_path: Path
) -> None:
    settings = PublisherSettings(outbox_path=tmp_path / "outbox.log", outbox_drain_interval_s=60)
    assert settings.outbox_path is not None
    outbox = Outbox(settings.outbox_path, settings.outbox_max_bytes)
    backlog = opened("s")
    subject, msg_id = route(backlog)
    outbox.append(OutboxRecord(subject, msg_id, Codec().encode(backlog)))
    pub = await JetStreamPublisher(log.nc, settings, outbox=outbox).start()
    try:
        with pytest.raises(EventLogUnavailable, match=r"outbox still holds.*not spooled"):
            await pub.publish(turn("s", 0), expect=at("s", 1))
    finally:
        await pub.close()
        outbox.close()
    assert len(outbox) == 1, "nothing was spooled behind the backlog"
    assert pub.stats.spooled == 0
    assert await stored(log) == 0


async def test_an_expected_append_while_the_log_is_down_is_unavailable_not_spooled(
    log: Log, tmp_path: Path
) -> None:
    settings = PublisherSettings(
        ack_timeout_s=0.2, max_attempts=2, outbox_path=tmp_path / "outbox.log"
    )
    assert settings.outbox_path is not None
    outbox = Outbox(settings.outbox_path, settings.outbox_max_bytes)
    pub = await JetStreamPublisher(log.nc, settings, outbox=outbox).start()
    log.server.kill()
    try:
        with pytest.raises(EventLogUnavailable, match=r"run\.s\.open.*after 2 tries"):
            await pub.publish(opened("s"), expect=at("s", 0))
        assert outbox.pending_bytes == 0, "an expectation cannot be checked for a spooled event"
        assert (pub.stats.spooled, pub.stats.failed) == (0, 1)
    finally:
        await pub.close()
        outbox.close()
        log.server.restart()


async def test_a_catch_up_read_returns_exactly_the_events_after_the_sequence(log: Log) -> None:
    pub = await JetStreamPublisher(log.nc).start()
    try:
        events = [opened("s"), turn("s", 0), opened("t"), turn("s", 1), turn("t", 0), turn("s", 2)]
        seqs = [(await pub.publish(e)).seq for e in events]
    finally:
        await pub.close()
    assert seqs == [1, 2, 3, 4, 5, 6]

    tail = await read_session_after(log.js, "run", "s", 2)
    assert ids(tail) == [(4, "run.s.turn.1"), (6, "run.s.turn.2")]
    assert all(
        isinstance(e, TurnCompleted) and list(e.completion_ids) == [4, 5] for _, e in tail.events
    )
    assert (tail.after_seq, tail.last_seq) == (2, 6)
    # Only what follows is read, not the session from its start.
    assert [m.seq for m in await read_session_messages(log.js, "run", "s", after_seq=2)] == [4, 6]

    whole = await read_session_after(log.js, "run", "s")
    assert ids(whole) == [
        (1, "run.s.open"),
        (2, "run.s.turn.0"),
        (4, "run.s.turn.1"),
        (6, "run.s.turn.2"),
    ]

    nothing = await read_session_after(log.js, "run", "s", 6)
    assert (ids(nothing), nothing.last_seq) == ([], 6)


async def test_the_catch_up_last_seq_counts_untrusted_messages_as_the_log_does(log: Log) -> None:
    # A message without a Msg-Id is not believed (schemas.trust), but JetStream counts it in
    # the session's last sequence: an append must expect it, or it would be refused forever.
    pub = await JetStreamPublisher(log.nc).start()
    try:
        await pub.publish(opened("s"), expect=at("s", 0))
        await log.js.publish("ts.ev.run.s.turn", Codec().encode(turn("s", 0)))  # no Msg-Id
        tail = await read_session_after(log.js, "run", "s", 1)
        assert (ids(tail), tail.last_seq) == ([], 2)
        with pytest.raises(AppendRefused):
            await pub.publish(turn("s", 0), expect=at("s", 1))
        landed = await pub.publish(turn("s", 0), expect=at("s", tail.last_seq))
    finally:
        await pub.close()
    assert landed.seq == 3
    whole = await read_session_after(log.js, "run", "s")
    assert ids(whole) == [(1, "run.s.open"), (3, "run.s.turn.0")]
