"""The log side of the agent-loop integration, verl-free, on a real nats-server: one TRAJ feed
routing trajectories to the sessions waited for, shared per event loop, and the weight-version
helper a trainer calls after each weight sync, followed by a gateway's PolicyVersion."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest

from consumers import fold
from eventlog import Bucket
from gateway.backends.policy_watch import PolicyVersion, watch_policy
from schemas.codec import Codec
from schemas.events import TrajectoryReady
from schemas.ids import traj_subject
from tests.conftest import Log
from tests.helpers.sessions import TurnSpec, append_only, session_events
from tests.helpers.waiting import eventually
from turnstream.integrations.errors import GatewayUnavailable, WeightVersionError
from turnstream.integrations.policy import (
    publish_weight_version,
    publish_weight_version_async,
)
from turnstream.integrations.rollouts import RolloutSettings, SharedRollouts
from turnstream.integrations.sessions import GatewaySessions
from turnstream.integrations.trajectories import TrajectoryFeed

pytestmark = pytest.mark.integration

RUN = "feed"


def folded(session: str, reward: float, *, fork: bool = False) -> list[TrajectoryReady]:
    specs = append_only(2)
    if fork:  # a second turn that does not continue the first: two segments
        specs = [specs[0], TurnSpec(prompt=[9, 9], completion=[1], weight_version=1)]
    events = session_events(specs, run=RUN, session=session, group="g", final_reward=reward)
    return fold(events).trajectories


async def publish(log: Log, trajectories: list[TrajectoryReady], suffix: str = "") -> None:
    codec = Codec()
    for t in trajectories:
        msg_id = t.trajectory_id + suffix
        await log.js.publish(traj_subject(t.run), codec.encode(t), headers={"Nats-Msg-Id": msg_id})


async def test_the_feed_routes_each_session_its_segments_from_where_it_started(log: Log) -> None:
    # Stored before the feed opened (another Msg-Id, or the stream would drop the later copy as
    # a duplicate): never delivered, a new episode never waits for the past.
    await publish(log, folded("a", reward=9.0), suffix="-earlier")
    feed = await TrajectoryFeed.open(log.server.url, RUN, log.settings)
    try:
        with feed.expecting("a") as a, feed.expecting("b") as b:
            a_segments, b_segments = folded("a", 1.0, fork=True), folded("b", 2.0)
            others = folded("c", 3.0)
            # Bytes that are no trajectory, for a session waited for: skipped, counted (before
            # a's last segment: the feed takes messages in order, so it is seen while a waits).
            await log.js.publish(traj_subject(RUN), b"junk", headers={"Nats-Msg-Id": "feed/a/7"})
            mixed = [a_segments[1], *others, *b_segments, a_segments[1], a_segments[0]]
            await publish(log, mixed)
            got_a = await a.wait(10, where=feed.where)
            got_b = await b.wait(10)
        assert [(t.trajectory_id, t.reward) for t in got_a] == [
            ("feed/a/0", 1.0),
            ("feed/a/1", 1.0),
        ]
        assert [t.trajectory_id for t in got_b] == ["feed/b/0"]
        assert feed.undecodable == 1
        assert feed.router.waiting == 0
    finally:
        await feed.close()


async def test_samples_on_one_event_loop_share_one_feed(log: Log) -> None:
    shared = SharedRollouts()
    settings = RolloutSettings(
        gateway_url="http://127.0.0.1:9", log_url=log.server.url, run=RUN, log=log.settings
    )
    try:
        many = await asyncio.gather(*(shared.get(settings) for _ in range(8)))
        assert len({id(r.feed) for r in many}) == 1
        assert len({id(r.sessions) for r in many}) == 1
        other_run = await shared.get(settings.model_copy(update={"run": "other"}))
        assert other_run.feed is not many[0].feed
        assert shared.feeds() == 2
    finally:
        await shared.aclose()
    assert shared.feeds() == 0


async def test_a_feed_on_an_unreachable_log_fails_and_the_next_sample_tries_again(
    log: Log,
) -> None:
    shared = SharedRollouts()
    fast = log.settings.model_copy(update={"connect_wait_s": 0.3})
    settings = RolloutSettings(
        gateway_url="http://127.0.0.1:9", log_url="nats://127.0.0.1:9", run=RUN, log=fast
    )
    with pytest.raises(Exception, match=r"127\.0\.0\.1:9"):
        await shared.get(settings)
    assert shared.feeds() == 0
    rollouts = await shared.get(settings.model_copy(update={"log_url": log.server.url}))
    assert rollouts.feed.run == RUN
    await shared.aclose()


async def test_weight_versions_reach_a_gateway_that_follows_them(log: Log) -> None:
    kv = await Bucket.open(log.js, "ts_policy")
    served = PolicyVersion()
    watch = asyncio.create_task(watch_policy(kv, "trainer", served, retry_delay_s=0.1))
    try:
        url = log.server.url
        assert await publish_weight_version_async(url, "trainer", 3, log_settings=log.settings)
        await eventually(lambda: served.weight_version == 3, 10, "the gateway at version 3")
        entry = await kv.get("trainer")
        assert entry is not None and json.loads(entry.value) == {"version": 3}
        # Again: nothing to do. Older: refused, naming why, instead of ignored by gateways.
        assert not await publish_weight_version_async(url, "trainer", 3, log_settings=log.settings)
        with pytest.raises(WeightVersionError, match="newer than 2"):
            await publish_weight_version_async(url, "trainer", 2, log_settings=log.settings)
        # The synchronous flavour (verl's trainer loop), here called with a loop running.
        assert publish_weight_version(url, "trainer", 4, log_settings=log.settings)
        await eventually(lambda: served.weight_version == 4, 10, "the gateway at version 4")
        with pytest.raises(ValueError, match="non-negative"):
            await publish_weight_version_async(url, "trainer", -1, log_settings=log.settings)
    finally:
        watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch


async def test_a_restarted_feed_goes_on_from_where_it_began_not_from_the_runs_start(
    log: Log,
) -> None:
    """nats-py restarts an ordered consumer after a gap or a reconnect from the last sequence it
    delivered; before the first message that was 0, a replay of the run's whole TRAJ history.
    The restart is called here as nats-py calls it (its internals: no gap can be forced)."""
    await publish(log, [t for s in ("x", "y", "z") for t in folded(s, 1.0)])
    feed = await TrajectoryFeed.open(log.server.url, RUN, log.settings)
    try:
        with feed.expecting("x") as x:  # its earlier trajectory must not come back
            jsi = feed._following._subscription._sub._jsi  # type: ignore[union-attr]
            await jsi.reset_ordered_consumer(jsi._sseq + 1)
            later = folded("w", 2.0)
            with feed.expecting("w") as w:
                await publish(log, later)
                assert [t.reward for t in await w.wait(10)] == [2.0]
            assert x.received == []
    finally:
        await feed.close()


async def test_an_unreachable_gateway_is_named_with_what_to_check() -> None:
    sessions = GatewaySessions("http://127.0.0.1:9", tries=1)
    try:
        with pytest.raises(GatewayUnavailable, match=r"127\.0\.0\.1:9.*turnstream up"):
            await sessions.open(run=RUN, group=None, metadata={})
    finally:
        await sessions.aclose()
