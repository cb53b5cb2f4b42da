"""``turnstream gateway --workers 2``: two real gateway processes behind one port, the real openai
SDK, the tiny local model and a real nats-server. Every request is served by its session's owner
(the connection moves to it), so each session lives in one worker's memory and continues token
for token; a killed worker comes back and its sessions go on from the log. With
``--worker-routing any`` a session's turns land on both workers, and still continue token for
token: the worker whose copy is behind catches up from the log.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from eventlog.server import NatsServer
from schemas import TurnCompleted
from schemas.ids import session_owner
from tests.e2e.test_gateway import FAST_PUBLISH, events_of, full_prompts, turns_of
from tests.e2e.test_supervision import _one_closed_session
from tests.helpers.gateway_process import GatewayProcess
from tests.helpers.services import shard_table_rows
from tests.helpers.up_process import UpProcess
from tests.helpers.waiting import wait_for

pytestmark = pytest.mark.integration

WORKERS = 2
SESSIONS = 12
TURNS = 3


class WorkersProcess(GatewayProcess):
    """Three processes start (the supervisor, then two workers, each loading torch and the
    model) on the machine's cores: longer to be healthy than one gateway."""

    def _wait_healthy(self, timeout: float) -> None:
        super()._wait_healthy(max(timeout, 300))


@pytest.fixture
def gateway(
    nats_server: NatsServer, tiny_model_dir: Path, tmp_path: Path
) -> Iterator[GatewayProcess]:
    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "400"  # rich's log lines unwrapped, for the log checks below
    try:
        process = WorkersProcess(
            nats_server.url, tiny_model_dir, tmp_path, "--workers", str(WORKERS), *FAST_PUBLISH
        )
    finally:
        if columns is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = columns
    yield process
    process.stop()


@pytest.fixture
def any_gateway(
    nats_server: NatsServer, tiny_model_dir: Path, tmp_path: Path
) -> Iterator[GatewayProcess]:
    process = WorkersProcess(
        nats_server.url,
        tiny_model_dir,
        tmp_path,
        *("--workers", str(WORKERS), "--worker-routing", "any", *FAST_PUBLISH),
    )
    yield process
    process.stop()


def worker_pids(gateway: GatewayProcess) -> dict[int, int]:
    found = re.findall(r"gateway worker (\d+) started \(pid (\d+)\)", gateway.log_path.read_text())
    return {int(i): int(pid) for i, pid in found}  # the latest start of each


def stopped_lines(gateway: GatewayProcess) -> list[tuple[int, int, int]]:
    """(sessions held, connections moved out, moved in) of each worker, once it stopped."""
    return stopped_lines_of(gateway.log_path.read_text())


def stopped_lines_of(text: str) -> list[tuple[int, int, int]]:
    found = re.findall(r"stopped: (\d+) sessions held, (\d+) connections moved out, (\d+) in", text)
    return [(int(a), int(b), int(c)) for a, b, c in found]


def assert_continued(nats_server: NatsServer, session: str, turns: int) -> list[TurnCompleted]:
    """Exactly one TurnCompleted per answer, each continuing the one before, token for token."""
    recorded = turns_of(events_of(nats_server, session))
    assert [t.turn for t in recorded] == list(range(turns))
    prompts = full_prompts(recorded)
    for t in range(1, turns):
        previous = prompts[t - 1] + recorded[t - 1].completion_ids.tolist()
        assert recorded[t].parent_turn == t - 1, "a fork: the turn did not continue its session"
        assert recorded[t].prefix_len == len(previous)
    return recorded


def chat(client: httpx.Client, session: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    response = client.post(
        "/v1/chat/completions",
        json={"model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0},
        headers={"X-Session-Id": session},
    )
    assert response.status_code == 200, response.text
    return dict(response.json()["choices"][0]["message"])


def test_sessions_over_shared_keep_alive_connections_stay_with_their_owner(
    gateway: GatewayProcess, nats_server: NatsServer
) -> None:
    sessions = [f"kept-{i}" for i in range(SESSIONS)]
    assert {session_owner(s, WORKERS) for s in sessions} == set(range(WORKERS))
    histories: dict[str, list[dict[str, Any]]] = {s: [] for s in sessions}
    # One client, few connections, many sessions: each connection carries several sessions.
    limits = httpx.Limits(max_connections=4, max_keepalive_connections=4)
    with (
        httpx.Client(base_url=gateway.url, limits=limits, timeout=60) as client,
        ThreadPoolExecutor(4) as pool,
    ):

        def turn(session: str, t: int) -> None:
            history = histories[session]
            history.append({"role": "user", "content": f"turn {t} of {session}"})
            history.append({"role": "assistant", **chat(client, session, history)})

        for t in range(TURNS):
            list(pool.map(lambda s, t=t: turn(s, t), sessions))
        # A session opened by POST /v1/sessions is made by, and lands on, its owner.
        created = [client.post("/v1/sessions", json={}).json() for _ in range(6)]
        for made in created:
            sdk = openai.OpenAI(base_url=made["base_url"], api_key="x", max_retries=0)
            messages: list[Any] = []
            for t in range(2):
                messages.append({"role": "user", "content": f"hi {t}"})
                reply = sdk.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
                messages.append(reply.choices[0].message.model_dump(exclude_none=True))
        # Bad input is still a 4xx OpenAI error, on any worker.
        bad = client.post(
            "/v1/chat/completions", content=b"{not json", headers={"X-Session-Id": "kept-0"}
        )
        assert bad.status_code == 400 and "error" in bad.json()
        missing = client.post("/v1/chat/completions", json={"model": "tiny", "messages": []})
        assert missing.status_code == 400
        assert client.get("/v1/sessions/not-a-session").status_code == 404
        assert client.get("/health").status_code == 200

    # /metrics on any worker counts the turns of all of them (prometheus multiprocess mode).
    for _ in range(4):  # a new connection each time: it lands on either worker
        text = httpx.get(f"{gateway.url}/metrics", timeout=10).text
        turns = [line for line in text.splitlines() if line.startswith("turnstream_gateway_turns")]
        assert sum(float(line.rsplit(" ", 1)[1]) for line in turns if "_total" in line) == (
            SESSIONS * TURNS + 2 * len(created)
        )
    for session in sessions:
        assert_continued(nats_server, session, TURNS)
    for made in created:
        assert_continued(nats_server, made["session_id"], 2)
    assert {session_owner(m["session_id"], WORKERS) for m in created} <= set(range(WORKERS))

    gateway.stop()
    # (a worker outliving a supervisor killed after its 10 s still stops, at its stdin's end)
    wait_for(lambda: len(stopped_lines(gateway)) == WORKERS, 60, "every worker logs its stop")
    stopped = stopped_lines(gateway)
    # Each session was loaded by one worker only (its owner): the held sessions add up.
    assert sum(held for held, _, _ in stopped) == SESSIONS + len(created)
    assert sum(moved for _, moved, _ in stopped) == sum(adopted for _, _, adopted in stopped) > 0


def test_a_killed_worker_is_restarted_and_its_sessions_continue(
    gateway: GatewayProcess, nats_server: NatsServer
) -> None:
    sessions = [f"revive-{i}" for i in range(6)]
    histories: dict[str, list[dict[str, Any]]] = {s: [] for s in sessions}
    with httpx.Client(base_url=gateway.url, timeout=120) as client:
        for t in range(2):
            for session in sessions:
                history = histories[session]
                history.append({"role": "user", "content": f"turn {t}"})
                history.append({"role": "assistant", **chat(client, session, history)})
        pids = worker_pids(gateway)
        assert len(pids) == WORKERS
        os.kill(pids[1], signal.SIGKILL)
        deadline = time.monotonic() + 120
        while worker_pids(gateway)[1] == pids[1]:
            assert time.monotonic() < deadline, "the killed worker was not started again"
            time.sleep(0.1)
        # Its sessions (and the others) continue: requests for it wait until it is back.
        for session in sessions:
            history = histories[session]
            history.append({"role": "user", "content": "after the restart"})
            history.append({"role": "assistant", **chat(client, session, history)})
    for session in sessions:
        assert_continued(nats_server, session, 3)
    assert "exited with code -9: starting it again" in gateway.log_path.read_text()


def test_up_with_two_gateway_workers_folds_their_sessions_into_shards(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    up = UpProcess(tmp_path, tiny_model_dir, "--workers", str(WORKERS))
    try:
        up.wait_healthy(300)
        sessions = [_one_closed_session(up) for _ in range(4)]  # made by either worker

        def in_shards() -> bool:
            stored = {r["session"] for r in shard_table_rows(tmp_path / "shards")}
            return all(session in stored for session, _ in sessions)

        wait_for(in_shards, 120, "every session of the worker gateways in the shards")
        assert up.stop() == 0, up.output()[-4000:]
        assert len(stopped_lines_of(up.output())) == WORKERS  # up waits for its workers
    finally:
        up.cleanup()


def serving_worker(conn: http.client.HTTPConnection, port: int, pids: dict[int, int]) -> int | None:
    """The worker whose process holds the server's end of ``conn`` (``/proc``: the socket's
    inode, found by the connection's two ports)."""
    assert conn.sock is not None
    client_port = conn.sock.getsockname()[1]
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.read().splitlines()[1:]:
                fields = row.split()
                local, remote = (int(a.rsplit(":", 1)[1], 16) for a in fields[1:3])
                if (local, remote) == (port, client_port):
                    inodes.add(f"socket:[{fields[9]}]")
    for index, pid in pids.items():
        for fd in os.scandir(f"/proc/{pid}/fd"):
            try:
                if os.readlink(fd.path) in inodes:
                    return index
            except OSError:
                continue  # closed meanwhile
    return None


def post(conn: http.client.HTTPConnection, path: str, body: Any, session: str) -> Any:
    headers = {"content-type": "application/json", "X-Session-Id": session}
    conn.request("POST", path, json.dumps(body), headers)
    response = conn.getresponse()
    return response.status, json.loads(response.read())


def test_with_routing_any_a_session_continues_token_exact_on_both_workers(
    any_gateway: GatewayProcess, nats_server: NatsServer
) -> None:
    pids = worker_pids(any_gateway)
    assert len(pids) == WORKERS
    # Connections until one is served by each worker (the kernel picks by their ports).
    on: dict[int, http.client.HTTPConnection] = {}
    for _ in range(64):
        conn = http.client.HTTPConnection("127.0.0.1", any_gateway.port, timeout=60)
        conn.request("GET", "/health")  # answered: accepted by the worker that serves it
        assert conn.getresponse().read()
        worker = serving_worker(conn, any_gateway.port, pids)
        if worker is None or worker in on:
            conn.close()
            continue
        on[worker] = conn
        if len(on) == WORKERS:
            break
    assert sorted(on) == list(range(WORKERS)), "no connection landed on one of the workers"
    session, turns = "anywhere", 6
    messages: list[dict[str, Any]] = []
    for t in range(turns):  # worker 0, 1, 0, 1, ...: each turn continues one the other served
        messages.append({"role": "user", "content": f"turn {t}"})
        body = {"model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0}
        status, answer = post(on[t % WORKERS], "/v1/chat/completions", body, session)
        assert status == 200, answer
        messages.append({"role": "assistant", **answer["choices"][0]["message"]})
    assert_continued(nats_server, session, turns)
    # Closed on one worker, closed for the other: its next turn is refused, nothing recorded.
    status, _ = post(on[0], f"/v1/sessions/{session}/close", {}, session)
    assert status == 200
    messages.append({"role": "user", "content": "after the close"})
    body = {"model": "tiny", "messages": messages, "max_tokens": 8}
    status, answer = post(on[1], "/v1/chat/completions", body, session)
    assert status == 409 and session in answer["error"]["message"], answer
    assert len(turns_of(events_of(nats_server, session))) == turns
    metrics = httpx.get(f"{any_gateway.url}/metrics", timeout=10).text
    reads = [
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("turnstream_gateway_catch_up_reads_total")
    ]
    assert sum(reads) > 0, "no worker caught up from the log"
    for conn in on.values():
        conn.close()
