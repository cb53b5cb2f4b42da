"""Reading a session back from the EVENTS stream: only its events, in stream order."""

from __future__ import annotations

import asyncio

import pytest

from consumers import fold
from eventlog import JetStreamPublisher, read_session, read_session_messages
from schemas import route
from schemas.errors import EventLogUnavailable
from tests.conftest import Log
from tests.helpers.sessions import append_only, session_events

pytestmark = pytest.mark.integration


async def test_a_session_reads_back_exactly_and_folds_like_the_original(log: Log) -> None:
    mine = session_events(append_only(6), session="mine")
    other = session_events(append_only(3), session="other")
    interleaved = [e for pair in zip(mine, other, strict=False) for e in pair] + mine[len(other) :]
    pub = await JetStreamPublisher(log.nc).start()
    await pub.publish_many(interleaved)
    await pub.close()

    events = await read_session(log.js, mine[0].run, "mine")

    assert [route(e).msg_id for e in events] == [route(e).msg_id for e in mine]
    assert fold(events).trajectories[0].input_ids.tolist() == (
        fold(mine).trajectories[0].input_ids.tolist()
    )


async def test_an_unknown_session_reads_back_empty(log: Log) -> None:
    assert await read_session(log.js, "run", "nobody") == []


async def test_a_session_longer_than_one_batch_reads_back_whole(log: Log) -> None:
    events = session_events(append_only(7), session="long")
    noise = session_events(append_only(2), session="noise")
    pub = await JetStreamPublisher(log.nc).start()
    await pub.publish_many([*events[:4], *noise, *events[4:]])
    await pub.close()

    small = await read_session_messages(log.js, events[0].run, "long", batch=2)
    tiny_bursts = await read_session_messages(log.js, events[0].run, "long", max_bytes=1)
    whole = await read_session_messages(log.js, events[0].run, "long")

    assert small == whole == tiny_bursts
    assert len(whole) == len(events)
    assert [m.seq for m in whole] == sorted(m.seq for m in whole)
    assert all(m.subject.startswith(f"ts.ev.{events[0].run}.long.") for m in whole)


async def test_concurrent_reads_on_one_connection_each_get_their_own_session(log: Log) -> None:
    sessions = {f"c{i}": session_events(append_only(1 + i % 4), session=f"c{i}") for i in range(24)}
    pub = await JetStreamPublisher(log.nc).start()
    await pub.publish_many([e for events in sessions.values() for e in events])
    await pub.close()

    read = await asyncio.gather(*(read_session(log.js, e[0].run, s) for s, e in sessions.items()))

    for events, (session, published) in zip(read, sessions.items(), strict=True):
        assert [route(e).msg_id for e in events] == [route(e).msg_id for e in published], session


async def test_an_answer_that_never_comes_or_an_error_status_is_a_named_failure(log: Log) -> None:
    silent = await log.nc.subscribe("$JS.API.DIRECT.GET.SILENT")  # takes requests, answers none
    try:
        with pytest.raises(EventLogUnavailable, match=r"session run/s in SILENT at seq 1: .*0\.3"):
            await read_session_messages(log.js, "run", "s", stream="SILENT", timeout_s=0.3)
    finally:
        await silent.unsubscribe()
    # No stream answers at all: the server's "no responders" status, named.
    with pytest.raises(EventLogUnavailable, match=r"session run/s in NOPE at seq 1: .*503"):
        await read_session_messages(log.js, "run", "s", stream="NOPE", timeout_s=2)
