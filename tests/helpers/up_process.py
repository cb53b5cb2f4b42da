"""``turnstream up`` as a real process on a free port, and the nats-server it embeds."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from eventlog.server import free_port, pid_alive, read_holder

# Short ack waits: a close or trajectory a killed `up` had taken comes back within seconds.
FAST_FLAGS = (
    "--shards.max-age-s",
    "0.5",
    "--shards.ack-wait-s",
    "3",
    "--fold.ack-wait-s",
    "3",
)


class UpProcess:
    """``turnstream up --data-dir DATA_DIR`` with the tiny model; stderr to a file."""

    def __init__(self, data_dir: Path, model_dir: Path, *extra: str) -> None:
        self.data_dir = data_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        data_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = data_dir / f"up-{self.port}.log"  # a file: a full pipe would block it
        args = [
            sys.executable,
            "-m",
            "turnstream.cli",
            "up",
            "--port",
            str(self.port),
            "--data-dir",
            str(data_dir),
            "--run",
            "up",
            "--model",
            str(model_dir),
            "--model-name",
            "tiny",
            *FAST_FLAGS,
            *extra,
        ]
        with self.log_path.open("wb") as log_file:
            self.proc = subprocess.Popen(
                args,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env={**os.environ, "TURNSTREAM_LOG_LEVEL": "INFO", "COLUMNS": "400"},
            )
        self.server_pids: set[int] = set()  # every nats-server seen holding the store

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self, timeout: float = 120) -> UpProcess:
        """Until the gateway answers /health with the log connected (``up`` writes stack.json
        before its gateway answers: a test may join through the file from then on)."""
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, f"up exited:\n{self.output()[-4000:]}"
            assert time.monotonic() < deadline, f"up not healthy:\n{self.output()[-4000:]}"
            try:
                health = httpx.get(f"{self.url}/health", timeout=1)
                if health.status_code == 200 and health.json()["log"] == "connected":
                    self.server_pid()
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)

    def server_pid(self) -> int:
        """The embedded nats-server's PID, from the store's lock file."""
        holder = read_holder(self.data_dir / "nats")
        assert holder.get("pid") == self.pid, f"the store lock names {holder}, not up {self.pid}"
        pid = holder["server_pid"]
        assert isinstance(pid, int)
        self.server_pids.add(pid)
        return pid

    def kill(self) -> None:
        """SIGKILL: no handler runs, nothing is flushed or stopped by this process."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM and the exit status (SIGKILL if it does not stop in time)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return int(self.proc.returncode)

    def cleanup(self) -> None:
        """Whatever the test left running: this process and every server it was seen with."""
        self.kill()
        for pid in self.server_pids:
            if pid_alive(pid) and _command(pid) == "nats-server":  # not a reused PID
                os.kill(pid, signal.SIGKILL)


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""
