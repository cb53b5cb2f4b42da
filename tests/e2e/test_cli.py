"""The ``turnstream`` command as a user runs it: a real process, a real nats-server."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from schemas.log import NatsServer
from tests.conftest import Log


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


def test_demo_runs_the_main_job_on_the_embedded_default(tmp_path: Path) -> None:
    result = turnstream("demo", "--data-dir", str(tmp_path), "--sessions", "3")

    assert result.returncode == 0, result.stderr
    out = result.stderr + result.stdout
    assert "published 16 events for 3 sessions" in out  # 2 x 5 + 1 x 6 (a forking session)
    assert "folded from the EVENTS stream, read back from the shards" in out
    assert "3 sessions -> 4 trajectories" in out and "4 rows in" in out
    assert list((tmp_path / "shards" / "run=default").glob("part-*.parquet"))
    assert out.count("default/") >= 4  # 3 sessions, one of them forked into 2 samples
    assert (tmp_path / "nats" / "jetstream").is_dir()


def test_usage_lists_the_commands() -> None:
    result = turnstream("--help")
    assert result.returncode == 0
    for command in ("demo", "nats", "provision", "status"):
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
    result = turnstream("demo", "--log.duplicate-window-s", "1")
    assert result.returncode == 2
    assert "retry horizon" in result.stderr


def test_an_unreachable_log_is_one_clear_error() -> None:
    result = turnstream("status", "--log.url", "nats://127.0.0.1:1", "--log.connect-wait-s", "0.5")
    assert result.returncode == 1
    assert "cannot connect to NATS at nats://127.0.0.1:1" in result.stderr


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

    await FoldWorker(log.js, publisher=None).consumer().bind(log.js)  # type: ignore[arg-type]
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


@pytest.mark.parametrize("command", ["worker", "shard-writer"])
def test_consumers_refuse_to_start_without_the_log_url(command: str, tmp_path: Path) -> None:
    result = turnstream(command, "--data-dir", str(tmp_path))
    assert result.returncode == 1
    assert f"{command} needs the log's URL: --log.url" in result.stderr
