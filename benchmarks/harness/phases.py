"""Phases and rounds: a phase is ``warmup_s`` of untimed load then ``measure_s`` of measured load
on one path; a round runs one phase per path, the order alternating from round to round so
that the machine's drift falls on every path alike."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from harness.cpu import CpuMeter
from harness.load import LoadPath, PhaseCounts


@dataclass(frozen=True)
class Plan:
    """How much work each measurement does (``--quick`` shrinks it)."""

    warmup_s: float
    measure_s: float
    rounds: int  # even: each path goes first in half of them


FULL = Plan(warmup_s=1.0, measure_s=6.0, rounds=4)
QUICK = Plan(warmup_s=0.5, measure_s=1.5, rounds=2)


@dataclass
class Phase:
    path: str
    concurrency: int
    round: int
    latencies_s: list[float]
    window_s: float
    completed_in_window: int
    requests: int  # all answered in the phase (warm-up and drain included)
    sessions: int
    cpu_s: dict[str, float]
    gateway_metrics: dict[str, float] = field(default_factory=dict)
    backend_connections: int = 0  # TCP connections the backend accepted during the phase
    tokens: int = 0  # completion tokens answered in the phase
    wall: tuple[float, float] = (0.0, 0.0)  # time.time() at the phase's start and end

    @property
    def throughput(self) -> float:
        return self.completed_in_window / self.window_s


async def run_phase(
    path: LoadPath,
    concurrency: int,
    plan: Plan,
    tag: str,
    procs: CpuMeter,
    rnd: int,
    on_window_edge: Callable[[], None] | None = None,
) -> Phase:
    path.counts = PhaseCounts()
    samples: list[tuple[float, float]] = []
    stop = False

    async def worker(wid: int) -> None:
        step = path.worker(wid, tag)
        while not stop:
            t0 = time.perf_counter()
            await step()
            samples.append((t0, time.perf_counter()))

    cpu0 = procs.cpu()
    wall0 = time.time()
    tasks = [asyncio.create_task(worker(w)) for w in range(concurrency)]
    try:
        await asyncio.sleep(plan.warmup_s)
        t_start = time.perf_counter()
        if on_window_edge is not None:
            on_window_edge()
        await asyncio.sleep(plan.measure_s)
        t_end = time.perf_counter()
        if on_window_edge is not None:
            on_window_edge()
        stop = True
        await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        raise
    cpu1 = procs.cpu()
    return Phase(
        path=path.name,
        concurrency=concurrency,
        round=rnd,
        latencies_s=[t1 - t0 for t0, t1 in samples if t0 >= t_start and t1 <= t_end],
        window_s=t_end - t_start,
        completed_in_window=sum(1 for _, t1 in samples if t_start <= t1 <= t_end),
        requests=path.counts.requests,
        sessions=path.counts.sessions,
        cpu_s={k: cpu1[k] - cpu0[k] for k in cpu0},
        tokens=path.counts.tokens,
        wall=(wall0, time.time()),
    )


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    rank = q / 100 * (len(ordered) - 1)
    lo = int(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def summarize(phases: list[Phase]) -> dict[str, Any]:
    lat = [x * 1000 for p in phases for x in p.latencies_s]
    window = sum(p.window_s for p in phases)
    requests = sum(p.requests for p in phases)
    cpu = {k: sum(p.cpu_s[k] for p in phases) for k in phases[0].cpu_s}
    out: dict[str, Any] = {
        "requests_measured": len(lat),
        "p50_ms": round(pct(lat, 50), 3),
        "p90_ms": round(pct(lat, 90), 3),
        "p99_ms": round(pct(lat, 99), 3),
        "mean_ms": round(statistics.fmean(lat), 3),
        "throughput_rps": round(sum(p.completed_in_window for p in phases) / window, 1),
        "round_throughputs_rps": [round(p.throughput, 1) for p in phases],
        "round_p50_ms": [round(pct([x * 1000 for x in p.latencies_s], 50), 3) for p in phases],
        "cpu_ms_per_request": {k: round(1000 * v / requests, 3) for k, v in cpu.items()},
        # Per round: on a shared machine the least-disturbed round is the best estimate of a
        # change's cost, and the spread says how far to trust a difference.
        "round_gateway_cpu_ms_per_request": [
            round(1000 * p.cpu_s["gateway"] / max(p.requests, 1), 3) for p in phases
        ],
        "round_gateway_user_cpu_ms_per_request": [
            round(1000 * p.cpu_s["gateway_user"] / max(p.requests, 1), 3) for p in phases
        ],
        "backend_connections_per_request": round(
            sum(p.backend_connections for p in phases) / requests, 3
        ),
        "completion_tokens_per_request": round(sum(p.tokens for p in phases) / requests, 2),
    }
    metrics = [p.gateway_metrics for p in phases if p.gateway_metrics]
    if metrics:
        pubs = sum(m["publish_count"] for m in metrics)
        reqs = sum(m["request_count"] for m in metrics)
        out["gateway_server_ms_mean"] = round(
            1000 * sum(m["request_sum"] for m in metrics) / max(reqs, 1), 3
        )
        out["gateway_publish_ms_mean"] = round(
            1000 * sum(m["publish_sum"] for m in metrics) / max(pubs, 1), 3
        )
    return out
