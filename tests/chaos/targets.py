"""The processes of the chaos soak as the controller sees them, and the two that are not
``turnstream`` commands: the live sink consumer and the round-robin proxy.

A ``Target`` is one process the supervisor keeps up (``wanted``) and the controller may kill,
freeze, and for nats-server fill the disk of or slow down (``faulted``); a ``Fault`` is one of
those and its end (a restart, SIGCONT, room made, the delay off: ``tests.chaos.faults``), an
``Exit`` a process that ended without being killed. ``tests.chaos.stack`` starts, supervises
and kills them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from eventlog.server import NatsServer
from tests.helpers.services import Service

PIDS_FILE = "pids"  # every process the soak started, for cleanup after a hard failure
SINK_JOURNAL = "sink-journal.log"
PROXY_STATS = "proxy-stats.json"
NATS_DELAY = "nats-delay-s"  # the nats proxy's added delay, in seconds (tests.chaos.proxy)


@dataclass
class Fault:
    at_s: float  # since the soak started
    target: str
    pid: int
    downtime_s: float  # planned: from the kill until the restart is started (or how long
    # the process is frozen, the disk full, nats-server slow)
    back_after_s: float | None = None  # measured: until the new process runs (nats: healthy)
    wall: float = 0.0  # Unix time of the kill, to line it up with the sink's journal
    action: str = "kill"  # kill, freeze, disk-full, slow (tests.chaos.faults)
    detail: str = ""  # what else it did: the delay, a restart after the disk was full


@dataclass
class Exit:
    """A process that ended without being killed by the controller."""

    at_s: float
    target: str
    pid: int
    code: int | None
    log_tail: str


@dataclass
class Target:
    """One process the controller may kill; ``wanted`` says whether it should be running."""

    name: str
    kind: str  # nats, gateway (gateway-0, gateway-1 with two), worker, shard-writer, sink, proxy
    service: Service | None = None
    server: NatsServer | None = None
    faulted: bool = True  # the controller may kill it (the proxy: only supervised)
    url: str = ""  # a gateway's own address (its /metrics)
    wanted: bool = True
    killed_by_us: bool = False
    exits_in_a_row: int = 0
    started_at: float = 0.0
    restart_not_before: float = 0.0
    starting: bool = False
    busy: bool = False  # under a fault that leaves it running (frozen, its disk full, slow)
    up: asyncio.Event = field(default_factory=asyncio.Event)  # set by each (re)start

    @property
    def pid(self) -> int | None:
        if self.server is not None:
            return self.server.pid
        proc = self.service.proc if self.service is not None else None
        return proc.pid if proc is not None else None

    @property
    def running(self) -> bool:
        if self.server is not None:
            return self.server.running
        return self.service is not None and self.service.running

    def kill(self) -> None:
        self._end(graceful=False)

    def stop(self) -> None:
        """SIGTERM, as the kill: the supervisor starts it again once it is ``wanted``."""
        self._end(graceful=True)

    def _end(self, *, graceful: bool) -> None:
        self.killed_by_us = True
        self.up.clear()
        if self.server is not None:
            if graceful:
                self.server.stop()
            else:
                self.server.kill()
        elif self.service is not None:
            if graceful:
                self.service.stop(timeout=20.0)
            else:
                self.service.kill()

    def freeze(self) -> None:
        """SIGSTOP: it keeps its sockets and its memory, and answers nothing."""
        if self.server is not None:
            self.server.pause()
        elif self.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        if self.server is not None:
            self.server.resume()
        elif self.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGCONT)

    def exit_code(self) -> int | None:
        proc = self.service.proc if self.service is not None else None
        return proc.returncode if proc is not None else None

    def log_tail(self) -> str:
        if self.service is not None:
            return self.service.output()[-1500:]
        if self.server is not None:
            path = self.server.store_dir / "nats-server.log"
            return path.read_text(errors="replace")[-1500:] if path.exists() else ""
        return ""


class SinkConsumer(Service):
    """``tests.chaos.sink_consumer`` in its own process, with the Service kill/stop/log API."""

    def __init__(self, nats_url: str, data_dir: Path, run: str, seed: int) -> None:
        super().__init__("sink", nats_url, data_dir)
        self.args = [
            sys.executable,
            "-m",
            "tests.chaos.sink_consumer",
            "--url",
            nats_url,
            "--journal",
            str(data_dir / SINK_JOURNAL),
            "--run",
            run,
            "--seed",
            str(seed),
        ]


class RoundRobinProxy(Service):
    """``tests.chaos.proxy`` in its own process, with the Service kill/stop/log API; with
    ``delay_file``, the delay it adds to every byte is read from that file (``NATS_DELAY``)."""

    def __init__(
        self,
        port: int,
        backends: Sequence[int],
        data_dir: Path,
        *,
        name: str = "proxy",
        stats: str = PROXY_STATS,
        delay_file: Path | None = None,
    ) -> None:
        super().__init__(name, "", data_dir)
        self.args = [
            sys.executable,
            "-m",
            "tests.chaos.proxy",
            "--port",
            str(port),
            *(f"--backend=127.0.0.1:{backend}" for backend in backends),
            "--stats",  # names the data dir in the command line, for kill_leftovers
            str(data_dir / stats),
            *(["--delay-file", str(delay_file)] if delay_file is not None else []),
        ]
