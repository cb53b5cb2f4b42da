"""The scale-out benchmark's load generator spread over processes (``--load-processes K``).

On many cores one Python process cannot load the direct path (it saturates near 3,000 requests
a second of the short shape): K processes each run c/K closed-loop workers with the same paths
as the parent's (``LoadSpec``), one phase per message, and send their ``Phase`` back; the
parent sums them (``LoadProcesses.phase``) and reads every process's CPU around the phase.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import statistics
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import httpx

from harness.cpu import CpuMeter
from harness.load import Conversation, Direct, Gateway, LoadPath, PhaseCounts
from harness.phases import Phase, Plan, run_phase


class NoCpu:
    """A load process measures no CPU: the parent reads every process's around the phase."""

    def cpu(self) -> dict[str, float]:
        return {}


@dataclass(frozen=True)
class LoadSpec:
    """What a load process needs to build the same paths as the parent."""

    urls: dict[str, str]  # gateway name -> its URL
    backend_url: str
    model: str
    conv: Conversation
    per: int


async def load_paths(spec: LoadSpec, clients: list[httpx.AsyncClient]) -> dict[str, LoadPath]:
    paths: dict[str, LoadPath] = {
        "direct": Direct(clients, spec.per, spec.backend_url, spec.model, spec.conv)
    }
    for name, url in spec.urls.items():
        paths[name] = Gateway(clients, spec.per, url, spec.model, spec.conv, name=name)
    return paths


async def http_clients(
    stack: contextlib.AsyncExitStack[Any], concurrency: int, per: int
) -> list[httpx.AsyncClient]:
    # Idle connections dropped by the client before uvicorn's 5 s keep-alive timeout: a path
    # idles through the other phases, and a connection the server closes just as it is reused
    # is a ReadError (seen at load average 10), whichever path it is.
    limits = httpx.Limits(
        max_connections=per + 2, max_keepalive_connections=per + 2, keepalive_expiry=3.0
    )
    return [
        await stack.enter_async_context(httpx.AsyncClient(limits=limits, timeout=60.0))
        for _ in range(-(-concurrency // per))
    ]


def load_process_main(conn: Connection, spec: LoadSpec, concurrency: int, index: int) -> None:
    """A load process: the same closed-loop workers as the parent's, on its share of the
    concurrency; one phase per message (path name, plan, tag, round), its ``Phase`` sent back."""

    async def main() -> None:
        async with contextlib.AsyncExitStack() as stack:
            clients = await http_clients(stack, concurrency, spec.per)
            paths = await load_paths(spec, clients)
            for path in paths.values():
                path.counts = PhaseCounts()
                await path.worker(0, f"first-p{index}")()
            conn.send("ready")
            while (job := await asyncio.to_thread(conn.recv)) is not None:
                name, plan, tag, rnd = job
                phase = await run_phase(paths[name], concurrency, plan, tag, NoCpu(), rnd)
                conn.send(phase)

    try:
        asyncio.run(main())
    except BaseException as exc:
        conn.send(f"load process {index} failed: {exc!r}")
        raise


class LoadProcesses:
    """The load spread over processes (``--load-processes K``): each runs c/K workers; a phase
    is the sum of theirs (throughput summed over each process's own window)."""

    def __init__(self, spec: LoadSpec, concurrency: int, count: int) -> None:
        context = multiprocessing.get_context("spawn")
        shares = [concurrency // count + (i < concurrency % count) for i in range(count)]
        self.pipes: list[Connection] = []
        self.procs: list[BaseProcess] = []
        for index, share in enumerate(shares):
            here, there = context.Pipe()
            proc = context.Process(
                target=load_process_main, args=(there, spec, share, index), daemon=True
            )
            proc.start()
            self.pipes.append(here)
            self.procs.append(proc)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None]

    async def receive(self) -> list[Any]:
        answers = [await asyncio.to_thread(pipe.recv) for pipe in self.pipes]
        for answer in answers:
            if isinstance(answer, str) and answer != "ready":
                raise RuntimeError(answer)
        return answers

    async def phase(self, name: str, plan: Plan, tag: str, procs: CpuMeter, rnd: int) -> Phase:
        cpu0, wall0 = procs.cpu(), time.time()
        for index, pipe in enumerate(self.pipes):
            pipe.send((name, plan, f"{tag}-p{index}", rnd))
        parts: list[Phase] = await self.receive()
        cpu1 = procs.cpu()
        window = statistics.fmean(p.window_s for p in parts)
        return Phase(
            path=name,
            concurrency=sum(p.concurrency for p in parts),
            round=rnd,
            latencies_s=[x for p in parts for x in p.latencies_s],
            window_s=window,
            completed_in_window=round(window * sum(p.throughput for p in parts)),
            requests=sum(p.requests for p in parts),
            sessions=sum(p.sessions for p in parts),
            cpu_s={k: cpu1[k] - cpu0[k] for k in cpu0},
            tokens=sum(p.tokens for p in parts),
            wall=(wall0, time.time()),
        )

    def close(self) -> None:
        for pipe in self.pipes:
            with contextlib.suppress(OSError):
                pipe.send(None)
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
