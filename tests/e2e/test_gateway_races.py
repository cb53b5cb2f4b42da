"""Concurrent first requests on one session (issue 9): every turn a client got a 200 for is a
turn of the session, in the close's ``num_turns``, in the log, and a sample in the shards.
A real gateway, fold worker and shard writer, and a real nats-server.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from eventlog.server import NatsServer
from schemas import SessionClosed, SessionOpened
from tests.e2e.test_gateway import events_of, turns_of
from tests.helpers.gateway_process import GatewayProcess
from tests.helpers.hostile import assert_error, concurrently, served_model
from tests.helpers.services import WORKER_FLAGS, WRITER_FLAGS, Service, shard_table_rows

pytestmark = pytest.mark.integration

RACERS = 8
ROUNDS = 20


@dataclass
class Pipeline:
    gateway: GatewayProcess
    services: list[Service]
    shards: Path


@pytest.fixture(scope="module")
def pipeline(
    nats_server: NatsServer, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pipeline]:
    data = tmp_path_factory.mktemp("pipeline")
    gateway = GatewayProcess(nats_server.url, tiny_model_dir, data / "gateway")
    services = [
        Service("worker", nats_server.url, data, *WORKER_FLAGS).start(),
        Service("shard-writer", nats_server.url, data, *WRITER_FLAGS).start(),
    ]
    yield Pipeline(gateway, services, data / "shards")
    for service in services:
        service.stop()
    gateway.stop()


@pytest.fixture
def client(pipeline: Pipeline) -> Iterator[httpx.Client]:
    limits = httpx.Limits(max_connections=RACERS)
    with httpx.Client(base_url=pipeline.gateway.url, limits=limits, timeout=120) as client:
        yield client


def samples_in_shards(root: Path, sessions: list[str]) -> dict[str, int]:
    """Turns per session in the shards: the sum of its rows' num_turns (and of turn_ends)."""
    found = dict.fromkeys(sessions, 0)
    for row in shard_table_rows(root):
        if row["session"] in found:
            turns = row["num_turns"]
            assert turns == len(row["turn_ends"]), row["trajectory_id"]
            found[str(row["session"])] += int(str(turns))
    return found


def test_eight_first_requests_on_one_new_session_are_eight_turns_everywhere(
    pipeline: Pipeline, client: httpx.Client, nats_server: NatsServer
) -> None:
    model = served_model(pipeline.gateway.url)
    sessions = [f"race-{r}-{uuid.uuid4().hex[:8]}" for r in range(ROUNDS)]
    for sid in sessions:

        def first_turn(i: int, sid: str = sid) -> httpx.Response:
            body = {"model": model, "messages": [{"role": "user", "content": f"hi {i}"}]}
            return client.post(
                "/v1/chat/completions",
                json={**body, "max_tokens": 4},
                headers={"X-Session-Id": sid},
            )

        answers = concurrently(RACERS, first_turn)
        assert [a.status_code for a in answers] == [200] * RACERS, [a.text for a in answers]
        assert client.get(f"/v1/sessions/{sid}").json()["turns"] == RACERS
        closed = client.post(f"/v1/sessions/{sid}/close", json={"reward": 1.0})
        assert closed.status_code == 200 and closed.json()["turns"] == RACERS, closed.text

        events = events_of(nats_server, sid)
        assert [t.turn for t in turns_of(events)] == list(range(RACERS)), sid
        [close] = [e for e in events if isinstance(e, SessionClosed)]
        assert close.num_turns == RACERS, sid
        assert sum(isinstance(e, SessionOpened) for e in events) == 1, sid

    # Every 200'd turn is a sample: the fold keeps all 8 turns of every session.
    deadline = time.monotonic() + 120
    while (found := samples_in_shards(pipeline.shards, sessions)) != dict.fromkeys(
        sessions, RACERS
    ):
        for service in pipeline.services:
            assert service.running, f"{service.command} exited:\n{service.output()}"
        assert time.monotonic() < deadline, f"turns per session in the shards: {found}"
        time.sleep(0.3)


def test_concurrent_creates_of_one_session_id_let_the_first_win(
    pipeline: Pipeline, client: httpx.Client, nats_server: NatsServer
) -> None:
    groups = [f"g{i % 4}" for i in range(RACERS)]  # two callers per distinct body
    for r in range(ROUNDS):
        sid = f"create-{r}-{uuid.uuid4().hex[:8]}"

        def create(i: int, sid: str = sid) -> httpx.Response:
            return client.post("/v1/sessions", json={"session_id": sid, "group": groups[i]})

        answers = concurrently(RACERS, create)
        ok = [i for i, a in enumerate(answers) if a.status_code == 200]
        assert ok, [a.text for a in answers]
        winner = answers[ok[0]].json()["group"]
        assert ok == [i for i, g in enumerate(groups) if g == winner], [a.text for a in answers]
        for i, answer in enumerate(answers):
            if i in ok:
                assert answer.json()["session_id"] == sid and answer.json()["group"] == winner
            else:
                assert_error(answer, 409, "session_exists", sid)

        assert client.get(f"/v1/sessions/{sid}").json()["group"] == winner
        opened = [e for e in events_of(nats_server, sid) if isinstance(e, SessionOpened)]
        assert [e.group for e in opened] == [winner], sid
