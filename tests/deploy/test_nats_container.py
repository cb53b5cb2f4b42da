"""The pipeline against NATS in a container (testcontainers, the locally built NATS image).

The gateway, a fold worker and the shard writer run as processes, as in tests/integration, but
the event log is the shipped single-node config in a container. The container is SIGKILLed
(``docker kill``) between two sessions and started again on its store: both sessions end up in
the shards exactly once.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.deploy.containers import NatsContainer
from tests.helpers.gateway_process import GatewayProcess
from tests.helpers.services import WORKER_FLAGS, WRITER_FLAGS, Service, shard_table_rows
from tests.helpers.waiting import wait_for

pytestmark = pytest.mark.timeout(2400)  # the images may be built first (minutes)


@pytest.fixture
def pipeline(
    nats_container: NatsContainer, tiny_model_dir: Path, tmp_path: Path
) -> Iterator[tuple[GatewayProcess, list[Service]]]:
    data = tmp_path / "data"
    consumers = [
        Service("worker", nats_container.url, data, *WORKER_FLAGS),
        Service("shard-writer", nats_container.url, data, *WRITER_FLAGS),
    ]
    for service in consumers:
        service.start()
    gateway = GatewayProcess(nats_container.url, tiny_model_dir, data / "gateway")
    yield gateway, consumers
    gateway.stop()
    for service in consumers:
        service.kill()


def one_session(gateway: GatewayProcess, reward: float) -> str:
    session = gateway.session(metadata={"reward": reward})
    client = openai.OpenAI(base_url=str(session["base_url"]), api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "hello"}]
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8)  # type: ignore[arg-type]
    assert reply.choices[0].message is not None
    closed = httpx.post(
        f"{gateway.url}/v1/sessions/{session['session_id']}/close",
        json={"reward": reward},
        timeout=30,
    )
    assert closed.status_code == 200, closed.text
    return str(session["session_id"])


def test_a_session_reaches_the_shards_through_a_containerized_nats_that_is_killed(
    nats_container: NatsContainer,
    pipeline: tuple[GatewayProcess, list[Service]],
    tmp_path: Path,
) -> None:
    gateway, consumers = pipeline
    shards = tmp_path / "data" / "shards"

    def sessions_in_shards() -> Counter[str]:
        return Counter(str(r["session"]) for r in shard_table_rows(shards))

    first = one_session(gateway, 1.0)
    wait_for(lambda: first in sessions_in_shards(), 60, f"session {first} in the shards")

    nats_container.kill()  # SIGKILL: what JetStream acknowledged must survive
    nats_container.restart()
    second = one_session(gateway, 0.5)  # the gateway and consumers reconnect on their own

    def both_in_shards() -> bool:
        return {first, second} <= set(sessions_in_shards())

    try:
        wait_for(both_in_shards, 90, f"sessions {first} and {second} in the shards")
    except AssertionError as exc:
        logs = "\n".join(f"--- {s.command}\n{s.output()}" for s in consumers)
        raise AssertionError(f"{exc}\n{logs}\n--- nats\n{nats_container.logs()}") from None
    assert sessions_in_shards() == Counter({first: 1, second: 1})
    rewards = {str(r["session"]): r["reward"] for r in shard_table_rows(shards)}
    assert rewards == {first: 1.0, second: 0.5}
    assert all(s.running for s in consumers), [s.output() for s in consumers]
