"""``<data_dir>/stack.json`` and ``turnstream status`` (issue 11, point 7): ``up`` says where it
can be joined while it runs; ``status``, ``inspect`` and ``train`` join it without flags; status
counts sessions per run (open / closed / folded)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from consumers import FoldWorker
from eventlog import JetStreamPublisher, connect
from schemas.events import SessionEvent
from tests.conftest import FAST_LOG, Log
from tests.helpers.sessions import append_only, session_events
from tests.helpers.streams import publish_events
from tests.helpers.up_process import UpProcess
from tests.helpers.waiting import wait_for

pytestmark = pytest.mark.integration


def turnstream(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "turnstream.cli", *args],
        capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip


def sessions_rows(output: str) -> dict[str, list[str]]:
    """run -> [open, closed, folded] from status's sessions table."""
    table = output[output.index("sessions per run") :]
    table = table[: table.index("\n\n")] if "\n\n" in table else table
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if len(cells) == 4 and cells[0] not in ("run", ""):
            rows[cells[0]] = cells[1:]
    return rows


def _answered_after_stack_file(up: UpProcess, stack_file: Path) -> bool:
    """Whether up's gateway answers /health; when it does, stack.json is there once the answer
    is in (a script that waits for /health finds the file). Looked for after the answer, not
    before the request: up may write the file and start serving while the request is made."""
    assert up.proc.poll() is None, up.output()[-4000:]
    try:
        answered = httpx.get(f"{up.url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
    assert not answered or stack_file.exists(), (
        f"/health answered before stack.json:\n{up.output()[-4000:]}"
    )
    return answered


def wait_for_file(path: Path, up: UpProcess, timeout: float = 60) -> dict[str, object]:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert up.proc.poll() is None, up.output()[-4000:]
        assert time.monotonic() < deadline, f"{path} never appeared:\n{up.output()[-4000:]}"
        time.sleep(0.05)
    found: dict[str, object] = json.loads(path.read_text())
    return found


async def test_status_counts_sessions_per_run_open_closed_and_folded(
    log: Log, tmp_path: Path
) -> None:
    def session(run: str, name: str, close: bool = True) -> list[SessionEvent]:
        return session_events(append_only(2), run=run, session=name, close=close)

    # Folded by a real fold worker: ra/f1, ra/f2, rb/f1.
    folded = [("ra", "f1"), ("ra", "f2"), ("rb", "f1")]
    await publish_events(log.nc, [e for run, name in folded for e in session(run, name)])
    publisher = await JetStreamPublisher(log.nc).start()
    worker, stop = FoldWorker(log.js, publisher), asyncio.Event()
    running = asyncio.create_task(worker.run(stop))
    while worker.stats.sessions_folded < 3:
        assert not running.done(), running
        await asyncio.sleep(0.05)
    stop.set()
    await running
    await publisher.close()
    # Closed after the worker stopped: not folded. Never closed: open.
    await publish_events(
        log.nc,
        [*session("ra", "c1"), *session("ra", "o1", False), *session("ra", "o2", False),
         *session("rc", "o1", False)],
    )  # fmt: skip

    done = turnstream("status", "--log.url", log.server.url, "--data-dir", str(tmp_path))

    assert done.returncode == 0, done.stderr
    assert done.stderr.startswith(
        f"log {log.server.url} (--log.url); shards {tmp_path / 'shards'} (<data_dir>/shards)"
    )
    assert sessions_rows(done.stderr) == {
        "ra": ["2", "3", "2"],
        "rb": ["0", "1", "1"],
        "rc": ["1", "0", "0"],
    }


def test_status_without_a_url_or_a_live_stack_says_what_to_pass(tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a stack.json left by an `up` that was killed names a dead pid: ignored
    (tmp_path / "stack.json").write_text(
        json.dumps({"gateway_url": "http://127.0.0.1:1", "openai_base_url": "x",
                    "nats_url": "nats://127.0.0.1:1", "data_dir": str(tmp_path), "shards": "x",
                    "run": "r", "pids": {"up": gone.pid}, "started_at": 0.0})
    )  # fmt: skip

    done = turnstream("status", "--data-dir", str(tmp_path))

    assert done.returncode == 1
    assert "status needs --log.url (or TURNSTREAM_LOG__URL), or a running `turnstream up`" in (
        done.stderr
    )


def test_up_writes_stack_json_that_status_and_inspect_join_and_removes_it(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    data = tmp_path / "data"
    up = UpProcess(data, tiny_model_dir)
    try:
        wait_for(lambda: _answered_after_stack_file(up, data / "stack.json"), 120, "up answering")
        up.wait_healthy()
        stack = wait_for_file(data / "stack.json", up)

        assert stack["gateway_url"] == up.url and stack["openai_base_url"] == f"{up.url}/v1"
        assert stack["run"] == "up" and stack["data_dir"] == str(data.absolute())
        assert stack["shards"] == str(data / "shards") and stack["model_dir"] == str(tiny_model_dir)
        assert stack["pids"] == {"up": up.pid, "nats_server": up.server_pid()}
        assert isinstance(stack["started_at"], float) and stack["started_at"] <= time.time()
        assert httpx.get(f"{stack['gateway_url']}/health").json()["log"] == "connected"
        assert asyncio.run(_events_stream_exists(str(stack["nats_url"])))

        # An agent's session, closed, and one left open.
        opened = httpx.post(f"{up.url}/v1/sessions", json={"group": "g"}).json()
        client = openai.OpenAI(base_url=opened["base_url"], api_key="unused", max_retries=0)
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        client.close()
        httpx.post(f"{up.url}/v1/sessions/{opened['session_id']}/close", json={"reward": 1.0})
        httpx.post(f"{up.url}/v1/sessions", json={})

        # Neither --log.url nor --run: both from stack.json.
        status = turnstream("status", "--data-dir", str(data))
        assert status.returncode == 0, status.stderr
        assert f"log {stack['nats_url']} (from {data / 'stack.json'})" in status.stderr
        assert f"shards {data / 'shards'} (from {data / 'stack.json'})" in status.stderr
        open_, closed, _ = sessions_rows(status.stderr)["up"]
        assert (open_, closed) == ("1", "1")

        shown = turnstream("inspect", opened["session_id"], "--data-dir", str(data))
        assert shown.returncode == 0, shown.stderr
        assert re.search(r"^run +up *$", shown.stdout, re.M)
        assert re.search(r"^status +completed *$", shown.stdout, re.M)
        assert f"trajectory up/{opened['session_id']}/0 · turn 0" in shown.stdout

        assert up.stop() == 0, up.output()[-4000:]
        assert not (data / "stack.json").exists()  # removed on exit
        # A service's log is lines: no progress bar of transformers' model loading.
        assert "Loading weights" not in up.output()
    finally:
        up.cleanup()


def test_a_stack_file_of_another_running_up_is_neither_replaced_nor_removed(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    theirs = json.dumps({"gateway_url": "http://127.0.0.1:1", "openai_base_url": "x",
                         "nats_url": "nats://127.0.0.1:1", "data_dir": str(data), "shards": "x",
                         "run": "r", "pids": {"up": os.getpid()}, "started_at": 0.0})  # fmt: skip
    (data / "stack.json").write_text(theirs)  # this test's process stands for the other up
    up = UpProcess(data, tiny_model_dir)
    try:
        up.wait_healthy()
        deadline = time.monotonic() + 60
        while "names another turnstream up that is still running" not in up.output():
            assert time.monotonic() < deadline, up.output()[-4000:]
            time.sleep(0.05)
        assert (data / "stack.json").read_text() == theirs
        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(60) == 0, up.output()[-4000:]
        assert (data / "stack.json").read_text() == theirs
    finally:
        up.cleanup()


async def _events_stream_exists(url: str) -> bool:
    nc = await connect(url, FAST_LOG, name="test-stack-file")
    try:
        return (await nc.jetstream().stream_info("EVENTS")).config.name == "EVENTS"
    finally:
        await nc.close()
