"""``turnstream worker`` / ``shard-writer`` as real processes, for pipeline and crash tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from shardstore import open_shards_dataset

# Short ack waits, reaper timeouts and shard ages: pipeline tests take seconds, not minutes.
WORKER_FLAGS = (
    "--fold.ack-wait-s",
    "3",
    "--reaper.idle-timeout-s",
    "3",
    "--reaper.scan-interval-s",
    "0.5",
    "--reaper.ack-wait-s",
    "3",
    "--progress-interval-s",
    "1",
)
WRITER_FLAGS = ("--shards.max-age-s", "0.5", "--shards.ack-wait-s", "3")
# How a command is started: this interpreter's turnstream (another install: its bin/turnstream).
LAUNCHER = (sys.executable, "-m", "turnstream.cli")


class Service:
    """One turnstream command in its own process; ``kill()`` is SIGKILL, ``stop()`` SIGTERM."""

    def __init__(
        self,
        command: str,
        nats_url: str,
        data_dir: Path,
        *extra: str,
        launcher: Sequence[str] = LAUNCHER,
    ) -> None:
        self.command = command
        self.args = [
            *launcher,
            command,
            "--log.url",
            nats_url,
            "--data-dir",
            str(data_dir),
            *extra,
        ]
        data_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = data_dir / f"{command}-{os.getpid()}-{id(self)}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> Service:
        with self.log_path.open("ab") as log_file:
            self.proc = subprocess.Popen(
                self.args,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env={**os.environ, "TURNSTREAM_LOG_LEVEL": "INFO"},
            )
        self.starts += 1
        return self

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.running:
            assert self.proc is not None
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, wait, and the exit status (SIGKILL if it does not stop in time)."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return int(self.proc.returncode)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


def shard_table_rows(root: Path) -> list[dict[str, object]]:
    """Every row of every committed shard under ``root`` (pyarrow.dataset, hive ``run=``)."""
    if not root.exists():
        return []
    return list(open_shards_dataset(str(root)).to_table().to_pylist())
