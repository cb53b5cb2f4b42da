"""The deploy tests stop the Docker engine they started when the last session using it ends
(tests/deploy/engine_use.py), with a stand-in ``dockerd`` (a process of that name) and the pid
file and users lock in a temporary deploy cache: no Docker engine is needed."""

from __future__ import annotations

import fcntl
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.deploy.engine_use import (
    EngineUse,
    end_use,
    engine_to_stop,
    keep_requested,
    stop_process,
)
from tests.helpers.waiting import wait_for

# Waits in the shell itself (a child's `exec` would rename the process); exits on SIGTERM.
_SLEEPS = "READY\nwhile :; do sleep 0.1; done"


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "deploy-cache"
    monkeypatch.setenv("TURNSTREAM_DEPLOY_CACHE", str(root))
    (root / "docker").mkdir(parents=True)
    return root


def _named_dockerd(tmp_path: Path, script: str) -> subprocess.Popen[bytes]:
    """A shell running ``script`` under the name ``dockerd`` (what /proc/<pid>/stat says),
    returned once it has started it."""
    binary, ready = tmp_path / "bin" / "dockerd", tmp_path / "bin" / "ready"
    binary.parent.mkdir(exist_ok=True)
    ready.unlink(missing_ok=True)
    binary.write_text(f"#!/bin/sh\n{script.replace('READY', f'touch {ready}')}\n")
    binary.chmod(0o755)
    proc = subprocess.Popen([str(binary)])
    wait_for(ready.exists, 30, "the stand-in dockerd to start")
    return proc


@pytest.fixture
def dockerd(tmp_path: Path, cache: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A stand-in dockerd that exits on SIGTERM, named by the cache's pid file, as
    ``ensure_engine`` leaves its dockerd."""
    proc = _named_dockerd(tmp_path, _SLEEPS)
    (cache / "docker" / "dockerd.pid").write_text(f"{proc.pid}\n")
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _held(cache: Path) -> EngineUse:
    """A session's use of the engine, as ``use_engine`` takes it (without looking for one)."""
    users = (cache / "locks").joinpath("engine-users.lock")
    users.parent.mkdir(exist_ok=True)
    lock = users.open("w")
    fcntl.flock(lock, fcntl.LOCK_SH)
    return EngineUse("unix:///run/turnstream-docker.sock", lock)


def test_the_last_session_stops_the_tests_dockerd_and_an_earlier_one_leaves_it(
    cache: Path, dockerd: subprocess.Popen[bytes]
) -> None:
    first, second = _held(cache), _held(cache)

    assert "another test session uses it" in end_use(first, keep=False)
    assert dockerd.poll() is None

    assert "stopped" in end_use(second, keep=False)
    assert dockerd.poll() is not None, "the tests' dockerd still runs after the last session"


def test_keep_leaves_it_running_for_the_next_run(
    cache: Path, dockerd: subprocess.Popen[bytes]
) -> None:
    assert "left running for the next run" in end_use(_held(cache), keep=True)
    assert dockerd.poll() is None
    pid, _ = engine_to_stop(cache / "docker" / "dockerd.pid", keep=False, others_using=False)
    assert pid == dockerd.pid  # the next run, not asking to keep it, stops it


@pytest.mark.parametrize(
    "content",
    ["", "not a pid", "999999999", str(os.getpid())],
    ids=["empty", "garbage", "no-such-process", "a-process-that-is-no-dockerd"],
)
def test_a_pid_file_naming_no_running_dockerd_stops_nothing(tmp_path: Path, content: str) -> None:
    """The pid of a dockerd that exited may be reused by any process: never signalled."""
    pid_file = tmp_path / "dockerd.pid"
    pid_file.write_text(content)
    assert engine_to_stop(pid_file, keep=False, others_using=False)[0] is None
    assert engine_to_stop(tmp_path / "missing.pid", keep=False, others_using=False)[0] is None


def test_a_dockerd_not_started_by_the_tests_is_left_alone(cache: Path, tmp_path: Path) -> None:
    """One that answers on the socket without the cache's pid file (the machine's own)."""
    theirs = _named_dockerd(tmp_path, _SLEEPS)
    try:
        assert "nothing to stop" in end_use(_held(cache), keep=False)
        assert theirs.poll() is None
    finally:
        theirs.kill()
        theirs.wait()


def test_a_dockerd_that_ignores_sigterm_is_killed(tmp_path: Path) -> None:
    stubborn = _named_dockerd(tmp_path, "trap '' TERM\nREADY\nwhile :; do sleep 0.1; done")
    assert stop_process(stubborn.pid, wait_s=0.5) is False
    assert stubborn.poll() is not None


@pytest.mark.parametrize(
    ("value", "keep"),
    [(None, False), ("", False), ("0", False), ("false", False), ("1", True), ("yes", True)],
)
def test_the_keep_setting(value: str | None, keep: bool) -> None:
    environ = {} if value is None else {"TURNSTREAM_KEEP_DOCKER": value}
    assert keep_requested(environ) is keep
