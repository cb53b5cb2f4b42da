"""The event log against a real nats-server: provisioning, publishing through faults, outbox.

Faults are real: the server process is SIGKILLed and restarted on the same store, or frozen
with SIGSTOP. What a publisher acknowledged must be in the stream exactly once afterwards.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import pytest
from nats.js import api as js_api

from eventlog import (
    JetStreamPublisher,
    LogSettings,
    Outbox,
    PublisherSettings,
    connect,
    provision,
)
from eventlog.buckets import Bucket, Entry
from eventlog.pull import ConsumerSpec
from schemas import (
    EventLogUnavailable,
    PayloadTooLarge,
    ProvisioningError,
    SessionOpened,
    TurnCompleted,
    route,
)
from tests.conftest import Log
from tests.helpers.waiting import eventually

pytestmark = pytest.mark.integration

# Enough patience to ride out a server restart: 10 tries x 1 s ack timeout.
PATIENT = PublisherSettings(ack_timeout_s=1.0, max_attempts=10, backoff_max_s=0.5)


def turn(session: str, index: int = 0, tokens: int = 16) -> TurnCompleted:
    return TurnCompleted(
        run="run",
        session=session,
        turn=index,
        prompt_ids=list(range(tokens)),
        completion_ids=list(range(tokens)),
        logprobs=[-0.5] * tokens,
    )


async def stored_msg_ids(log: Log, stream: str = "EVENTS") -> list[str]:
    """The Nats-Msg-Id of every message in ``stream``, in stream order."""
    info = await log.js.stream_info(stream)
    ids = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        msg = await log.js.get_msg(stream, seq)
        ids.append((msg.headers or {})["Nats-Msg-Id"])
    return ids


# -- provisioning -------------------------------------------------------------------------------


async def test_provisioning_twice_changes_nothing(log: Log) -> None:
    streams = ("EVENTS", "TRAJ", "DLQ", "KV_ts_policy", "OBJ_ts_images")
    before = {s: await log.js.stream_info(s) for s in streams}
    await log.js.publish("ts.ev.run.s.open", b"x")

    actions = await provision(log.js, log.settings)

    assert {a.action for a in actions} == {"unchanged"}
    assert len(actions) == 8  # 3 streams, 4 KV buckets, the image bucket
    for name, info in before.items():
        after = await log.js.stream_info(name)
        assert after.config == info.config, name
        assert after.created == info.created, name
    assert (await log.js.stream_info("EVENTS")).state.messages == 1  # data untouched


async def test_provisioning_rides_out_a_server_restart_longer_than_its_timeout(log: Log) -> None:
    # A service starting while nats-server restarts: its first requests time out (1 s here)
    # while the server is down; provisioning asks again once the connection is back.
    impatient = log.nc.jetstream(timeout=1.0)
    log.server.kill()
    provisioning = asyncio.create_task(provision(impatient, log.settings))
    await asyncio.sleep(1.5)  # the first try's request has timed out by now
    assert not provisioning.done()
    log.server.restart()

    actions = await asyncio.wait_for(provisioning, 30)

    assert {a.action for a in actions} == {"unchanged"}
    assert len(actions) == 8


async def test_a_bucket_opens_through_a_server_restart_longer_than_its_timeout(log: Log) -> None:
    impatient = log.nc.jetstream(timeout=1.0)
    log.server.kill()
    opening = asyncio.create_task(Bucket.open(impatient, "ts_policy"))
    await asyncio.sleep(1.5)  # the first try's request has timed out by now
    assert not opening.done()
    log.server.restart()

    bucket = await asyncio.wait_for(opening, 30)

    assert await bucket.get("no-such-key") is None  # a working bucket


async def test_a_bucket_a_frozen_server_does_not_open_is_not_called_unprovisioned(
    log: Log,
) -> None:
    impatient = log.nc.jetstream(timeout=0.3)
    log.server.pause()
    try:
        with pytest.raises(EventLogUnavailable, match="did not answer") as unanswered:
            await Bucket.open(impatient, "ts_policy")
    finally:
        log.server.resume()
    assert "provisioned" not in str(unanswered.value)
    with pytest.raises(EventLogUnavailable, match="is the log provisioned"):
        await Bucket.open(log.js, "no_such_bucket")


async def test_a_consumer_binds_through_a_server_restart_longer_than_its_timeout(log: Log) -> None:
    # A shard writer restarted while nats-server restarted exited on `cannot bind consumer
    # shard-writer on TRAJ: nats: timeout` (issue 37's soak): binding asks again, like opening.
    impatient = log.nc.jetstream(timeout=1.0)
    spec = ConsumerSpec("TRAJ", "binder", ("ts.traj.run",), max_ack_pending=8, ack_wait_s=5.0)
    log.server.kill()
    binding = asyncio.create_task(spec.bind(impatient))
    await asyncio.sleep(1.5)  # the first try's request has timed out by now
    assert not binding.done()
    log.server.restart()

    subscription = await asyncio.wait_for(binding, 30)

    assert (await log.js.consumer_info("TRAJ", "binder")).config.ack_wait == 5.0
    await subscription.unsubscribe()


async def test_provisioning_applies_changed_settings(log: Log) -> None:
    changed = log.settings.model_copy(update={"events_max_age_s": 3600.0})

    actions = {a.name: a for a in await provision(log.js, changed)}

    assert actions["EVENTS"].action == "updated"
    assert "max_age" in actions["EVENTS"].changed
    assert actions["TRAJ"].action == "unchanged"
    assert (await log.js.stream_info("EVENTS")).config.max_age == 3600.0


async def test_provisioning_refuses_a_storage_change(log: Log) -> None:
    await log.js.delete_stream("TRAJ")
    await log.js.add_stream(name="TRAJ", subjects=["ts.traj.>"], storage=js_api.StorageType.MEMORY)

    with pytest.raises(ProvisioningError, match=r"stream TRAJ uses memory storage.*file"):
        await provision(log.js, log.settings)


# -- publishing ---------------------------------------------------------------------------------


async def test_publish_is_idempotent_per_msg_id(log: Log) -> None:
    pub = await JetStreamPublisher(log.nc).start()
    first = await pub.publish(turn("s1"))
    again = await pub.publish(turn("s1"))
    await pub.close()

    assert (first.stream, first.duplicate) == ("EVENTS", False)
    assert again.duplicate and again.seq == first.seq
    assert await stored_msg_ids(log) == ["run.s1.turn.0"]


async def test_2000_events_through_a_sigkill_and_restart_land_exactly_once(log: Log) -> None:
    events = [turn(f"s{i}", tokens=64) for i in range(2000)]
    pub = await JetStreamPublisher(log.nc, PATIENT).start()
    receipts: list[object] = []

    async def publish_all() -> None:
        # Several concurrent publishers, as a gateway serving many sessions would be.
        async def lane(lane_events: list[TurnCompleted]) -> None:
            for event in lane_events:
                receipts.append(await pub.publish(event))

        await asyncio.gather(*(lane(events[k::8]) for k in range(8)))

    task = asyncio.create_task(publish_all())
    await eventually(lambda: len(receipts) >= 600, 60, "600 events acknowledged")
    log.server.kill()
    acked_before_kill = len(receipts)
    await asyncio.sleep(1.5)  # longer than the ack timeout: publishes in flight are retried
    log.server.restart()
    await asyncio.wait_for(task, 120)
    await pub.close()

    assert acked_before_kill < 2000, "the kill must land mid-way"
    assert len(receipts) == 2000
    assert log.nc.stats["reconnects"] >= 1
    assert pub.stats.retried > 0, "the outage should have outlived some ack timeouts"
    ids = await stored_msg_ids(log)
    assert Counter(ids) == Counter(route(e).msg_id for e in events)  # each exactly once


async def test_a_paused_server_is_detected_and_publishing_resumes(log: Log) -> None:
    pub = await JetStreamPublisher(log.nc, PATIENT).start()
    await pub.publish(turn("before"))

    log.server.pause()
    # 0.5 s pings, 2 unanswered -> the client declares the connection stale within seconds.
    await eventually(lambda: not log.nc.is_connected, 10, "the client notices the frozen server")

    during = asyncio.create_task(pub.publish(turn("during")))
    await asyncio.sleep(1.0)
    assert not during.done(), "a publish cannot be acknowledged by a frozen server"
    log.server.resume()
    receipt = await asyncio.wait_for(during, 60)
    await pub.close()

    assert receipt.stream == "EVENTS" and not receipt.spooled
    assert log.nc.is_connected
    assert await stored_msg_ids(log) == ["run.before.turn.0", "run.during.turn.0"]


async def test_connecting_to_a_frozen_server_fails_with_an_error_that_says_why(log: Log) -> None:
    """Its tries time out: the error names the timeout (it said "at nats://...: ." before, a
    restarted gateway's last words in the soak while nats-server was frozen; issue 38)."""
    quick = LogSettings(connect_wait_s=1.0, connect_timeout_s=0.5)
    log.server.pause()
    try:
        with pytest.raises(EventLogUnavailable, match=r"cannot connect to NATS at \S+: \w*Timeout"):
            await connect(log.server.url, quick)
    finally:
        log.server.resume()


async def test_without_an_outbox_an_unavailable_log_is_an_error(log: Log) -> None:
    quick = PublisherSettings(ack_timeout_s=0.2, max_attempts=2)
    pub = await JetStreamPublisher(log.nc, quick).start()
    log.server.kill()
    try:
        with pytest.raises(EventLogUnavailable, match=r"run\.s\.turn\.0.*after 2 tries"):
            await pub.publish(turn("s"))
        assert pub.stats.failed == 1
    finally:
        await pub.close()
        log.server.restart()


async def test_publishing_to_a_subject_without_a_stream_names_the_fix(log: Log) -> None:
    await log.js.delete_stream("EVENTS")
    quick = PublisherSettings(ack_timeout_s=0.5, max_attempts=2)
    pub = await JetStreamPublisher(log.nc, quick).start()
    with pytest.raises(EventLogUnavailable, match="turnstream provision"):
        await pub.publish(turn("s"))
    await pub.close()


async def test_an_event_over_the_server_limit_is_rejected(log: Log) -> None:
    pub = await JetStreamPublisher(log.nc).start()
    huge = 9 * 1024 * 1024  # the server's max_payload is 8 MiB
    with pytest.raises(PayloadTooLarge, match="bytes"):
        await pub.publish_raw("ts.ev.run.s.turn", b"x" * huge, "run.s.turn.0")
    await pub.close()


async def test_pipelined_publish_returns_receipts_in_order(log: Log) -> None:
    events = [turn(f"p{i}") for i in range(300)]
    pub = await JetStreamPublisher(log.nc, PublisherSettings(max_inflight_bytes=8 * 1024)).start()
    receipts = await pub.publish_many(events)
    await pub.close()

    assert [r.msg_id for r in receipts] == [route(e).msg_id for e in events]
    assert [r.seq for r in receipts] == list(range(1, 301))
    assert await stored_msg_ids(log) == [route(e).msg_id for e in events]


# -- outbox -------------------------------------------------------------------------------------


def outbox_settings(path: Path) -> PublisherSettings:
    return PublisherSettings(
        ack_timeout_s=0.2, max_attempts=2, outbox_path=path, outbox_drain_interval_s=0.1
    )


async def test_outbox_takes_events_while_the_log_is_down_and_drains_in_order(
    log: Log, tmp_path: Path
) -> None:
    settings = outbox_settings(tmp_path / "outbox.log")
    assert settings.outbox_path is not None
    outbox = Outbox(settings.outbox_path, settings.outbox_max_bytes)
    pub = await JetStreamPublisher(log.nc, settings, outbox=outbox).start()
    await pub.publish(SessionOpened(run="run", session="o"))

    log.server.kill()
    down = [turn("o", i) for i in range(10)]
    receipts = [await pub.publish(e) for e in down]
    assert all(r.spooled for r in receipts)
    assert len(outbox) == 10

    log.server.restart()
    # Published while the backlog is still there: must land behind it, not before.
    later = [turn("o", i) for i in range(10, 15)]
    for event in later:
        await pub.publish(event)
    await eventually(lambda: not outbox.pending_bytes, 30, "the outbox drains")
    await pub.close()

    assert outbox.pending_bytes == 0
    assert outbox.path.stat().st_size == 0, "a drained outbox is truncated"
    expected = ["run.o.open"] + [route(e).msg_id for e in down + later]
    assert await stored_msg_ids(log) == expected


async def test_spooled_events_survive_a_publisher_crash(log: Log, tmp_path: Path) -> None:
    settings = outbox_settings(tmp_path / "outbox.log")
    assert settings.outbox_path is not None
    outbox = Outbox(settings.outbox_path, settings.outbox_max_bytes)
    pub = await JetStreamPublisher(log.nc, settings, outbox=outbox).start()
    log.server.kill()
    for i in range(5):
        assert (await pub.publish(turn("c", i))).spooled
    await pub.close()  # the process "dies": nothing drained, the file is all that is left
    outbox.close()

    log.server.restart()
    reopened = Outbox(settings.outbox_path, settings.outbox_max_bytes)
    assert len(reopened) == 5
    pub2 = await JetStreamPublisher(log.nc, settings, outbox=reopened).start()
    assert await pub2.drain_outbox() == 5
    await pub2.close()

    assert await stored_msg_ids(log) == [f"run.c.turn.{i}" for i in range(5)]


async def test_a_full_outbox_refuses_with_a_clear_error(log: Log, tmp_path: Path) -> None:
    from schemas import OutboxFull

    path = tmp_path / "outbox.log"
    settings = PublisherSettings(
        ack_timeout_s=0.2, max_attempts=1, outbox_path=path, outbox_max_bytes=600
    )
    outbox = Outbox(path, settings.outbox_max_bytes)
    pub = await JetStreamPublisher(log.nc, settings, outbox=outbox).start()
    log.server.kill()
    try:
        assert (await pub.publish(turn("f", 0))).spooled
        with pytest.raises(OutboxFull, match=r"run\.f\.turn\.\d.*600-byte limit"):
            for i in range(1, 10):
                await pub.publish(turn("f", i))
        assert pub.stats.failed == 1
    finally:
        await pub.close()
        log.server.restart()


async def test_provision_helper_settings_are_the_fixture_settings(log: Log) -> None:
    # Guards the fixture itself: tests above rely on fast ping settings.
    assert log.settings.ping_interval_s < LogSettings().ping_interval_s


class _WatcherEndsEarly(Bucket):
    """Test double for a race in nats-py's KV watcher (its "nothing to deliver" comes from
    consumer info, racing the deliveries): seen right after a nats-server restart, the snapshot
    ended before its first entry. The bucket and server stay real."""

    async def _watch(self, keys: str, timeout_s: float) -> tuple[list[Entry], set[str]]:
        return [], set()


class _CountingGets(Bucket):
    gets = 0

    async def get(self, key: str) -> Entry | None:
        self.gets += 1
        return await super().get(key)


async def test_a_bucket_snapshot_has_every_key_even_when_the_watcher_ends_early(log: Log) -> None:
    kv = await Bucket.open(log.js, log.settings.names.commits_bucket)
    for n in range(5):
        await kv.put(f"trainer.{n}", b"%d" % n)
    await kv.put("other.0", b"x")
    assert await kv.delete("trainer.4", (await kv.get("trainer.4") or Entry("", b"", 0)).revision)
    expected = {f"trainer.{n}": b"%d" % n for n in range(4)}
    for bucket in (kv, _WatcherEndsEarly(log.js, kv._kv, kv.name)):
        got = await bucket.entries("trainer.>")
        assert {e.key: e.value for e in got} == expected
    # A whole snapshot reads no key on its own, deleted ones included (a reaper scans its bucket,
    # thousands of forgotten sessions, every few seconds).
    counting = _CountingGets(log.js, kv._kv, kv.name)
    assert len(await counting.entries("trainer.>")) == 4
    assert counting.gets == 0
