"""``--log.secure`` as a user runs it: TLS, a user per role, real processes and nats-server."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable
from pathlib import Path

import httpx
import openai

from eventlog.server import free_port
from tests.helpers.services import Service, shard_table_rows


def _turnstream(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "turnstream.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "300"},
    )


def _spawn(log_path: Path, *args: str) -> subprocess.Popen[bytes]:
    with log_path.open("wb") as log_file:  # a file: a full pipe would block the process
        return subprocess.Popen(
            [sys.executable, "-m", "turnstream.cli", *args],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, "TURNSTREAM_LOG_LEVEL": "INFO", "COLUMNS": "300"},
        )


def _wait(
    ready: Callable[[], bool], proc: subprocess.Popen[bytes], log_path: Path, what: str
) -> None:
    deadline = time.monotonic() + 120
    while not ready():
        assert proc.poll() is None, f"exited before {what}:\n{log_path.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"no {what}:\n{log_path.read_text()[-4000:]}"
        time.sleep(0.2)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_up_on_a_secure_log_serves_agents_and_their_sessions_reach_the_shards(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    port = free_port()
    log_path = tmp_path / "up.log"
    proc = _spawn(
        log_path,
        *("up", "--port", str(port), "--run", "up", "--data-dir", str(tmp_path)),
        *("--model", str(tiny_model_dir), "--model-name", "tiny", "--shards.max-age-s", "0.5"),
        "--log.secure",
    )
    try:
        url = f"http://127.0.0.1:{port}"
        _wait(lambda: _healthy(url), proc, log_path, "healthy gateway")
        opened = httpx.post(f"{url}/v1/sessions", json={}).json()
        client = openai.OpenAI(base_url=opened["base_url"], api_key="unused")
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        httpx.post(f"{url}/v1/sessions/{opened['session_id']}/close", json={"reward": 1.0})
        shards = tmp_path / "shards"
        _wait(lambda: bool(shard_table_rows(shards)), proc, log_path, "shard")
        [row] = shard_table_rows(shards)
        assert row["trajectory_id"] == f"up/{opened['session_id']}/0" and row["reward"] == 1.0
    finally:
        proc.terminate()
        assert proc.wait(60) == 0, log_path.read_text()[-4000:]

    assert "embedded nats-server at tls://" in log_path.read_text()
    # The server was given the users and TLS, and bcrypt hashes only, never a password.
    server_config = (tmp_path / "nats" / "nats-server.conf").read_text()
    assert "authorization" in server_config and "cert_file" in server_config
    for role in ("admin", "gateway", "worker", "trainer"):
        stored = tomllib.loads((tmp_path / "nats-auth" / f"{role}.toml").read_text())
        assert stored["log"]["password"] not in server_config


def test_services_on_a_secure_nats_each_with_its_role_carry_a_session_to_the_shards(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    nats_port = free_port()
    log_path = tmp_path / "nats.log"
    nats = _spawn(
        log_path, "nats", "--log.secure", "--log.port", str(nats_port), "--data-dir", str(tmp_path)
    )
    services: list[Service] = []
    try:
        _wait(lambda: "nats-server ready at" in log_path.read_text(), nats, log_path, "nats")
        auth = tmp_path / "nats-auth"
        url = f"tls://127.0.0.1:{nats_port}"
        printed = log_path.read_text()
        assert str(auth / "worker.toml") in printed and str(auth / "ca.pem") in printed

        anonymous = _turnstream(
            *("status", "--log.url", url, "--log.tls-ca", str(auth / "ca.pem")),
            *("--log.connect-wait-s", "0.5"),
        )
        assert anonymous.returncode == 1
        assert "requires credentials and none were given" in anonymous.stderr

        # Each service with its role: by role file (--config), or by flags as the README shows.
        gateway_port = free_port()
        gateway = Service(
            "gateway",
            url,
            tmp_path / "gateway",
            *("--config", str(auth / "gateway.toml"), "--port", str(gateway_port)),
            *("--model", str(tiny_model_dir), "--model-name", "tiny", "--run", "secure"),
        )
        worker = Service("worker", url, tmp_path / "worker", "--config", str(auth / "worker.toml"))
        password = tomllib.loads((auth / "worker.toml").read_text())["log"]["password"]
        shards = tmp_path / "shards"
        writer = Service(
            "shard-writer",
            url,
            tmp_path / "writer",
            *("--log.user", "worker", "--log.password", password),
            *("--log.tls-ca", str(auth / "ca.pem"), "--shards.target", str(shards)),
            *("--shards.max-age-s", "0.5"),
        )
        services = [gateway.start(), worker.start(), writer.start()]
        gateway_url = f"http://127.0.0.1:{gateway_port}"
        assert gateway.proc is not None
        _wait(lambda: _healthy(gateway_url), gateway.proc, gateway.log_path, "healthy gateway")
        opened = httpx.post(f"{gateway_url}/v1/sessions", json={}).json()
        client = openai.OpenAI(base_url=opened["base_url"], api_key="unused")
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        httpx.post(f"{gateway_url}/v1/sessions/{opened['session_id']}/close", json={})
        assert writer.proc is not None
        _wait(lambda: bool(shard_table_rows(shards)), writer.proc, writer.log_path, "shard")
        [row] = shard_table_rows(shards)
        assert row["trajectory_id"] == f"secure/{opened['session_id']}/0"

        # The admin reads every stream's state (its role file is a --config file too).
        status = _turnstream("status", "--log.url", url, "--config", str(auth / "admin.toml"))
        assert status.returncode == 0, status.stderr[-4000:]
        assert "EVENTS" in status.stdout + status.stderr
        for service in services:
            assert service.stop() == 0, service.output()
    finally:
        for service in services:
            service.kill()
        nats.terminate()
        assert nats.wait(60) == 0, log_path.read_text()[-4000:]
    # Each service's work needed nothing its role is denied.
    assert "Violation" not in (tmp_path / "nats" / "nats-server.log").read_text()
