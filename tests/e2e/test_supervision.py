"""Supervised servers (DESIGN §8): an embedded nats-server never outlives the process that
started it, two servers never share a store, and ``up`` restarts a server that died.

Real ``turnstream`` processes, real signals; PIDs are read from the store's lock file.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai

from eventlog.server import pid_alive, read_holder
from tests.helpers.services import shard_table_rows
from tests.helpers.up_process import UpProcess
from tests.helpers.waiting import wait_for


def _one_closed_session(up: UpProcess) -> tuple[str, int]:
    """A session with one answered turn, closed with a reward: (session id, completion tokens)."""
    opened = httpx.post(f"{up.url}/v1/sessions", json={}, timeout=30).json()
    client = openai.OpenAI(base_url=opened["base_url"], api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert reply.usage is not None
    closed = httpx.post(
        f"{up.url}/v1/sessions/{opened['session_id']}/close", json={"reward": 1.0}, timeout=30
    )
    assert closed.status_code == 200, closed.text
    return opened["session_id"], reply.usage.completion_tokens


def test_kill_9_of_up_takes_its_server_along_and_the_next_up_keeps_what_was_acknowledged(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    first = UpProcess(tmp_path, tiny_model_dir)
    second: UpProcess | None = None
    try:
        first.wait_healthy()
        session, completion_tokens = _one_closed_session(first)
        server = first.server_pid()

        first.kill()  # right after the close was acknowledged: maybe not folded yet
        second = UpProcess(tmp_path, tiny_model_dir)  # at once, as a user would

        wait_for(lambda: not pid_alive(server), 30, f"orphaned nats-server pid {server} exits")
        second.wait_healthy()
        assert second.server_pid() != server

        def in_shards() -> bool:
            return any(r["session"] == session for r in shard_table_rows(tmp_path / "shards"))

        wait_for(in_shards, 60, f"session {session} closed before the kill is in the shards")
        [row] = [r for r in shard_table_rows(tmp_path / "shards") if r["session"] == session]
        assert row["reward"] == 1.0 and row["response_len"] == completion_tokens

        new_server = second.server_pid()
        assert second.stop() == 0, second.output()[-4000:]
        assert not pid_alive(new_server)  # stop() reaped it: gone, not a zombie
        assert read_holder(tmp_path / "nats") == {}  # the lock is released
    finally:
        first.cleanup()
        if second is not None:
            second.cleanup()


def test_a_second_up_on_the_same_store_exits_naming_the_first(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    first = UpProcess(tmp_path, tiny_model_dir)
    second: UpProcess | None = None
    try:
        first.wait_healthy()
        server = first.server_pid()

        second = UpProcess(tmp_path, tiny_model_dir)
        assert second.proc.wait(120) == 1
        said = " ".join(second.output().split())  # the console wraps long lines

        assert f"is in use by nats-server pid {server} started by pid {first.pid}" in said
        assert str(tmp_path / "nats") in said
        assert pid_alive(server) and first.proc.poll() is None  # the first is untouched
        assert httpx.get(f"{first.url}/health", timeout=5).status_code == 200
        assert first.stop() == 0, first.output()[-4000:]
    finally:
        first.cleanup()
        if second is not None:
            second.cleanup()


def test_up_restarts_a_nats_server_that_was_killed(tmp_path: Path, tiny_model_dir: Path) -> None:
    up = UpProcess(tmp_path, tiny_model_dir)
    try:
        up.wait_healthy()
        before, _ = _one_closed_session(up)
        server = up.server_pid()

        os.kill(server, signal.SIGKILL)

        wait_for(
            lambda: read_holder(tmp_path / "nats").get("server_pid") not in (None, server),
            60,
            "up starts a new nats-server on its store",
        )
        restarted = up.server_pid()
        assert pid_alive(restarted) and up.proc.poll() is None
        up.wait_healthy(60)  # the gateway reconnected by itself
        after, _ = _one_closed_session(up)

        def both_in_shards() -> bool:
            sessions = {r["session"] for r in shard_table_rows(tmp_path / "shards")}
            return {before, after} <= sessions

        wait_for(both_in_shards, 60, "the sessions before and after the restart in the shards")
        said = " ".join(up.output().split())
        assert "was killed by SIGKILL; restarting it (1 of at most 5" in said
        assert up.stop() == 0, up.output()[-4000:]
        assert not pid_alive(restarted)
    finally:
        up.cleanup()


def test_sigterm_of_the_gateway_stops_its_embedded_server(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    from eventlog.server import free_port

    port = free_port()
    log_path = tmp_path / "gateway.log"
    with log_path.open("wb") as log_file:
        gateway = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "turnstream.cli",
                "gateway",
                "--port",
                str(port),
                "--data-dir",
                str(tmp_path),
                "--model",
                str(tiny_model_dir),
            ],
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    server: int | None = None
    try:

        def healthy() -> bool:
            assert gateway.poll() is None, log_path.read_text()[-4000:]
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(healthy, 120, "the gateway answers /health")
        holder = read_holder(tmp_path / "nats")
        assert holder["pid"] == gateway.pid
        server = holder["server_pid"]
        assert isinstance(server, int) and pid_alive(server)

        gateway.terminate()

        # 0, not -15: the command stopped by itself, so its publisher and server were closed
        # in order (uvicorn's own handlers used to re-raise SIGTERM and kill it mid-way).
        assert gateway.wait(60) == 0, log_path.read_text()[-4000:]
        assert not pid_alive(server)
        assert read_holder(tmp_path / "nats") == {}
    finally:
        if gateway.poll() is None:
            gateway.kill()
            gateway.wait()
        if server is not None and pid_alive(server):
            os.kill(server, signal.SIGKILL)
