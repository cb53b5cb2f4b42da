"""The pipeline on the shipped 3-node NATS cluster survives the loss of the EVENTS leader.

Three nats-servers run ``infra/nats/cluster-node-*.conf`` on localhost (``tests.deploy.cluster``);
``turnstream provision --log.replicas 3`` makes every stream and bucket R3; a gateway (the local
tiny model), two fold workers and a shard writer join with the node list. Agents drive sessions
through the real ``openai`` SDK, retrying faults (``tests.chaos.agents``). Mid-run the node
leading EVENTS is SIGKILLed; the agents keep going on the other two, then it comes back and
catches up. The soak's auditor then checks that every completion a client received is in EVENTS,
token for token, and every closed session's trajectories are in the shards exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import nats.errors
import pytest
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from transformers import AutoTokenizer

from eventlog import Expectation, JetStreamPublisher, LogSettings, connect, read_session
from schemas import SessionOpened, TurnCompleted
from tests.chaos.agents import Agent, AgentSession
from tests.chaos.audit import Auditor, Report, SinkAudit, SinkJournal, audit_sink
from tests.chaos.stack import with_flag
from tests.deploy.cluster import (
    REPLICAS,
    ClusterMember,
    LocalCluster,
    provision,
    wait_pipeline_idle,
)
from tests.helpers.gateway_process import GatewayProcess
from tests.helpers.services import WORKER_FLAGS, WRITER_FLAGS, Service, shard_table_rows

# The NATS image may be built first (minutes on a fresh machine).
pytestmark = [pytest.mark.integration, pytest.mark.timeout(2400)]

RUN = "e2e"  # GatewayProcess's run
AGENTS = 4
WARM_TURNS = 12  # completions before the kill: the whole pipeline is busy by then
DOWN_S = 10.0  # agents keep driving this long on two nodes
AFTER_S = 6.0  # and this long once the third is back
# Ping every 0.5 s: a connection to a dead node is given up within a second.
TEST_LOG = LogSettings(ping_interval_s=0.5, max_outstanding_pings=2, connect_timeout_s=1.0)
STREAMS = ("EVENTS", "TRAJ", "DLQ")
BUCKETS = ("ts_policy", "ts_sessions", "ts_folded", "ts_commits")
OBJECT_BUCKETS = ("ts_images",)  # issue 39: images, replicated like the events

# A session the reaper closes while its agent waits out the election is a story the auditor
# tells apart, but not the one under test: idle means 10 s here. A close whose session cannot
# be read mid-election is retried within seconds and never dead-lettered.
WORKER = WORKER_FLAGS
for _name, _value in (
    ("--reaper.idle-timeout-s", "10"),
    ("--fold.backoff-s", "[0.5,1,2]"),
    ("--fold.max-deliver", "-1"),
):
    WORKER = with_flag(WORKER, _name, _value)


class ShardAuditor(Auditor):
    """The soak's auditor without its sink: no trainer reads TRAJ in this stack."""

    async def _audit_sink(self, journal_path: Path, nats_kills: Sequence[float]) -> SinkAudit:
        return audit_sink({}, SinkJournal(), consumer_acked_all=True)


@dataclass
class Outage:
    """What happened around the kill, for the assertions and the report."""

    victim: str
    was_meta_leader: bool
    turns_before: int
    new_leader: str = ""
    election_s: float = 0.0  # SIGKILL -> EVENTS answers with a leader among the survivors
    meta_election_s: float | None = None  # the same for the meta leader, when it was the victim
    turns_while_down: int = 0
    caught_up_s: float = 0.0  # restart -> every EVENTS replica current again


@pytest.fixture
async def js(cluster: LocalCluster) -> AsyncIterator[JetStreamContext]:
    await asyncio.to_thread(cluster.wait_meta_leader, 60)
    nc = await connect(cluster.urls, TEST_LOG, name="cluster-test")
    yield nc.jetstream(timeout=5)
    await _close(nc)


async def _close(nc: NATS) -> None:
    with contextlib.suppress(OSError):  # nats-py raises if the socket died mid-reconnect
        await nc.close()


async def replica_counts(js: JetStreamContext) -> dict[str, tuple[int, int]]:
    """(configured replicas, peers besides the leader) of every stream and bucket's stream."""
    counts = {}
    for name in [*STREAMS, *(f"KV_{b}" for b in BUCKETS), *(f"OBJ_{b}" for b in OBJECT_BUCKETS)]:
        info = await js.stream_info(name)
        peers = info.cluster.replicas if info.cluster and info.cluster.replicas else []
        counts[name] = (info.config.num_replicas or 1, len(peers))
    return counts


def turns(agents: Sequence[Agent]) -> int:
    return sum(len(s.completions) for a in agents for s in a.sessions)


def agent_sessions(agents: Sequence[Agent]) -> list[AgentSession]:
    return [s for a in agents for s in a.sessions]


async def wait_turns(agents: Sequence[Agent], at_least: int, within: float) -> None:
    deadline = time.monotonic() + within
    while turns(agents) < at_least:
        if time.monotonic() > deadline:
            errors = [e for s in agent_sessions(agents) for e in s.errors][:5]
            raise AssertionError(
                f"agents got {turns(agents)} of {at_least} completions within {within:g}s; "
                f"their errors: {errors}"
            )
        await asyncio.sleep(0.2)


async def events_leader(js: JetStreamContext) -> str | None:
    """The name of the node leading EVENTS, or None while it has none (or no answer)."""
    try:
        info = await js.stream_info("EVENTS")
    except (nats.errors.Error, TimeoutError):
        return None
    return info.cluster.leader if info.cluster else None


async def wait_new_leader(
    cluster: LocalCluster, survivors: Sequence[ClusterMember], victim: str, within: float
) -> tuple[str, float]:
    """(EVENTS's new leader, seconds since ``started``), asked through the survivors only."""
    started = time.monotonic()
    nc = await connect(",".join(n.url for n in survivors), TEST_LOG, name="cluster-election")
    try:
        js = nc.jetstream(timeout=0.5)
        while (leader := await events_leader(js)) in (None, victim):
            if time.monotonic() - started > within:
                raise AssertionError(
                    f"EVENTS had no leader but the killed {victim} {within:g}s after the kill: "
                    f"{cluster.describe()}"
                )
            await asyncio.sleep(0.05)
    finally:
        await _close(nc)
    assert leader is not None
    return leader, time.monotonic() - started


async def wait_caught_up(js: JetStreamContext, node: str, within: float) -> float:
    """Seconds until every EVENTS replica, ``node`` included, is current again."""
    started = time.monotonic()
    while True:
        try:
            info = await js.stream_info("EVENTS")
            peers = (info.cluster.replicas or []) if info.cluster else []
            names = {info.cluster.leader if info.cluster else None} | {p.name for p in peers}
            if node in names and all(p.current and not p.offline for p in peers):
                return time.monotonic() - started
            why = f"peers {[(p.name, p.current, p.offline, p.lag) for p in peers]}"
        except (nats.errors.Error, TimeoutError) as exc:
            why = f"{type(exc).__name__}: {exc}"
        if time.monotonic() - started > within:
            raise AssertionError(f"{node} did not catch up on EVENTS within {within:g}s: {why}")
        await asyncio.sleep(0.2)


async def test_killing_the_events_leader_loses_no_completion_and_duplicates_no_trajectory(
    cluster: LocalCluster, js: JetStreamContext, tiny_model_dir: Path, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    await asyncio.to_thread(provision, cluster.urls, data)
    counts = await replica_counts(js)
    assert counts == {name: (3, 2) for name in counts}, f"not every stream is R3: {counts}"

    services = [
        *(Service("worker", cluster.urls, data, *WORKER, *REPLICAS) for _ in range(2)),
        Service("shard-writer", cluster.urls, data, *WRITER_FLAGS, *REPLICAS),
    ]
    gateway: GatewayProcess | None = None
    stopping = asyncio.Event()
    try:
        for service in services:
            service.start()
        gateway = await asyncio.to_thread(
            GatewayProcess, cluster.urls, tiny_model_dir, data / "gateway", *REPLICAS
        )
        async with httpx.AsyncClient() as http:
            agents = [Agent(i, gateway.url, seed=13, http=http) for i in range(AGENTS)]
            driving = [asyncio.create_task(a.run(stopping)) for a in agents]
            await wait_turns(agents, WARM_TURNS, within=180)
            outage = await kill_the_events_leader(cluster, js, agents)
            await asyncio.sleep(AFTER_S)
            stopping.set()
            await asyncio.wait_for(asyncio.gather(*driving), timeout=240)

        await wait_pipeline_idle(js, RUN, services, within=240)
        await asyncio.sleep(3.0)  # a trajectory written twice would show by now
        tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
        report = await ShardAuditor(js, RUN, tokenizer).audit(
            agent_sessions(agents), data / "shards", data / "no-sink-journal"
        )
        rows = shard_table_rows(data / "shards")
        codes = [s.stop() for s in services]
    finally:
        stopping.set()
        if gateway is not None:
            gateway.stop()
        for service in services:
            service.kill()

    print(summary(outage, report, agent_sessions(agents)))
    assert outage.turns_while_down > 0, f"no completion was served while {outage.victim} was down"
    assert report.lost_completions == [], report.lost_completions[:5]
    assert report.unclosed == [], report.unclosed[:5]
    assert report.lost_sessions == [], report.lost_sessions[:5]
    assert report.duplicated == 0, f"{report.duplicated} trajectories in two shard rows"
    assert len(rows) == report.trajectories > 0
    assert report.outcomes["gave_up"] == 0, report.outcomes
    assert codes == [0, 0, 0], "\n".join(s.output() for s in services)


async def kill_the_events_leader(
    cluster: LocalCluster, js: JetStreamContext, agents: Sequence[Agent]
) -> Outage:
    """SIGKILL the node leading EVENTS, time the elections, drive on, bring it back."""
    leader = await events_leader(js)
    assert leader is not None, f"EVENTS has no leader: {cluster.describe()}"
    victim = cluster.node(leader)
    survivors = [n for n in cluster.nodes if n is not victim]
    outage = Outage(leader, leader == cluster.meta_leader(), turns(agents))
    await asyncio.to_thread(victim.kill)
    # Both elections timed from the kill, side by side, as the cluster holds them.
    meta = (
        asyncio.create_task(asyncio.to_thread(cluster.wait_meta_leader, 60, survivors))
        if outage.was_meta_leader
        else None
    )
    outage.new_leader, outage.election_s = await wait_new_leader(cluster, survivors, leader, 60)
    if meta is not None:
        _, outage.meta_election_s = await meta
    await asyncio.sleep(DOWN_S)
    outage.turns_while_down = turns(agents) - outage.turns_before
    await asyncio.to_thread(victim.start)
    outage.caught_up_s = await wait_caught_up(js, leader, within=120)
    return outage


def summary(outage: Outage, report: Report, sessions: Sequence[AgentSession]) -> str:
    return (
        f"killed {outage.victim} (EVENTS leader"
        f"{', meta leader' if outage.was_meta_leader else ''}) after {outage.turns_before} "
        f"completions; new EVENTS leader {outage.new_leader} in {outage.election_s:.2f}s"
        + (
            f", meta leader in {outage.meta_election_s:.2f}s"
            if outage.meta_election_s is not None
            else ""
        )
        + f"; {outage.turns_while_down} completions while it was down; caught up "
        f"{outage.caught_up_s:.2f}s after its restart. Sessions {report.sessions} "
        f"(outcomes {dict(report.outcomes)}), completions {report.turns}, retried requests "
        f"{sum(s.retries for s in sessions)}, sessions in EVENTS {report.log_sessions} "
        f"(reaped {report.reaped}), shard rows {report.trajectories}, "
        f"late turns {len(report.late_turns)}, dead letters {report.dead_letters}"
    )


def other_turn(session: str, index: int, reply: str) -> TurnCompleted:
    """Turn ``index`` of ``session`` as one gateway samples it (``reply``: its request's id)."""
    return TurnCompleted(
        run=RUN,
        session=session,
        turn=index,
        prompt_ids=[1, 2, 3],
        completion_ids=[4, 5] if reply == "a" else [6, 7],
        logprobs=[-0.5, -0.25],
        reply_id=reply,
    )


async def test_on_the_cluster_a_stale_append_of_another_turn_at_its_index_is_a_duplicate(
    cluster: LocalCluster, js: JetStreamContext, tmp_path: Path
) -> None:
    """Two gateways that both knew the session up to its open each append turn 0. A turn's
    Msg-Id names its session and index only, and on a replicated stream nats-server answers
    the Msg-Id's de-duplication before it checks the expectation (a single server checks the
    expectation first: tests/integration/test_append_expectations.py): the second append comes
    back as a duplicate of the first, at its sequence, and is stored nowhere. What the gateway
    relies on when it reads a duplicate answer back (gateway.serving.engine.TurnEngine) and the
    fleet test (test_fleet.py) finds lost without it."""
    await asyncio.to_thread(provision, cluster.urls, tmp_path / "data")
    nc = await connect(cluster.urls, TEST_LOG, name="cluster-expectations")
    publisher = await JetStreamPublisher(nc).start()
    try:
        opened = await publisher.publish(SessionOpened(run=RUN, session="s"))
        known = Expectation.session(RUN, "s", opened.seq or 0)
        first = await publisher.publish(other_turn("s", 0, "a"), expect=known)
        second = await publisher.publish(other_turn("s", 0, "b"), expect=known)
        stored = await read_session(js, RUN, "s")
    finally:
        await publisher.close()
        await _close(nc)
    assert (second.duplicate, second.seq) == (True, first.seq), second
    assert [getattr(e, "reply_id", None) for e in stored] == [None, "a"]
