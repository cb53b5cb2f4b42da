"""The Docker engine's users, and stopping it when the last test session that used it ends.

An idle ``dockerd`` and its ``containerd`` take ~16% of a core (issue 38): on a 2-core machine
every benchmark run after ``make test-deploy`` measured it too. So each test session holds the
engine while it runs (a shared ``flock`` on ``<cache>/locks/engine-users.lock``, taken before
the engine is looked for), and at its end, if no other session holds it, stops the engine that
the tests started: the ``dockerd`` whose pid is in ``<cache>/docker/dockerd.pid`` (only
``ensure_engine`` starts one with that pid file; dockerd removes it when it exits). A dockerd
the tests did not start (the machine's own, answering on another socket, or one on ours without
that pid file) is never stopped, and ``TURNSTREAM_KEEP_DOCKER=1`` keeps ours running for the
next run (which reuses it, and stops it at its end unless it asks to keep it too).

The session that stops the engine holds the lock exclusively meanwhile: a session starting
then waits, and starts an engine of its own once this one is gone.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from tests.deploy.cache import cache_dir
from tests.deploy.engine import ensure_engine

__all__ = [
    "KEEP_ENV",
    "EngineUse",
    "end_use",
    "engine_to_stop",
    "keep_requested",
    "stop_process",
    "use_engine",
]

KEEP_ENV = "TURNSTREAM_KEEP_DOCKER"
_STOP_WAIT_S = 90.0  # dockerd stops its containers (10 s each at most) and containerd first


@dataclass
class EngineUse:
    """A test session's use of the engine, from ``use_engine`` to ``end_use``."""

    host: str  # its DOCKER_HOST
    users: IO[str]  # the users lock, held shared while the session uses the engine


def keep_requested(environ: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    """Whether ``TURNSTREAM_KEEP_DOCKER`` asks to keep the engine (set, and not 0 or false)."""
    return environ.get(KEEP_ENV, "").strip().lower() not in ("", "0", "false", "no")


def _users_lock() -> Path:
    return cache_dir("locks") / "engine-users.lock"


def _pid_file() -> Path:
    return cache_dir("docker") / "dockerd.pid"


def use_engine() -> EngineUse:
    """The engine (started if none answers: ``ensure_engine``), held for this session."""
    users = _users_lock().open("w")
    fcntl.flock(users, fcntl.LOCK_SH)  # waits while a session that ended stops the engine
    try:
        return EngineUse(ensure_engine(), users)
    except BaseException:
        users.close()
        raise


def _process_name(pid: int) -> str | None:
    """The command name of a live process (None: no such process, or a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    name, _, rest = stat.partition("(")[2].rpartition(")")
    return None if rest.split()[0] == "Z" else name


def engine_to_stop(pid_file: Path, *, keep: bool, others_using: bool) -> tuple[int | None, str]:
    """The pid of the dockerd to stop at the end of a test session (None: none), and why.

    Only the one the tests started, which ``pid_file`` names while it runs; not when ``keep``
    asks to keep it, nor while another test session uses it (that one stops it at its end).
    A pid file naming a process that is no dockerd is stale (the pid was reused)."""
    try:
        pid = int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return None, "no dockerd of the tests runs: nothing to stop"
    if _process_name(pid) != "dockerd":
        return None, f"{pid_file} names no running dockerd (pid {pid}): nothing to stop"
    if keep:
        return None, f"dockerd {pid} left running for the next run ({KEEP_ENV}=1)"
    if others_using:
        return None, f"dockerd {pid} left running: another test session uses it"
    return pid, f"dockerd {pid} stopped (the tests started it; {KEEP_ENV}=1 keeps it)"


def _gone(pid: int) -> bool:
    with contextlib.suppress(ChildProcessError):  # ours (this session started it): reap it
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return True
    return _process_name(pid) is None


def stop_process(pid: int, wait_s: float = _STOP_WAIT_S) -> bool:
    """SIGTERM ``pid`` and wait for it to exit (dockerd stops its containers and its containerd
    first); SIGKILL after ``wait_s``. False where it had to be killed."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + wait_s
    while not _gone(pid):
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            while not _gone(pid):
                time.sleep(0.1)
            return False
        time.sleep(0.2)
    return True


def end_use(use: EngineUse, *, keep: bool) -> str:
    """This session's use ended: stop the engine the tests started if no other session uses it
    and ``keep`` is false. What was done, as a line for the log."""
    use.users.close()  # drops this session's shared lock
    with _users_lock().open("w") as users:
        try:
            fcntl.flock(users, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            others_using = True
        else:
            others_using = False
        pid, why = engine_to_stop(_pid_file(), keep=keep, others_using=others_using)
        if pid is not None and not stop_process(pid):
            why += f", killed: it did not exit within {_STOP_WAIT_S:.0f}s of SIGTERM"
        return why
