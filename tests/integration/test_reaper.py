"""The reaper's bookkeeping against a real nats-server: forgetting entries, and sessions whose
entry was forgotten before a late event came."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import msgspec
import pytest
from nats.js.errors import NoKeysError

from consumers import Reaper, ReaperSettings
from eventlog import JetStreamPublisher, connect
from eventlog.connection import reconnects
from tests.conftest import FAST_LOG, Log
from tests.helpers.sessions import RUN, append_only, reward, session_events
from tests.helpers.streams import publish_events, stream_payloads
from tests.helpers.waiting import eventually

pytestmark = pytest.mark.integration

LATER = 2 * 3600.0  # past forget_closed_after_s (1 h) and idle_timeout_s (30 min)


@contextlib.asynccontextmanager
async def reapers(log: Log, n: int) -> AsyncIterator[list[Reaper]]:
    """``n`` reapers on their own connections, attached but not running: the test drives
    ``track`` and ``scan``."""
    nc = await connect(log.server.url, FAST_LOG, name="reapers")
    pub = await JetStreamPublisher(nc).start()
    made = [Reaper(nc.jetstream(), pub, ReaperSettings()) for _ in range(n)]
    try:
        yield made
    finally:
        await pub.close()
        await nc.close()


async def track_all(reaper: Reaper) -> None:
    while await reaper.loop.step(256, 0.5):
        pass


async def test_reapers_forgetting_the_same_entries_at_once_both_finish_their_scans(
    log: Log,
) -> None:
    sessions = [session_events(append_only(1), session=f"done-{i}") for i in range(20)]
    await publish_events(log.nc, [e for s in sessions for e in s])
    async with reapers(log, 2) as (a, b):
        await a.attach()
        await b.attach()
        await track_all(a)
        now = time.time() + LATER
        # Both read the bucket, then both compare-and-delete the same 20 entries.
        await asyncio.gather(a.scan(now=now), b.scan(now=now))
        assert a.stats.forgotten + b.stats.forgotten == 20
    bucket = await log.js.key_value("ts_sessions")
    with pytest.raises(NoKeysError):  # nats-py's word for an empty bucket
        await bucket.keys()


async def test_a_late_event_after_the_entry_was_forgotten_gets_no_second_close(
    log: Log,
) -> None:
    await publish_events(log.nc, session_events(append_only(2), session="done"))
    async with reapers(log, 1) as (reaper,):
        await reaper.attach()
        await track_all(reaper)
        await reaper.scan(now=time.time() + LATER)
        assert reaper.stats.forgotten == 1  # closed long ago: its entry is gone

        await publish_events(
            log.nc, [reward(0.5, session="done", key="late", created_at=time.time())]
        )
        await track_all(reaper)  # a fresh entry, open as far as it knows
        assert await reaper.scan(now=time.time() + LATER) == 0
        assert reaper.stats.closed_before == 1

    closes = [s for _, s, _ in await stream_payloads(log.js, "EVENTS") if s.endswith(".close")]
    assert closes == [f"ts.ev.{RUN}.done.close"]  # the gateway's, no timeout close after it
    entry = await (await log.js.key_value("ts_sessions")).get(f"{RUN}.done")
    assert msgspec.json.decode(entry.value or b"")["close_seq"] > 0  # forgotten again later


async def test_an_outage_of_the_log_is_not_idle_time(log: Log) -> None:
    """Agents cannot add events while nats-server is down: a session idle only because of the
    outage is not reaped when it ends, but a full idle timeout after the reaper saw it end."""
    await publish_events(log.nc, session_events(append_only(1), session="busy", close=False))
    nc = await connect(log.server.url, FAST_LOG, name="reaper")
    pub = await JetStreamPublisher(nc).start()
    reaper = Reaper(nc.jetstream(), pub, ReaperSettings(idle_timeout_s=2.0))
    try:
        await reaper.attach()
        await track_all(reaper)
        await asyncio.sleep(2.5)  # idle past the timeout by its last event
        log.server.kill()
        log.server.restart()
        await eventually(lambda: reconnects(nc.jetstream()) > 0, 15, "the reaper reconnected")
        assert await reaper.scan() == 0  # the log just came back: not idle yet
        await asyncio.sleep(2.1)
        assert await reaper.scan() == 1  # idle for a full timeout since the comeback
    finally:
        await pub.close()
        await nc.close()
