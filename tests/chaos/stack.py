"""The whole system as real processes, a supervisor that keeps them up, and the fault injector.

nats-server (``eventlog.server.NatsServer``: fixed port and store, so a restart keeps the address
and the data), one gateway or two behind a round-robin proxy (``tests.chaos.proxy``: no
affinity), two fold workers (reapers on), the shard writer and the live sink consumer, each a
``tests.helpers.services.Service`` logging into the data dir. The supervisor
restarts whatever should be up and is not (a process that exited on its own is recorded and
restarted with a backoff, like systemd's ``Restart=always``); the controller SIGKILLs one
target at a time at random moments and brings it back after a random downtime, or freezes it,
fills nats-server's disk, or slows nats-server down (``tests.chaos.faults``). For those two,
nats-server's store is a tmpfs of its own, and the other processes reach nats-server through
a proxy that can delay its bytes (``nats-proxy``; the soak's trainer and auditor do not).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import signal
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from eventlog.server import NatsServer, free_port
from tests.chaos.controller import FaultController
from tests.chaos.faults import ACTIONS, DISK_FULL, SLOW
from tests.chaos.gateway_counters import read_counters
from tests.chaos.targets import (
    NATS_DELAY,
    PIDS_FILE,
    SINK_JOURNAL,
    Exit,
    Fault,
    RoundRobinProxy,
    SinkConsumer,
    Target,
)
from tests.helpers.services import WORKER_FLAGS, WRITER_FLAGS, Service
from tests.helpers.small_disk import SmallDisk

log = logging.getLogger("soak")

# The tmpfs under nats-server's store: its pages are memory only as the store fills them (a
# 10-minute soak's store: a few hundred MiB); nats-server limits itself to 75% of it.
NATS_DISK_BYTES = 4 * 2**30

__all__ = ["SINK_JOURNAL", "Exit", "Fault", "Stack", "Target", "kill_leftovers", "with_flag"]


def with_flag(flags: Sequence[str], name: str, value: str) -> tuple[str, ...]:
    """``flags`` with ``name``'s value replaced (or appended)."""
    out = list(flags)
    if name in out:
        out[out.index(name) + 1] = value
    else:
        out += [name, value]
    return tuple(out)


@dataclass
class Stack:
    data_dir: Path
    model_dir: Path
    run: str
    seed: int
    idle_timeout_s: float
    workers: int = 2
    gateways: int = 1  # 2: behind a round-robin proxy, each its own fault kind
    outbox: bool = False
    actions: tuple[str, ...] = ACTIONS  # the kinds of fault (tests.chaos.faults)
    started: float = field(default_factory=time.monotonic)
    targets: list[Target] = field(default_factory=list)
    exits: list[Exit] = field(default_factory=list)
    # Summed over the soak (tests.chaos.gateway_counters): read before each kill, and at the end.
    gateway_counters: Counter[str] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self.nats = NatsServer(self.data_dir / "nats", port=free_port())
        self.disk = SmallDisk(self.data_dir / "nats", NATS_DISK_BYTES)
        self.delay_file = self.data_dir / NATS_DELAY
        self.gateway_ports = [free_port() for _ in range(self.gateways)]
        self.proxy_port = free_port() if self.gateways > 1 else None
        self.nats_proxy_port = nats_proxy_port = free_port() if SLOW in self.actions else None
        # What the services dial: nats-server, or the proxy that can slow it down.
        url = self.nats.url if nats_proxy_port is None else f"nats://127.0.0.1:{nats_proxy_port}"
        worker_flags = with_flag(
            WORKER_FLAGS, "--reaper.idle-timeout-s", f"{self.idle_timeout_s:g}"
        )
        # A close whose session cannot be read during an outage is retried within seconds,
        # not after the production backoff of up to a minute.
        worker_flags = with_flag(worker_flags, "--fold.backoff-s", "[0.5,1,2]")
        worker_flags = with_flag(worker_flags, "--fold.max-deliver", "-1")
        # With two, each gateway is a fault kind of its own: each is killed as often as the one
        # gateway of a single-gateway soak.
        names = (
            ["gateway"] if self.gateways == 1 else [f"gateway-{i}" for i in range(self.gateways)]
        )
        self.targets = [
            Target("nats", "nats", server=self.nats),
            *(
                [
                    Target(
                        "nats-proxy",
                        "nats-proxy",
                        RoundRobinProxy(
                            nats_proxy_port,
                            [self.nats.port],
                            self.data_dir,
                            name="nats-proxy",
                            stats="nats-proxy-stats.json",
                            delay_file=self.delay_file,
                        ),
                        faulted=False,
                    )
                ]
                if nats_proxy_port is not None
                else []
            ),
            *(
                Target(
                    name,
                    name,
                    Service("gateway", url, self.data_dir, *self._gateway_flags(i)),
                    url=f"http://127.0.0.1:{self.gateway_ports[i]}",
                )
                for i, name in enumerate(names)
            ),
            *(
                Target(
                    f"worker-{i}", "worker", Service("worker", url, self.data_dir, *worker_flags)
                )
                for i in range(self.workers)
            ),
            Target(
                "shard-writer",
                "shard-writer",
                Service("shard-writer", url, self.data_dir, *WRITER_FLAGS),
            ),
            Target("sink", "sink", SinkConsumer(url, self.data_dir, self.run, self.seed)),
        ]
        if self.proxy_port is not None:
            proxy = RoundRobinProxy(self.proxy_port, self.gateway_ports, self.data_dir)
            self.targets.append(Target("proxy", "proxy", proxy, faulted=False))

    def _gateway_flags(self, index: int) -> list[str]:
        flags = [
            "--port",
            str(self.gateway_ports[index]),
            "--model",
            str(self.model_dir),
            "--model-name",
            "tiny",
            "--run",
            self.run,
        ]
        if self.outbox:
            # A retry horizon (~1 s) shorter than a nats-server outage, or nothing is spooled.
            outbox = "outbox" if self.gateways == 1 else f"outbox-{index}"
            flags += [
                "--publisher.outbox-path",
                str(self.data_dir / outbox),
                "--publisher.ack-timeout-s",
                "0.5",
                "--publisher.max-attempts",
                "2",
            ]
        return flags

    @property
    def gateway_url(self) -> str:
        """Where the agents send their requests: the proxy, or the one gateway."""
        return f"http://127.0.0.1:{self.proxy_port or self.gateway_ports[0]}"

    @property
    def gateway_urls(self) -> list[str]:
        """Each gateway itself, and, with two, the proxy in front of them."""
        urls = [f"http://127.0.0.1:{port}" for port in self.gateway_ports]
        return urls if self.proxy_port is None else [*urls, self.gateway_url]

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def target(self, name: str) -> Target:
        return next(t for t in self.targets if t.name == name)

    # -- starting and keeping up ------------------------------------------------------------

    async def start_target(self, target: Target) -> None:
        target.starting = True
        try:
            if target.server is not None:
                # Blocks until JetStream is healthy again (it recovers the streams first).
                await asyncio.to_thread(target.server.start, 60.0)
            else:
                assert target.service is not None
                target.service.start()
        finally:
            target.starting = False
        target.killed_by_us = False
        target.started_at = time.monotonic()
        target.up.set()
        self._record_pid(target)

    def _record_pid(self, target: Target) -> None:
        with (self.data_dir / PIDS_FILE).open("a") as pids:
            pids.write(f"{target.pid} {target.name}\n")

    async def start(self) -> None:
        """nats first (on a tmpfs of its own, for the disk-full fault), then its proxy; the
        sink once the gateways are healthy: every service provisions the streams as it starts,
        and the sink's consumer needs TRAJ to exist."""
        if DISK_FULL in self.actions and not self.disk.mount():
            log.warning("no disk-full faults: no tmpfs for the store (%s)", self.disk.why_not)
            self.actions = tuple(a for a in self.actions if a != DISK_FULL)
        for target in self.targets:
            if target.kind != "sink":
                await self.start_target(target)
            if target.kind == "nats-proxy":
                await _listening(self.nats_proxy_port, 30.0)
        await self.wait_gateway_healthy(180.0)
        for target in self.targets:
            if target.kind == "sink":
                await self.start_target(target)

    async def wait_gateway_healthy(self, within: float) -> None:
        """Every gateway, and the proxy in front of them, answers ``/health``."""
        deadline = time.monotonic() + within
        async with httpx.AsyncClient(timeout=2.0) as client:
            for url in self.gateway_urls:
                while True:
                    with contextlib.suppress(httpx.HTTPError):
                        if (await client.get(f"{url}/health")).status_code == 200:
                            break
                    if time.monotonic() > deadline:
                        tails = "\n".join(
                            f"--- {t.name}\n{t.log_tail()}"
                            for t in self.targets
                            if t.kind.startswith("gateway") or t.kind == "proxy"
                        )
                        raise RuntimeError(f"{url} not healthy within {within:g}s:\n{tails}")
                    await asyncio.sleep(0.5)

    async def supervise(self, stop: asyncio.Event) -> None:
        """Restart what should run and does not; record processes that ended on their own."""
        starts: set[asyncio.Task[None]] = set()
        while not stop.is_set():
            now = time.monotonic()
            for target in self.targets:
                if not target.wanted or target.running or target.starting:
                    continue
                if not target.killed_by_us and target.started_at:
                    self._record_exit(target, now)
                    target.started_at = 0.0
                if now < target.restart_not_before:
                    continue
                # In a task: nats-server takes seconds to recover its streams, and the others
                # must not wait for it.
                target.starting = True
                task = asyncio.create_task(self._restart(target))
                starts.add(task)
                task.add_done_callback(starts.discard)
            await asyncio.sleep(0.25)
        await asyncio.gather(*starts)

    async def _restart(self, target: Target) -> None:
        try:
            await self.start_target(target)
        except Exception as exc:  # nats-server that did not come up: record, retry later
            self.exits.append(Exit(self.elapsed(), target.name, -1, None, repr(exc)[-1500:]))
            target.exits_in_a_row += 1
            target.restart_not_before = time.monotonic() + min(2.0**target.exits_in_a_row, 8.0)

    def _record_exit(self, target: Target, now: float) -> None:
        # A process that ran a while before it ended starts a new series of backoffs.
        if now - target.started_at > 10.0:
            target.exits_in_a_row = 0
        target.exits_in_a_row += 1
        target.restart_not_before = now + min(2.0 ** (target.exits_in_a_row - 1), 8.0)
        pid = target.pid or -1
        self.exits.append(
            Exit(self.elapsed(), target.name, pid, target.exit_code(), target.log_tail())
        )
        log.warning("%s (pid %s) exited on its own with %s", target.name, pid, target.exit_code())

    # -- faults -------------------------------------------------------------------------------

    async def inject_faults(
        self, stop: asyncio.Event, rng: random.Random, mean_interval_s: float, max_down_s: float
    ) -> list[Fault]:
        """Faults at random moments until ``stop`` (``tests.chaos.controller``)."""
        return await FaultController(self).inject_faults(stop, rng, mean_interval_s, max_down_s)

    async def read_gateway_counters(self, targets: Sequence[Target] | None = None) -> None:
        """Add ``targets``' (default: every gateway's) counters to ``gateway_counters``."""
        async with httpx.AsyncClient() as client:
            for target in targets or [t for t in self.targets if t.url]:
                self.gateway_counters.update(await read_counters(client, target.url))

    # -- stopping ---------------------------------------------------------------------------

    def stop(self) -> dict[str, int | None]:
        """SIGTERM every service (they drain and exit), then nats; their exit codes."""
        codes: dict[str, int | None] = {}
        for target in reversed(self.targets):
            target.wanted = False
            if target.service is not None:
                codes[target.name] = target.service.stop(timeout=20.0) if target.running else None
            elif target.server is not None:
                target.server.stop()
        return codes

    def keep_store(self) -> None:
        """The store off its tmpfs, into the data dir itself (nats-server stopped): the data
        dir is kept for ``--reaudit``, and a tmpfs would take it with the unmount."""
        self.disk.keep()

    def kill_all(self) -> None:
        for target in self.targets:
            target.wanted = False
            with contextlib.suppress(OSError):
                target.kill()


async def _listening(port: int | None, within_s: float) -> None:
    """Until something accepts connections on ``port``."""
    deadline = time.monotonic() + within_s
    while port is not None:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)
        else:
            writer.close()
            return


def kill_leftovers(data_dir: Path) -> list[int]:
    """SIGKILL every process the soak in ``data_dir`` started that still runs (after the soak
    itself was killed). A PID counts only if its command line names ``data_dir``: never another
    program that reused the number."""
    path = data_dir / PIDS_FILE
    killed: list[int] = []
    if not path.exists():
        return killed
    try:
        return _kill_listed(path, data_dir)
    finally:  # the store's tmpfs, once nothing holds it (the soak itself was killed)
        SmallDisk(data_dir / "nats", 0).keep()


def _kill_listed(path: Path, data_dir: Path) -> list[int]:
    killed: list[int] = []
    for line in path.read_text().splitlines():
        pid_text = line.split(" ", 1)[0]
        if not pid_text.isdigit():
            continue
        pid = int(pid_text)
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if str(data_dir) in cmdline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
    return killed
