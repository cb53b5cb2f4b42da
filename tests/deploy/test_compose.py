"""``infra/docker-compose.yml`` as users run it, under a real Docker engine with local images.

NATS, HAProxy in front of three gateways (built-in local backend, the tiny model bind-mounted),
two fold workers and the shard writer come up through docker-compose, in the shipped file's
host-networking variant (``tests.deploy.compose``). Agents drive sessions through the load
balancer with the ``openai`` SDK, so a session's requests go round robin over the gateways; a
worker and the shard writer are ``docker kill``-ed mid-run and started again; every closed
session must land in the shards (a host directory) exactly once, with its reward.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from eventlog.server import free_ports
from tests.deploy.compose import (
    COMPOSE_FILE,
    GATEWAYS,
    IMAGE_UID,
    Compose,
    fleet_ports,
    host_network_variant,
    wait_fleet,
)
from tests.deploy.engine import DeployError, Images, docker_env
from tests.helpers.services import shard_table_rows
from tests.helpers.waiting import wait_for

# Building the images on a fresh machine takes minutes; the test itself about one.
pytestmark = pytest.mark.timeout(2400)

RUN = "compose"


@dataclass
class Stack:
    compose: Compose
    gateway_url: str
    shards: Path


@pytest.fixture
def stack(images: Images, world_readable_model: Path, tmp_path: Path) -> Iterator[Stack]:
    shards = tmp_path / "shards"
    shards.mkdir()
    os.chown(shards, IMAGE_UID, IMAGE_UID)
    nats_port, nats_http_port = free_ports(2)
    ports = fleet_ports()
    env = {
        **docker_env(),
        # Creating a container copies its whole image under vfs: minutes for 4 at once.
        "COMPOSE_HTTP_TIMEOUT": "900",
        "TURNSTREAM_IMAGE": images.turnstream,
        "NATS_IMAGE": images.nats,
        "HAPROXY_IMAGE": images.haproxy,
        "NATS_PORT": str(nats_port),
        "NATS_HTTP_PORT": str(nats_http_port),
        **ports.env(),
        "TURNSTREAM_LOG__URL": f"nats://127.0.0.1:{nats_port}",
        "TURNSTREAM_RUN": RUN,
        "TURNSTREAM_MODEL_DIR": str(world_readable_model),
        "TURNSTREAM_MODEL": "/models",
        "TURNSTREAM_MODEL_NAME": "tiny",
        "TURNSTREAM_SHARDS_DIR": str(shards),
        # Seconds, not the production minutes: redeliveries after a kill, shard rotation.
        "TURNSTREAM_FOLD__ACK_WAIT_S": "3",
        "TURNSTREAM_SHARDS__ACK_WAIT_S": "3",
        "TURNSTREAM_SHARDS__MAX_AGE_S": "0.5",
    }
    compose_file = host_network_variant(COMPOSE_FILE, tmp_path / "docker-compose.yml")
    compose = Compose(f"turnstream-deploy-{os.getpid()}", compose_file, env)
    try:
        started = time.monotonic()
        try:
            compose("up", "-d")
        except DeployError as exc:
            pytest.fail(f"docker-compose up failed: {exc}\n{compose.logs()}", pytrace=False)
        try:
            wait_fleet(ports, compose)
        except AssertionError as exc:
            pytest.fail(str(exc), pytrace=False)
        print(f"compose stack healthy in {time.monotonic() - started:.0f}s")
        yield Stack(compose, ports.lb_url, shards)
    finally:
        compose.down()


class Agent:
    """One session through the gateway: the openai SDK on the session's base URL."""

    def __init__(self, gateway_url: str, index: int) -> None:
        self.gateway_url = gateway_url
        opened = httpx.post(
            f"{gateway_url}/v1/sessions", json={"metadata": {"agent": index}}, timeout=30
        )
        opened.raise_for_status()
        self.session = str(opened.json()["session_id"])
        self.client = openai.OpenAI(
            base_url=opened.json()["base_url"], api_key="unused", max_retries=0, timeout=60
        )
        self.messages: list[dict[str, Any]] = [{"role": "user", "content": f"task {index}"}]
        self.reward = index / 10

    def turn(self) -> None:
        reply = self.client.chat.completions.create(
            model="tiny", messages=self.messages, max_tokens=8, temperature=0
        )
        self.messages += [
            {"role": "assistant", "content": reply.choices[0].message.content or ""},
            {"role": "user", "content": "go on"},
        ]

    def close(self) -> None:
        closed = httpx.post(
            f"{self.gateway_url}/v1/sessions/{self.session}/close",
            json={"reward": self.reward},
            timeout=30,
        )
        assert closed.status_code == 200, closed.text


def test_compose_stack_survives_killed_worker_and_shard_writer(stack: Stack) -> None:
    agents = [Agent(stack.gateway_url, i) for i in range(6)]
    for agent in agents:
        agent.turn()

    stack.compose("kill", "-s", "SIGKILL", "worker-1", "shard-writer")  # docker kill
    for agent in agents[:3]:  # closed while a worker and the writer are down
        agent.turn()
        agent.close()
    stack.compose("start", "worker-1", "shard-writer")
    for agent in agents[3:]:
        agent.turn()
        agent.turn()
        agent.close()

    want = {agent.session: agent.reward for agent in agents}

    def all_in_shards() -> bool:
        return {str(r["session"]) for r in shard_table_rows(stack.shards)} >= set(want)

    try:
        wait_for(all_in_shards, 120, "every closed session in the shards")
        time.sleep(2.0)  # anything written twice would show up by now
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{stack.compose.logs()}") from None
    rows = shard_table_rows(stack.shards)
    per_session = Counter(str(r["session"]) for r in rows)
    assert [s for s, n in per_session.items() if n != 1] == [], f"not once: {per_session}"
    assert set(per_session) == set(want)
    assert {str(r["session"]): r["reward"] for r in rows} == pytest.approx(want)
    assert {r["run"] for r in rows} == {RUN}
    turns = {str(r["session"]): r["num_turns"] for r in rows}
    assert turns == {a.session: 2 if i < 3 else 3 for i, a in enumerate(agents)}
    running = stack.compose("ps", "--services", "--filter", "status=running").split()
    services = ["nats", *GATEWAYS, "lb", "worker-1", "worker-2", "shard-writer"]
    assert sorted(running) == sorted(services), stack.compose.logs()
