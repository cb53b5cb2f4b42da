"""A fleet (issue 36, point 5): HAProxy round robin per request over the compose file's three
gateways, on the shipped 3-node NATS cluster, under Claude-Code-shaped traffic; one gateway is
SIGKILLed mid-run and brought back.

The gateways and the load balancer are the compose file's containers (host-networking variant,
``tests.deploy.compose``; its single NATS left out for the cluster of ``tests.deploy.cluster``),
a fold worker and the shard writer run beside them as processes. The model is the fixed-latency
vLLM stand-in answering every request with the same two ``Agent`` tool calls as real token ids
(``harness.claude_code_tree``: the tiny model cannot decide to call a tool). Sessions start one
after another, each a Claude Code session as Claude Code 2.1 sends it through the ``anthropic``
SDK: the main agent spawns a fork and a fresh agent, whose requests run alongside main's next,
each answering the tool calls of its last reply; the SDK retries what the kill breaks
(connection errors, the load balancer's 502/503) as it does for any client.

Checked, all at once (``Checks``): every answered request is one turn in EVENTS and, token for
token, a turn of its agent's row in the shards; each agent of each session one row (no extra
segment, no fork); every later turn of an agent continues its previous one over that turn's
whole context (``prefix_len``), so nothing was re-tokenized; and the gateways' ``/metrics``
count the catch-up reads that round robin makes, with no stale prompt.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from eventlog import LogSettings, connect, read_session_messages
from gateway.core.agents import MAIN_AGENT
from schemas import TurnCompleted
from schemas.codec import Codec
from schemas.trust import VettedSession, vet_session
from tests.agents.subagent_recorded import Checks, row_turns
from tests.chaos.stack import with_flag
from tests.deploy.cluster import REPLICAS, LocalCluster, provision, wait_pipeline_idle
from tests.deploy.compose import (
    COMPOSE_FILE,
    GATEWAYS,
    Compose,
    FleetPorts,
    answers,
    fleet_ports,
    host_network_variant,
    wait_fleet,
)
from tests.deploy.engine import DeployError, Images, docker_env
from tests.helpers.scripted_gateway import scripted_backend
from tests.helpers.services import WORKER_FLAGS, WRITER_FLAGS, Service, shard_table_rows
from turnstream.data.regenerate import full_prompts

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from harness.claude_code_tree import HEADERS, NODES, SPAWN_TEXT, ClaudeCodeTree, run_tree
from harness.continuation import turn_of, whole_context

pytestmark = [pytest.mark.integration, pytest.mark.timeout(2400)]

RUN = "fleet"
MAX_CONTEXT = 131_072  # Claude Code's first request is ~50k tokens of the byte-level tokenizer
TTFT_MS = 300  # the backend's time to first token: requests of a session overlap
TOOL_S = 0.5  # an agent's tools run this long between its requests
START_EVERY_S = 1.5  # a new session this often ...
AT_ONCE = 4  # ... while fewer than this many are under way
KILL_AFTER = 8  # answers before the kill
DOWN_S = 6.0  # the killed gateway stays down this long
AFTER = 14  # answers after it is back ...
VICTIM_TURNS = 4  # ... of which it served at least this many
VICTIM = "gateway-2"
# The agent's own answers to every tool call; a session's sub-agents report through main.
AGENT_CHAINS = {"main": ("main-1", "main-2", "main-3"), "fork": ("fork-1", "fork-2")}
AGENT_CHAINS["fresh"] = ("fresh-1", "fresh-2")
WORKER = with_flag(WORKER_FLAGS, "--reaper.idle-timeout-s", "60")  # sessions close themselves
TEST_LOG = LogSettings(ping_interval_s=0.5, max_outstanding_pings=2, connect_timeout_s=1.0)


@dataclass
class Fleet:
    compose: Compose
    ports: FleetPorts
    cluster: LocalCluster
    shards: Path
    services: list[Service]


@pytest.fixture
def fleet(
    images: Images, cluster: LocalCluster, world_readable_model: Path, tmp_path: Path
) -> Iterator[Fleet]:
    cluster.wait_meta_leader(60)
    data = tmp_path / "data"
    provision(cluster.urls, data)
    tokenizer = AutoTokenizer.from_pretrained(world_readable_model)
    completion = [*tokenizer.encode(SPAWN_TEXT, add_special_tokens=False)]
    completion.append(int(tokenizer.eos_token_id))
    timing = ("--ttft-ms", str(TTFT_MS), "--max-model-len", str(MAX_CONTEXT))
    ports = fleet_ports()
    with scripted_backend(tmp_path, completion, *timing) as backend:
        env = {
            **docker_env(),
            "COMPOSE_HTTP_TIMEOUT": "900",  # creating a container copies its image under vfs
            "TURNSTREAM_IMAGE": images.turnstream,
            "HAPROXY_IMAGE": images.haproxy,
            **ports.env(),
            "TURNSTREAM_LOG__URL": cluster.urls,
            "TURNSTREAM_LOG__REPLICAS": "3",
            "TURNSTREAM_RUN": RUN,
            "TURNSTREAM_MODEL_DIR": str(world_readable_model),
            "TURNSTREAM_MODEL": "/models",
            "TURNSTREAM_BACKEND": "vllm",
            "TURNSTREAM_BACKEND_URLS": json.dumps([backend]),
            "TURNSTREAM_MAX_CONTEXT": str(MAX_CONTEXT),
        }
        compose_file = host_network_variant(COMPOSE_FILE, tmp_path / "docker-compose.yml")
        compose = Compose(f"turnstream-fleet-{os.getpid()}", compose_file, env)
        services = [
            Service("worker", cluster.urls, data, *WORKER, *REPLICAS),
            Service("shard-writer", cluster.urls, data, *WRITER_FLAGS, *REPLICAS),
        ]
        try:
            started = time.monotonic()
            try:  # --no-deps: the cluster, not the file's single NATS
                compose("up", "-d", "--no-deps", *GATEWAYS, "lb")
                wait_fleet(ports, compose)
            except (DeployError, AssertionError) as exc:
                pytest.fail(f"the fleet did not come up: {exc}\n{compose.logs()}", pytrace=False)
            for service in services:
                service.start()
            print(f"fleet healthy in {time.monotonic() - started:.0f}s")
            yield Fleet(compose, ports, cluster, data / "shards", services)
        finally:
            for service in services:
                service.kill()
            compose.down()


@dataclass
class Session:
    """One Claude Code session as its client saw it: each request's answer id, by node."""

    tree: ClaudeCodeTree
    answered: dict[str, str] = field(default_factory=dict)
    closed: int | None = None  # the close's status

    @property
    def sid(self) -> str:
        return str(self.tree.session)


class Traffic:
    """Claude Code sessions through the load balancer, started one after another."""

    def __init__(self, url: str) -> None:
        self.url = url
        # The SDK's own retries (connection errors, 5xx), with room for a kill's few seconds.
        self.client = anthropic.AsyncAnthropic(
            base_url=url, api_key="unused", max_retries=8, timeout=120, default_headers=HEADERS
        )
        self.sessions: list[Session] = []

    @property
    def answers(self) -> int:
        return sum(len(s.answered) for s in self.sessions)

    async def run(self, stopping: asyncio.Event) -> None:
        running: set[asyncio.Task[None]] = set()
        while not stopping.is_set():
            if len(running) < AT_ONCE:
                session = Session(ClaudeCodeTree("tiny"))
                self.sessions.append(session)
                task = asyncio.create_task(self.session(session))
                running.add(task)
                task.add_done_callback(running.discard)
            await asyncio.sleep(START_EVERY_S)
        await asyncio.gather(*running)
        await self.client.close()

    async def session(self, session: Session) -> None:
        tree = session.tree

        async def step(node: str) -> None:
            if node != "main-1":
                await asyncio.sleep(TOOL_S)
            request = tree.request(node)
            extra = request.pop("extra")
            message = await self.client.messages.create(
                **request,
                extra_body=extra,
                extra_headers=tree.headers(node),
                extra_query={"beta": "true"},
            )
            tree.answered(node, [b.model_dump(exclude_none=True) for b in message.content])
            session.answered[node] = message.id

        await run_tree(step)
        async with httpx.AsyncClient(base_url=self.url, timeout=30) as http:
            for _ in range(10):  # as the SDK would: connection errors and 5xx again
                try:
                    closed = await http.post(
                        f"/v1/sessions/{session.sid}/close", json={"reward": 1.0}
                    )
                except httpx.TransportError:
                    await asyncio.sleep(1)
                    continue
                session.closed = closed.status_code
                if closed.status_code < 500:
                    return
                await asyncio.sleep(1)


async def until(what: str, condition: Any, within: float) -> None:
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {within:g}s: {what}")
        await asyncio.sleep(0.2)


def counters(gateway_url: str) -> dict[str, float]:
    """The gateway's counters (``*_total``, labels summed) by name, from its /metrics."""
    text = httpx.get(f"{gateway_url}/metrics", timeout=10).text
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("turnstream_gateway_") and sample.name.endswith("_total"):
                found[sample.name] = found.get(sample.name, 0.0) + sample.value
    return found


def served(fleet: Fleet, service: str) -> float:
    """Turns the gateway recorded since it started (0 while it does not answer)."""
    try:
        return counters(fleet.ports.gateway_url(service)).get("turnstream_gateway_turns_total", 0)
    except httpx.HTTPError:
        return 0.0


async def test_a_fleet_behind_round_robin_keeps_every_conversation_one_exact_trajectory(
    fleet: Fleet,
) -> None:
    started = time.monotonic()
    traffic = Traffic(fleet.ports.lb_url)
    stopping = asyncio.Event()
    driving = asyncio.create_task(traffic.run(stopping))
    try:
        await until("answers before the kill", lambda: traffic.answers >= KILL_AFTER, 240)
        await asyncio.to_thread(fleet.compose, "kill", "-s", "SIGKILL", VICTIM)
        killed_at = traffic.answers
        await asyncio.sleep(DOWN_S)
        down = traffic.answers - killed_at
        await asyncio.to_thread(fleet.compose, "start", VICTIM)
        victim_health = f"{fleet.ports.gateway_url(VICTIM)}/health"
        await until(f"{VICTIM} back", lambda: answers(victim_health), 240)
        back_at = traffic.answers
        await until(
            f"answers after the restart, some by {VICTIM}",
            lambda: traffic.answers >= back_at + AFTER and served(fleet, VICTIM) >= VICTIM_TURNS,
            240,
        )
    finally:
        stopping.set()
        await asyncio.wait_for(driving, timeout=300)
    driven_s = time.monotonic() - started

    nc = await connect(fleet.cluster.urls, TEST_LOG, name="fleet-test")
    try:
        js = nc.jetstream(timeout=5)
        await wait_pipeline_idle(js, RUN, fleet.services, within=240)
        await asyncio.sleep(2.0)  # a row written twice would show by now
        codec = Codec()
        logs = {
            s.sid: vet_session(await read_session_messages(js, RUN, s.sid), codec)
            for s in traffic.sessions
        }
    finally:
        await nc.close()
    rows = shard_table_rows(fleet.shards)
    metrics = {g: counters(fleet.ports.gateway_url(g)) for g in GATEWAYS}

    audit = Audit(traffic.sessions, logs, rows, metrics)
    checks = audit.run_all()
    print(
        f"driven {driven_s:.0f}s: {len(traffic.sessions)} sessions, {traffic.answers} answers "
        f"({killed_at} before the kill of {VICTIM}, {down} while it was down, "
        f"{traffic.answers - back_at} after it was back); {audit.summary()}"
    )
    checks.assert_all()


class Audit:
    """What the clients were answered against EVENTS, the shards and the gateways' counters."""

    def __init__(
        self,
        sessions: list[Session],
        logs: dict[str, VettedSession],
        rows: list[dict[str, Any]],
        metrics: dict[str, dict[str, float]],
    ) -> None:
        self.sessions, self.logs, self.rows, self.metrics = sessions, logs, rows, metrics
        self.turns = {
            sid: {e.reply: e for e in log.events if isinstance(e, TurnCompleted)}
            for sid, log in logs.items()
        }
        self.unlogged: list[str] = []  # answers with no trusted turn in EVENTS
        self.rows_of: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for row in rows:
            agent = str(json.loads(str(row["metadata"])).get("agent_id"))
            self.rows_of.setdefault((str(row["session"]), agent), []).append(row)
        self.retokenized: list[str] = []

    def agents(self) -> Iterator[tuple[Session, str, list[TurnCompleted], list[dict[str, Any]]]]:
        """(session, agent kind, the turns its answers name in order, the agent's rows)."""
        for session in self.sessions:
            for kind, chain in AGENT_CHAINS.items():
                agent = MAIN_AGENT if kind == "main" else session.tree.agents[kind]
                answered = [self.turn(session, node) for node in chain if node in session.answered]
                turns = [turn for turn in answered if turn is not None]
                yield session, kind, turns, self.rows_of.get((session.sid, agent), [])

    def turn(self, session: Session, node: str) -> TurnCompleted | None:
        """The trusted turn the node's answer names; None (noted, with what the log holds of
        it) when there is none."""
        answer = session.answered[node]
        try:
            return turn_of(self.turns[session.sid], answer)
        except RuntimeError:
            pass
        rejected = []
        for message, why in self.logs[session.sid].rejected:
            reply = str(getattr(Codec().decode(message.data), "reply", ""))
            if reply and answer.endswith((f"-{reply}", f"_{reply}")):
                rejected.append(f"{why.reason}: {why}")
        noted = f"{session.sid} {node} ({answer}): {rejected or 'no event of it at all'}"
        if noted not in self.unlogged:
            self.unlogged.append(noted)
        return None

    def check_answers_logged(self) -> None:
        for session in self.sessions:
            for node in session.answered:
                self.turn(session, node)
        assert not self.unlogged, f"{len(self.unlogged)} answers no trusted turn: {self.unlogged}"

    def check_sessions_whole(self) -> None:
        unfinished = [
            (s.sid, sorted(s.answered), s.closed)
            for s in self.sessions
            if len(s.answered) != len(NODES) or s.closed != 200
        ]
        assert not unfinished, f"sessions not answered whole or not closed: {unfinished}"

    def check_answers_in_shards(self) -> None:
        """Every answer's turn, token for token (full prompt, completion), in its agent's row."""
        missing = []
        prompts = {
            sid: full_prompts({t.turn: t for t in turns.values()})
            for sid, turns in self.turns.items()
        }
        for session, kind, answered, rows in self.agents():
            recorded = {(tuple(p), tuple(c)) for row in rows for p, c, _ in row_turns(row)}
            for turn in answered:
                prompt = prompts[session.sid].get(turn.turn)
                ids = tuple(prompt.tolist()) if prompt is not None else ()
                if (ids, tuple(turn.completion_ids.tolist())) not in recorded:
                    missing.append(f"{session.sid} {kind} turn {turn.turn}")
        assert not missing, f"{len(missing)} answered turns not in their agent's row: {missing[:5]}"

    def check_one_trajectory_per_agent(self) -> None:
        wrong = []
        for session, kind, answered, rows in self.agents():
            if [row["num_turns"] for row in rows] != [len(answered)]:
                turns = [row["num_turns"] for row in rows]
                wrong.append(f"{session.sid} {kind}: rows of {turns} turns, {len(answered)} asked")
        extra = len(self.rows) - len(AGENT_CHAINS) * len(self.sessions)
        assert not wrong and extra == 0, f"{extra} rows beyond one per agent; {wrong[:5]}"

    def check_none_retokenized(self) -> None:
        """Each later turn of an agent continues its previous one over that whole context."""
        for session, _, answered, _ in self.agents():
            for previous, turn in itertools.pairwise(answered):
                whole = whole_context(previous)
                if turn.parent_turn != previous.turn or turn.prefix_len != whole:
                    self.retokenized.append(
                        f"{session.sid} turn {turn.turn}: parent {turn.parent_turn}, prefix_len "
                        f"{turn.prefix_len}; expected turn {previous.turn} and its {whole}"
                    )
        assert not self.retokenized, (
            f"{len(self.retokenized)} continuations re-tokenized: {self.retokenized[:5]}"
        )

    def total(self, name: str) -> float:
        return sum(counters.get(name, 0.0) for counters in self.metrics.values())

    def check_metrics(self) -> None:
        reads = self.total("turnstream_gateway_catch_up_reads_total")
        assert reads > 0, f"no catch-up read counted by any gateway: {self.metrics}"
        assert self.total("turnstream_gateway_stale_prompts_total") == 0, self.metrics

    def run_all(self) -> Checks:
        checks = Checks()
        for name, check in (
            ("every session answered whole and closed", self.check_sessions_whole),
            ("every answer a trusted turn in EVENTS", self.check_answers_logged),
            ("every answer in its agent's row, token for token", self.check_answers_in_shards),
            ("each agent of each session one trajectory", self.check_one_trajectory_per_agent),
            ("no continuation re-tokenized", self.check_none_retokenized),
            ("catch-up reads counted, no stale prompt", self.check_metrics),
        ):
            with checks.check(name):
                check()
        return checks

    def summary(self) -> str:
        turns = {
            g: int(m.get("turnstream_gateway_turns_total", 0)) for g, m in self.metrics.items()
        }
        return (
            f"turns per gateway (since its start) {turns}; catch-up reads "
            f"{self.total('turnstream_gateway_catch_up_reads_total'):g}, events caught up "
            f"{self.total('turnstream_gateway_caught_up_events_total'):g}, appends refused "
            f"{self.total('turnstream_gateway_appends_refused_total'):g}, stale prompts "
            f"{self.total('turnstream_gateway_stale_prompts_total'):g}; shard rows "
            f"{len(self.rows)}; continuations re-tokenized {len(self.retokenized)}"
        )
