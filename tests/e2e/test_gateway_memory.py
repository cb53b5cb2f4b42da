"""Bounded memory (issue 9): closed sessions are evicted after a grace period, open ones
least-recently-used beyond ``--max-open-sessions``, and an evicted session is recovered from the
log on its next turn, token-exact. A real gateway and a real nats-server.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from eventlog.server import NatsServer
from tests.e2e.test_gateway import assistant_turn, client_for, events_of, full_prompts, turns_of
from tests.helpers.gateway_process import GatewayProcess
from tests.helpers.hostile import PeakRss, open_session, served_model

pytestmark = pytest.mark.integration

MAX_OPEN = 100
GRACE_S = 0.5
CLIENTS = 16
HALF = 2_500
BLOB = "m" * 8192  # each session's metadata holds 8 KiB: a leak of HALF sessions is >= 20 MiB
# Growth allowed from the first HALF sessions to the second: allocator noise (< 1 MB per 2,500
# stateless requests measured) and the sessions the grace period holds (a few hundred at most,
# the same in both halves), well under the >= 20 MiB that keeping the second HALF sessions'
# metadata alone would add.
TOLERANCE_MB = 5.0


@pytest.fixture(scope="module")
def gateway(
    nats_server: NatsServer, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    process = GatewayProcess(
        nats_server.url,
        tiny_model_dir,
        tmp_path_factory.mktemp("gateway"),
        "--max-open-sessions",
        str(MAX_OPEN),
        "--closed-session-grace-s",
        str(GRACE_S),
    )
    yield process
    process.stop()


@pytest.fixture
def client(gateway: GatewayProcess) -> Iterator[httpx.Client]:
    limits = httpx.Limits(max_connections=CLIENTS)
    with httpx.Client(base_url=gateway.url, limits=limits, timeout=60) as client:
        yield client


def open_and_close(client: httpx.Client, i: int) -> None:
    session = open_session(client, metadata={"i": i, "blob": BLOB})
    closed = client.post(f"/v1/sessions/{session['session_id']}/close", json={"reward": 1.0})
    assert closed.status_code == 200, closed.text


def held_sessions(client: httpx.Client) -> int:
    return int(client.get("/health").json()["sessions"])


def test_5000_closed_sessions_leave_the_gateway_rss_flat(
    gateway: GatewayProcess, client: httpx.Client
) -> None:
    memory = PeakRss(gateway.proc.pid)
    with ThreadPoolExecutor(CLIENTS) as pool:
        list(pool.map(lambda i: open_and_close(client, i), range(HALF)))
        after_first = memory.rss_mb()
        list(pool.map(lambda i: open_and_close(client, i), range(HALF, 2 * HALF)))
        after_second = memory.rss_mb()
    growth = after_second - after_first
    assert growth < TOLERANCE_MB, f"RSS {after_first:.1f} -> {after_second:.1f} MB"

    # Once the grace has passed, closed sessions go (eviction runs on the next session event).
    deadline = time.monotonic() + 30
    while (held := held_sessions(client)) > MAX_OPEN:
        assert time.monotonic() < deadline, f"the gateway still holds {held} sessions"
        time.sleep(GRACE_S)
        open_and_close(client, -1)


def test_an_evicted_open_session_continues_token_exact(
    gateway: GatewayProcess, client: httpx.Client, nats_server: NatsServer
) -> None:
    model = served_model(gateway.url)
    session = open_session(client)
    agent = client_for(session)
    messages: list[dict[str, object]] = [{"role": "user", "content": "Tell me a story."}]
    first = agent.chat.completions.create(
        model=model, messages=messages, max_tokens=8, temperature=0
    )

    with ThreadPoolExecutor(CLIENTS) as pool:  # 150 newer open sessions: S is least recent
        list(pool.map(lambda _: open_session(client), range(MAX_OPEN + 50)))
    assert held_sessions(client) <= MAX_OPEN

    messages += [assistant_turn(first.choices[0].message), {"role": "user", "content": "Go on."}]
    agent.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)

    turns = turns_of(events_of(nats_server, str(session["session_id"])))
    assert [t.turn for t in turns] == [0, 1]
    context = full_prompts(turns)[0] + turns[0].completion_ids.tolist()
    assert turns[1].prefix_len == len(context), "the recovered session re-rendered its prompt"
    assert [m["role"] for m in turns[1].new_messages] == ["user"]
    assert client.get(f"/v1/sessions/{session['session_id']}").json()["turns"] == 2
