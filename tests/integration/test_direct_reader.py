"""A held ``DirectReader`` against a real nats-server: many reads at once on its one inbox
subscription, each getting only its own answers; a cancelled, closed or disconnected read
leaving nothing behind (issue 36: the gateway's catch-up reads).

Where a test needs answers in an order JetStream would not give on demand (interleaved across
reads, late, malformed), a core NATS subscriber on ``$JS.API.DIRECT.GET.FAKE`` of the same
server takes the reads' requests and answers them as a stream would: stored messages with their
``Nats-Sequence`` / ``Nats-Subject`` headers, then a status.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
from nats.aio.msg import Msg

from eventlog import DirectReader, JetStreamPublisher, connect
from schemas import EventLogUnavailable, route
from tests.conftest import FAST_LOG, Log
from tests.helpers.sessions import append_only, session_events
from tests.helpers.waiting import eventually

pytestmark = pytest.mark.integration

FAKE = "$JS.API.DIRECT.GET.FAKE"


class FakeStream:
    """Takes the direct-get requests sent to stream FAKE; answers only when told."""

    def __init__(self) -> None:
        self.requests: list[Msg] = []

    async def take(self, msg: Msg) -> None:
        self.requests.append(msg)

    def session_of(self, request: Msg) -> str:
        return str(json.loads(request.data)["next_by_subj"]).split(".")[3]


@pytest.fixture
async def fake(log: Log) -> AsyncIterator[FakeStream]:
    stream = FakeStream()
    sub = await log.nc.subscribe(FAKE, cb=stream.take)
    yield stream
    await sub.unsubscribe()


@pytest.fixture
async def reader(log: Log) -> AsyncIterator[DirectReader]:
    async with DirectReader(log.nc) as held:
        yield held


async def stored(log: Log, reply: str, seq: int, session: str, data: bytes) -> None:
    headers = {"Nats-Sequence": str(seq), "Nats-Subject": f"ts.ev.run.{session}.turn"}
    await log.nc.publish(reply, data, headers={**headers, "Nats-Msg-Id": f"run.{session}.{seq}"})


async def status(log: Log, reply: str, code: str, **headers: str) -> None:
    await log.nc.publish(reply, b"", headers={"Status": code, **headers})


def reading(reader: DirectReader, session: str, timeout_s: float) -> asyncio.Task[list[bytes]]:
    """A read of ``session``'s subjects in FAKE, running; its messages' data when done."""

    async def read() -> list[bytes]:
        found = await reader.read_after("FAKE", f"ts.ev.run.{session}.*", timeout_s=timeout_s)
        return [m.data for m in found]

    return asyncio.create_task(read())


async def test_many_reads_at_once_on_one_reader_each_get_their_own_session(
    log: Log, reader: DirectReader
) -> None:
    sessions = {f"c{i}": session_events(append_only(1 + i % 5), session=f"c{i}") for i in range(24)}
    pub = await JetStreamPublisher(log.nc).start()
    receipts = await pub.publish_many([e for events in sessions.values() for e in events])
    await pub.close()
    seq = {r.msg_id: r.seq for r in receipts}
    run = sessions["c0"][0].run

    # All 72 reads at once: each session whole, from its middle in batches of 2 (continuations
    # under fresh tokens), and after its last event (nothing).
    wholes, halves, tails = await asyncio.gather(
        asyncio.gather(*(reader.read_session(run, s) for s in sessions)),
        asyncio.gather(
            *(
                reader.read_session_messages(
                    run, s, after_seq=seq[route(e[len(e) // 2]).msg_id], batch=2
                )
                for s, e in sessions.items()
            )
        ),
        asyncio.gather(
            *(
                reader.read_session_after(run, s, seq[route(e[-1]).msg_id])
                for s, e in sessions.items()
            )
        ),
    )

    for (session, events), got, half, tail in zip(
        sessions.items(), wholes, halves, tails, strict=True
    ):
        assert [route(e).msg_id for e in got] == [route(e).msg_id for e in events], session
        assert [m.msg_id for m in half] == [route(e).msg_id for e in events[len(events) // 2 + 1 :]]
        assert (tail.events, tail.last_seq) == ([], seq[route(events[-1]).msg_id])
    assert reader.in_flight == 0


async def test_answers_interleaved_across_reads_reach_only_their_own_read(
    log: Log, reader: DirectReader, fake: FakeStream
) -> None:
    reads = {session: reading(reader, session, 30) for session in ("a", "b", "c")}
    await eventually(lambda: len(fake.requests) == 3, 10, "the three requests reach the stream")
    assert reader.in_flight == 3

    for n in (1, 2):  # each read's first message, then each one's second
        for i, request in enumerate(fake.requests):
            session = fake.session_of(request)
            await stored(log, request.reply, 10 * n + i, session, f"{session}{n}".encode())
    # An answer under a token no read holds (a read long gone): dropped.
    stray = fake.requests[0].reply.rpartition(".")[0] + ".999999"
    await stored(log, stray, 99, "a", b"stray")
    for request in reversed(fake.requests):
        await status(log, request.reply, "204", **{"Nats-Num-Pending": "0"})

    got = {session: await read for session, read in reads.items()}
    assert got == {s: [f"{s}1".encode(), f"{s}2".encode()] for s in ("a", "b", "c")}
    assert reader.in_flight == 0


async def test_a_cancelled_read_leaves_no_state_and_its_late_answers_reach_no_one(
    log: Log, reader: DirectReader, fake: FakeStream
) -> None:
    gone = reading(reader, "gone", 30)
    await eventually(lambda: len(fake.requests) == 1, 10, "the request reaches the stream")
    assert reader.in_flight == 1

    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert reader.in_flight == 0

    # Its answers come after all, then another read on the same reader: only its own.
    late = fake.requests[0].reply
    await stored(log, late, 1, "gone", b"late")
    await status(log, late, "204", **{"Nats-Num-Pending": "0"})
    after = reading(reader, "next", 30)
    await eventually(lambda: len(fake.requests) == 2, 10, "the next request reaches the stream")
    await stored(log, fake.requests[1].reply, 2, "next", b"mine")
    await status(log, fake.requests[1].reply, "404")
    assert await after == [b"mine"]
    assert reader.in_flight == 0


async def test_a_malformed_answer_or_an_error_status_fails_only_that_read_named(
    log: Log, reader: DirectReader, fake: FakeStream
) -> None:
    malformed, refused, fine = (reading(reader, s, 30) for s in ("bad", "err", "ok"))
    await eventually(lambda: len(fake.requests) == 3, 10, "the requests reach the stream")
    replies = {fake.session_of(r): r.reply for r in fake.requests}

    await log.nc.publish(replies["bad"], b"no headers at all")
    await status(log, replies["err"], "408", Description="Bad Request")
    await stored(log, replies["ok"], 5, "ok", b"ok")
    await status(log, replies["ok"], "204", **{"Nats-Num-Pending": "0"})

    with pytest.raises(
        EventLogUnavailable, match=r"reading ts\.ev\.run\.bad\.\* in FAKE: an answer"
    ):
        await malformed
    with pytest.raises(
        EventLogUnavailable, match=r"ts\.ev\.run\.err\.\* in FAKE at seq 1: JetStream answered 408"
    ):
        await refused
    assert await fine == [b"ok"]
    assert reader.in_flight == 0


async def test_a_read_with_no_answer_times_out_named_and_leaves_no_state(
    reader: DirectReader, fake: FakeStream
) -> None:
    with pytest.raises(EventLogUnavailable, match=r"session run/s in FAKE at seq 8: .*0\.2 s"):
        await reader.read_session_messages("run", "s", stream="FAKE", after_seq=7, timeout_s=0.2)
    assert reader.in_flight == 0
    # 404: nothing after the sequence, on the real stream.
    assert await reader.read_session_messages("run", "nobody") == []


async def test_closing_the_reader_fails_its_waiting_reads_at_once(
    log: Log, fake: FakeStream
) -> None:
    reader = await DirectReader(log.nc).start()
    waiting = reading(reader, "w", 60)
    await eventually(lambda: len(fake.requests) == 1, 10, "the request reaches the stream")

    await reader.close()

    with pytest.raises(
        EventLogUnavailable, match=r"ts\.ev\.run\.w\.\* in FAKE: the reader was closed"
    ):
        await waiting
    with pytest.raises(EventLogUnavailable, match="not started"):
        await reader.read_session("run", "w")


async def test_a_lost_connection_is_an_unavailable_log(log: Log) -> None:
    nc = await connect(log.server.url, FAST_LOG, name="closing")
    reader = await DirectReader(nc).start()
    await nc.close()

    with pytest.raises(EventLogUnavailable, match=r"session run/s in EVENTS at seq 1: .*Closed"):
        await reader.read_session_after("run", "s")
    with pytest.raises(EventLogUnavailable, match="cannot subscribe"):
        await DirectReader(nc).start()
    await reader.close()


async def test_a_held_reader_reads_on_after_the_server_restarts(log: Log) -> None:
    events = session_events(append_only(3), session="kept")
    pub = await JetStreamPublisher(log.nc).start()
    await pub.publish_many(events)
    await pub.close()
    reader = await DirectReader(log.nc).start()
    try:
        before = await reader.read_session(events[0].run, "kept")
        log.server.restart()
        await eventually(lambda: log.nc.stats["reconnects"] >= 1, 20, "the client reconnects")
        await eventually(lambda: log.nc.is_connected, 20, "the client is connected again")
        # Its inbox subscription was made again on the new connection: the read is answered.
        after = await reader.read_session(events[0].run, "kept")
    finally:
        await reader.close()
    assert [route(e).msg_id for e in after] == [route(e).msg_id for e in before]
    assert len(after) == len(events)
