"""Runs are isolated (issue 9): a session is keyed by (run, session id), so run B can neither
reach run A's session nor learn anything of it, and per-run API keys confine a client to its
runs. A real `turnstream gateway` (default run ``e2e``) and a real nats-server.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from eventlog.server import NatsServer
from schemas import SessionOpened, TurnCompleted
from tests.e2e.test_gateway import events_of
from tests.helpers.gateway_process import GatewayProcess
from tests.helpers.hostile import assert_error, served_model

pytestmark = pytest.mark.integration

SECRET = "A-only"
KEYS = ["keyA=runA", "keyB=runB", "keyG"]


@pytest.fixture(scope="module")
def gateway(
    nats_server: NatsServer, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    process = GatewayProcess(nats_server.url, tiny_model_dir, tmp_path_factory.mktemp("open"))
    yield process
    process.stop()


@pytest.fixture(scope="module")
def keyed(
    nats_server: NatsServer, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    process = GatewayProcess(
        nats_server.url,
        tiny_model_dir,
        tmp_path_factory.mktemp("keyed"),
        "--api-keys",
        json.dumps(KEYS),
        "--metrics-auth",
    )
    yield process
    process.stop()


@pytest.fixture
def client(gateway: GatewayProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway.url, timeout=60) as client:
        yield client


@pytest.fixture
def keyed_client(keyed: GatewayProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=keyed.url, timeout=60) as client:
        yield client


def new_id() -> str:
    return f"x-{uuid.uuid4().hex[:12]}"


def chat_body(url: str, key: str | None = None) -> dict[str, object]:
    return {
        "model": served_model(url, key),
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
    }


def test_a_session_of_run_a_is_not_reachable_from_run_b(
    gateway: GatewayProcess, client: httpx.Client, nats_server: NatsServer
) -> None:
    sid, ask = new_id(), chat_body(gateway.url)
    created = client.post(
        "/v1/sessions", json={"run": "runA", "session_id": sid, "metadata": {"secret": SECRET}}
    )
    assert created.status_code == 200, created.text
    assert created.json()["run"] == "runA"

    in_b = {"X-Run-Id": "runB"}
    answers = [
        client.get(f"/v1/sessions/{sid}", headers=in_b),
        client.post(f"/v1/sessions/{sid}/reward", json={"value": 1.0}, headers=in_b),
        client.post(f"/v1/sessions/{sid}/close", json={}, headers=in_b),
        client.post(f"/sessions/{sid}/v1/chat/completions", json=ask, headers=in_b),
        client.post(f"/runs/runB/sessions/{sid}/v1/chat/completions", json=ask),
        client.post(f"/runs/runB/sessions/{sid}/v1/completions", json={"prompt": "hi"}),
        client.get(f"/runs/runB/sessions/{sid}/v1/models"),
    ]
    for answer in answers:
        assert_error(answer, 404, "session_not_found", sid)
        assert SECRET not in answer.text

    # The same id in run B is another session: created there, holding nothing of A's.
    other = client.post("/v1/sessions", json={"run": "runB", "session_id": sid})
    assert other.status_code == 200, other.text
    assert other.json()["run"] == "runB" and other.json()["metadata"] == {}
    header_turn = client.post(
        "/v1/chat/completions", json=ask, headers={**in_b, "X-Session-Id": sid}
    )
    assert header_turn.status_code == 200, header_turn.text
    described_b = client.get(f"/v1/sessions/{sid}", headers=in_b)
    assert described_b.json()["turns"] == 1
    for answer in (other, header_turn, described_b):
        assert SECRET not in answer.text

    # Run A's session is untouched: not closed from B, no turn of B's in it.
    described_a = client.get(f"/v1/sessions/{sid}", headers={"X-Run-Id": "runA"}).json()
    assert described_a["metadata"] == {"secret": SECRET}
    assert described_a["closed"] is False and described_a["turns"] == 0
    events_a, events_b = events_of(nats_server, sid, "runA"), events_of(nats_server, sid, "runB")
    assert [type(e) for e in events_a] == [SessionOpened]
    assert [type(e) for e in events_b] == [SessionOpened, TurnCompleted]
    assert isinstance(events_b[0], SessionOpened) and events_b[0].metadata == {}
    assert created.json()["base_url"] == f"{gateway.url}/runs/runA/sessions/{sid}/v1"


def test_per_run_keys_confine_a_client_to_its_runs(
    keyed: GatewayProcess, keyed_client: httpx.Client
) -> None:
    sid, ask, client = new_id(), chat_body(keyed.url, "keyG"), keyed_client

    def auth(key: str, run: str | None = None) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}", **({"X-Run-Id": run} if run else {})}

    body = {"run": "runA", "session_id": sid, "metadata": {"secret": SECRET}}
    created = client.post("/v1/sessions", json=body, headers=auth("keyA"))
    assert created.status_code == 200, created.text
    session = f"/v1/sessions/{sid}"

    for headers in ({"X-Run-Id": "runA"}, auth("wrong", "runA"), {"Authorization": "keyA"}):
        assert_error(client.get(session, headers=headers), 401, "invalid_api_key", r"key")

    # keyA: its own run, named or implied by the key (scoped to exactly one run)
    for headers in (auth("keyA", "runA"), auth("keyA")):
        own = client.get(session, headers=headers)
        assert own.status_code == 200, own.text
        assert own.json()["metadata"] == {"secret": SECRET}
    refused = [
        client.get(session, headers=auth("keyA", "runB")),
        client.post(f"{session}/close", json={}, headers=auth("keyA", "runB")),
        client.post("/v1/sessions", json={"run": "runB"}, headers=auth("keyA")),
        client.post(
            f"/runs/runB/sessions/{sid}/v1/chat/completions", json=ask, headers=auth("keyA")
        ),
        client.get(session, headers=auth("keyB", "runA")),
    ]
    for answer in refused:
        assert_error(answer, 403, "run_not_allowed", r"run")
        assert SECRET not in answer.text
    not_in_b = client.get(session, headers=auth("keyB"))  # keyB's run is runB: no such session
    assert_error(not_in_b, 404, "session_not_found", sid)
    assert SECRET not in not_in_b.text

    # The global key reaches both runs.
    assert client.get(session, headers=auth("keyG", "runA")).json()["metadata"] == {
        "secret": SECRET
    }
    in_b = client.post(
        "/v1/sessions", json={"run": "runB", "session_id": sid}, headers=auth("keyG")
    )
    assert in_b.status_code == 200 and in_b.json()["run"] == "runB", in_b.text
    turn = client.post(
        f"/runs/runB/sessions/{sid}/v1/chat/completions", json=ask, headers=auth("keyB")
    )
    assert turn.status_code == 200, turn.text
    assert client.get(session, headers=auth("keyG", "runB")).json()["turns"] == 1
    assert client.get(session, headers=auth("keyG", "runA")).json()["turns"] == 0


def test_health_is_open_and_metrics_need_a_key_only_with_metrics_auth(
    gateway: GatewayProcess, keyed: GatewayProcess
) -> None:
    assert httpx.get(f"{gateway.url}/metrics").status_code == 200
    assert httpx.get(f"{keyed.url}/health").status_code == 200
    assert_error(httpx.get(f"{keyed.url}/metrics"), 401, "invalid_api_key", r"key")
    keyed_metrics = httpx.get(f"{keyed.url}/metrics", headers={"Authorization": "Bearer keyG"})
    assert keyed_metrics.status_code == 200
    assert "turnstream_gateway_errors_total" in keyed_metrics.text
