"""The ``turnstream`` command as a user runs it: a real process, a real nats-server."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from eventlog.server import NatsServer, free_port
from shardstore import open_shards_dataset
from tests.conftest import Log
from tests.helpers.gateway_process import GatewayProcess


def turnstream(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "turnstream.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "COLUMNS": "200", **(env or {})},
    )


def test_up_serves_agents_and_writes_their_trajectories_to_shards(tmp_path: Path) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "turnstream.cli",
            "up",
            "--port",
            str(port),
            "--run",
            "up",
            "--data-dir",
            str(tmp_path),
            "--shards.max-age-s",
            "0.5",
        ],
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "up.log").open("w"),  # a file: a full pipe would block the process
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (tmp_path / "up.log").read_text()
            assert time.monotonic() < deadline, "turnstream up did not become healthy"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        opened = httpx.post(f"{url}/v1/sessions", json={}).json()
        client = openai.OpenAI(base_url=opened["base_url"], api_key="unused")
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        httpx.post(f"{url}/v1/sessions/{opened['session_id']}/close", json={"reward": 1.0})
        shards = tmp_path / "shards" / "run=up"
        while not list(shards.glob("part-*.parquet")):
            assert time.monotonic() < deadline, "no shard within the deadline"
            time.sleep(0.2)
        [row] = open_shards_dataset(str(tmp_path / "shards")).to_table().to_pylist()
        assert row["trajectory_id"] == f"up/{opened['session_id']}/0" and row["reward"] == 1.0
    finally:
        proc.terminate()
        assert proc.wait(60) == 0, (tmp_path / "up.log").read_text()


def test_usage_lists_the_commands() -> None:
    result = turnstream("--help")
    assert result.returncode == 0
    for command in ("demo", "nats", "provision", "status", "up", "worker", "shard-writer"):
        assert f"  {command} " in result.stdout


def test_an_unknown_command_is_refused() -> None:
    result = turnstream("frobnicate")
    assert result.returncode == 2
    assert "unknown command 'frobnicate'" in result.stderr


def test_provision_without_a_url_says_what_to_pass() -> None:
    result = turnstream("provision")
    assert result.returncode == 1
    assert "needs --log.url" in result.stderr


def test_settings_that_break_dedup_are_refused_with_the_reason() -> None:
    # `up`: the same log settings as `demo`, refused in ~1.7 s of CPU where `demo` first
    # imports its trainer (torch: ~7.5 s).
    result = turnstream("up", "--log.duplicate-window-s", "1")
    assert result.returncode == 2
    assert "retry horizon" in result.stderr


def test_an_unreachable_log_is_one_clear_error() -> None:
    result = turnstream("status", "--log.url", "nats://127.0.0.1:1", "--log.connect-wait-s", "0.5")
    assert result.returncode == 1
    assert "cannot connect to NATS at nats://127.0.0.1:1" in result.stderr


@pytest.mark.parametrize(
    "command",
    [["up"], ["gateway"], ["gateway", "--workers", "2"], ["up", "--workers", "2"]],
    ids=["up", "gateway", "gateway-workers", "up-workers"],
)
def test_a_port_in_use_is_one_clear_error(command: list[str], tmp_path: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        result = turnstream(*command, "--port", str(port), "--data-dir", str(tmp_path))
    assert result.returncode == 1, result.stderr
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in result.stderr
    assert "pass another --port (0: a free one)" in result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert "nats-server" not in result.stderr, "bound after the log started"
    assert not (tmp_path / "stack.json").exists()


@pytest.mark.integration
def test_the_gateway_serves_on_an_ipv6_address_and_says_its_url(
    nats_server: NatsServer, tiny_model_dir: Path, tmp_path: Path
) -> None:
    gateway = GatewayProcess(nats_server.url, tiny_model_dir, tmp_path, host="::1")
    try:
        assert gateway.url == f"http://[::1]:{gateway.port}"
        assert httpx.get(f"{gateway.url}/health", timeout=10).status_code == 200
        log = " ".join(gateway.log_path.read_text().split())  # rich wraps long lines
        assert f"gateway on {gateway.url} (backend" in log, log
    finally:
        gateway.stop()


@pytest.mark.integration
def test_status_reads_the_url_from_env_and_from_a_toml_file(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    from_env = turnstream("status", env={"TURNSTREAM_LOG__URL": nats_server.url})
    assert from_env.returncode == 0, from_env.stderr
    assert "EVENTS" in from_env.stderr and "ts.ev.>" in from_env.stderr

    config = tmp_path / "turnstream.toml"
    config.write_text(f'[log]\nurl = "{nats_server.url}"\nevents_max_age_s = 3600.0\n')
    from_toml = turnstream("provision", "--config", str(config))
    assert from_toml.returncode == 0, from_toml.stderr
    assert "EVENTS" in from_toml.stderr and "updated" in from_toml.stderr

    missing = turnstream("status", "--config", str(tmp_path / "nope.toml"))
    assert missing.returncode == 1
    assert "nope.toml does not exist" in missing.stderr


@pytest.mark.integration
async def test_status_shows_consumer_lag_and_dead_letters_by_reason(log: Log) -> None:
    from consumers import FoldWorker
    from schemas.dead_letter import DeadLetter, encode_dead_letter

    await FoldWorker(log.js, publisher=None).loop.spec.bind(log.js)  # type: ignore[arg-type]
    await log.js.publish(f"ts.ev.r.s{1}.close", b"x")
    letter = DeadLetter(
        source="fold", reason="undecodable", error="e", stream="EVENTS", subject="s", seq=1
    )
    for seq in (1, 2):
        await log.js.publish(
            letter.subject_out, encode_dead_letter(letter), headers={"Nats-Msg-Id": str(seq)}
        )

    result = turnstream("status", "--log.url", log.server.url)

    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    [fold] = [line for line in lines if "│ fold " in line and "EVENTS" in line]
    assert fold.split("│")[3].strip() == "1"  # one close waiting
    [dlq] = [line for line in lines if "fold.undecodable" in line]
    assert dlq.split("│")[2].strip() == "2"
    assert "no shards under" in result.stderr


def test_status_summarizes_the_shards_per_run(nats_server: NatsServer, tmp_path: Path) -> None:
    from consumers import fold
    from schemas.shards import ShardMetadata, rows_to_table, shard_row
    from shardstore import FileShardStore
    from tests.helpers.sessions import append_only, session_events

    store = FileShardStore(str(tmp_path))
    seq = 0
    for run, n in (("a", 3), ("b", 1)):
        rows = []
        for i in range(n):
            for t in fold(session_events(append_only(2), run=run, session=f"s{i}")).trajectories:
                seq += 1
                rows.append(shard_row(seq, t))
        meta = ShardMetadata.of_rows(rows, run=run, stream="TRAJ", stream_created="")
        store.write(rows_to_table(rows, meta), meta)

    result = turnstream("status", "--log.url", nats_server.url, "--shards", str(tmp_path))

    assert result.returncode == 0, result.stderr
    rows = {line.split("│")[1].strip(): line for line in result.stderr.splitlines() if "│" in line}
    assert rows["a"].split("│")[3].strip() == "3" and rows["b"].split("│")[3].strip() == "1"


@pytest.mark.parametrize("command", ["worker", "shard-writer"])
def test_consumers_refuse_to_start_without_the_log_url(command: str, tmp_path: Path) -> None:
    result = turnstream(command, "--data-dir", str(tmp_path))
    assert result.returncode == 1
    assert f"{command} needs the log's URL: --log.url" in result.stderr


def test_nats_listens_on_the_port_it_prints_for_services_to_join(tmp_path: Path) -> None:
    port = free_port()  # stands for NATS's 4222, the default when no port is given
    log_path = tmp_path / "nats.log"
    with log_path.open("w") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "turnstream.cli", "nats", "--data-dir", str(tmp_path)],
            stdout=subprocess.DEVNULL, stderr=log_file,
            env={**os.environ, "COLUMNS": "200", "TURNSTREAM_LOG__PORT": str(port)},
        )  # fmt: skip
    try:
        url = f"nats://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while f"--log.url {url}" not in log_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.1)
        joined = turnstream("status", "--log.url", url)
        assert joined.returncode == 0 and "EVENTS" in joined.stderr, joined.stderr
    finally:
        proc.terminate()
        assert proc.wait(30) == 0, log_path.read_text()
