"""Turns of one session served at once, and a streamed turn whose client went away (issue 35):
a real gateway (``--backend vllm``) in front of the benchmarks' fixed-latency backend, whose own
counters say how many completions it had in flight at once, and a real nats-server.

Overlap is asserted by the backend's count, never by wall-clock time: with the session lock
held across generation (as before issue 35) it never sees two completions of one session at
once.
"""

from __future__ import annotations

import json
import socket
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from eventlog.server import NatsServer
from schemas import TurnCompleted
from tests.e2e.test_gateway import events_of, turns_of
from tests.helpers.gateway_process import GatewayProcess
from tests.helpers.scripted_gateway import scripted_gateway

pytestmark = pytest.mark.integration

CONVERSATIONS = 4
# The backend answers after this long, then a token every ITL_MS: long enough that a client can
# read the stream's first event and leave while the backend still generates.
TTFT_MS, ITL_MS = 2000, 50


@dataclass
class Stack:
    gateway: GatewayProcess
    backend: str
    completion: list[int]


@pytest.fixture(scope="module")
def stack(
    nats_server: NatsServer, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    completion = [*tokenizer.encode("Done, all of it.", add_special_tokens=False)]
    completion.append(int(tokenizer.eos_token_id))
    data = tmp_path_factory.mktemp("concurrent")
    timing = ("--ttft-ms", str(TTFT_MS), "--itl-ms", str(ITL_MS))
    with scripted_gateway(nats_server.url, tiny_model_dir, data, completion, *timing) as (
        gateway,
        backend,
    ):
        yield Stack(gateway, backend, completion)


def backend_stats(stack: Stack) -> dict[str, int]:
    return dict(httpx.get(f"{stack.backend}/stats", timeout=5).json())


def chat(
    stack: Stack, sid: str, content: str, headers: dict[str, str] | None = None, **extra: Any
) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], **extra}
    return httpx.post(
        f"{stack.gateway.url}/v1/chat/completions",
        json=body,
        headers={"X-Session-Id": sid, **(headers or {})},
        timeout=120,
    )


def test_conversations_of_one_session_are_in_flight_together(
    stack: Stack, nats_server: NatsServer
) -> None:
    sid = f"together-{uuid.uuid4().hex[:8]}"
    chat(stack, sid, "open the session").raise_for_status()  # one turn, alone
    before = backend_stats(stack)
    assert before["most_in_flight"] == 1

    with ThreadPoolExecutor(CONVERSATIONS) as pool:
        answers = list(pool.map(lambda i: chat(stack, sid, f"sub-task {i}"), range(CONVERSATIONS)))

    assert [a.status_code for a in answers] == [200] * CONVERSATIONS
    assert backend_stats(stack)["most_in_flight"] == CONVERSATIONS
    turns = turns_of(events_of(nats_server, sid))
    assert [t.turn for t in turns] == list(range(CONVERSATIONS + 1))
    ids = sorted(a.json()["id"] for a in answers)
    assert ids == sorted(f"chatcmpl-{sid}-{t.reply_id}" for t in turns[1:])
    assert len({t.sampling["seed"] for t in turns}) == len(turns)


def test_a_streamed_turn_whose_client_left_is_recorded_whole_as_client_gone(
    stack: Stack, nats_server: NatsServer
) -> None:
    sid = f"gone-{uuid.uuid4().hex[:8]}"
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "a long task"}],
        "stream": True,
    }
    payload = json.dumps(body).encode()
    host, port = stack.gateway.url.removeprefix("http://").split(":")
    # A raw socket: read the stream's first event, then close the connection (what a client
    # that times out, or Codex `exec` exiting mid-sub-agent, does).
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\n"
            b"content-type: application/json\r\nx-session-id: " + sid.encode() + b"\r\n"
            b"content-length: %d\r\n\r\n%b" % (len(payload), payload)
        )
        received = b""
        while b"data: " not in received:
            chunk = conn.recv(65536)
            assert chunk, "the gateway closed the stream before its first event"
            received += chunk
    assert b" 200 " in received.split(b"\r\n", 1)[0]
    assert backend_stats(stack)["in_flight"] == 1, "the backend is still generating"

    turn = _recorded_turn(nats_server, sid)
    assert turn.client_gone, "the client left before the reply was whole"
    assert turn.completion_ids.tolist() == stack.completion  # the whole completion
    assert turn.finish_reason == "stop" and turn.reply_id.encode() in received

    # The client's retry of that request samples anew: the turn it never saw is no tip to
    # answer a resend with (nor a conversation to continue).
    again = chat(stack, sid, "a long task")
    assert again.status_code == 200
    turns = turns_of(events_of(nats_server, sid))
    assert len(turns) == 2 and not turns[1].client_gone
    assert again.json()["id"] == f"chatcmpl-{sid}-{turns[1].reply_id}"


def _recorded_turn(nats_server: NatsServer, sid: str) -> TurnCompleted:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        turns = turns_of(events_of(nats_server, sid))
        if turns:
            [turn] = turns
            return turn
        time.sleep(0.2)
    raise AssertionError(f"no turn of session {sid} in the log after its client left")


def _stream_and_leave(stack: Stack, sid: str, content: str, agent: str) -> bytes:
    """A streamed request whose client reads the status line and leaves."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "stream": True}
    payload = json.dumps(body).encode()
    host, port = stack.gateway.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\n"
            b"content-type: application/json\r\nx-session-id: " + sid.encode() + b"\r\n"
            b"x-turnstream-agent: " + agent.encode() + b"\r\n"
            b"content-length: %d\r\n\r\n%b" % (len(payload), payload)
        )
        return conn.recv(65536).split(b"\r\n", 1)[0]


def test_a_burst_of_retries_fan_outs_and_cut_streams_in_one_session_adds_up(
    stack: Stack, nats_server: NatsServer
) -> None:
    """At once, in one session: one agent's request sent 6 times (a client retrying while the
    first still generates: one turn), 6 agents' identical requests (a fan-out: 6 turns), and 4
    streams whose clients leave at once (4 turns, client_gone). No 5xx, every turn once, the
    indices the log's 0..n-1 however they interleaved, each seed its own."""
    sid = f"burst-{uuid.uuid4().hex[:8]}"

    def retried(_: int) -> httpx.Response:
        return chat(stack, sid, "the same task", headers={"X-Turnstream-Agent": "retrier"})

    def fanned(i: int) -> httpx.Response:
        return chat(stack, sid, "the same task", headers={"X-Turnstream-Agent": f"explorer-{i}"})

    with ThreadPoolExecutor(16) as pool:
        retries = [pool.submit(retried, i) for i in range(6)]
        fan_out = [pool.submit(fanned, i) for i in range(6)]
        cut = [pool.submit(_stream_and_leave, stack, sid, f"cut {i}", f"cut-{i}") for i in range(4)]
        answers = [f.result() for f in (*retries, *fan_out)]
        status_lines = [f.result() for f in cut]

    assert [a.status_code for a in answers] == [200] * 12, [a.text for a in answers]
    assert all(b" 200 " in line for line in status_lines), status_lines
    assert len({a.json()["id"] for a in answers[:6]}) == 1  # one model call, one turn
    assert len({a.json()["id"] for a in answers[6:]}) == 6  # six agents, six samples
    deadline = time.monotonic() + 60
    while len(turns := turns_of(events_of(nats_server, sid))) < 11:
        assert time.monotonic() < deadline, f"{len(turns)} turns in the log, not 11"
        time.sleep(0.2)
    assert [t.turn for t in turns] == list(range(11))
    by_agent: dict[str, list[TurnCompleted]] = {}
    for t in turns:
        by_agent.setdefault(t.agent["id"], []).append(t)
    assert len(by_agent["retrier"]) == 1 and not by_agent["retrier"][0].client_gone
    assert all(len(by_agent[f"explorer-{i}"]) == 1 for i in range(6))
    assert all(by_agent[f"cut-{i}"][0].client_gone for i in range(4))
    assert len({t.sampling["seed"] for t in turns}) == 11
