"""``gateway_overhead.py --scaleout``: throughput through 1 vs 2 gateway processes (issue 16.5).

``turnstream gateway --workers N`` runs N processes on one port; each request is served by the
worker that holds its session, its connection moved there when it landed elsewhere
(``gateway.handoff``). This measures what that buys and costs at the short shape of the default
run (4-turn sessions, 16 output tokens, the fixed-latency backend ~20 ms to first token)::

    .venv/bin/python benchmarks/gateway_overhead.py --scaleout           # ~3 min
    .venv/bin/python benchmarks/gateway_overhead.py --scaleout --quick   # ~1.5 min

* One nats-server, one fixed-latency backend, two gateways: ``--workers 1`` and ``--workers 2``
  (both through ``_gateway_launcher.py``, as the default run starts its gateway).
* Per round, three phases at c=64 (closed loop; 8 workers share each httpx pool, so one
  keep-alive connection carries many sessions, as an agent host's does): direct to the backend,
  through 1 worker, through 2 workers; the order rotates every round.
* CPU of a gateway: its process and its live children (the 2-worker gateway's supervisor and
  workers), user + system, from /proc, per answered request.
* ``handoffs_per_request_workers_2``: connections moved between workers per request, from the
  workers' own count (logged when they stop); with the CPU per request of both gateways it gives
  the cost of a handoff beside what a second process brings.
* Checked: every answer (text and id); EVENTS grew by exactly the turns answered + the sessions
  opened in each gateway phase.

* ``handoff_cpu_us``: one connection moved between two ``Handoff``s of one process (its
  descriptor and 700 bytes sent, received, taken), less the same loop without the move: the
  handoff's own CPU, apart from the machine's load.

Keys: ``throughput_ratio_c64_workers_1``, ``throughput_ratio_c64_workers_2`` (requests/s over
the same round's direct, median over rounds), ``gateway_cpu_ms_per_request_c64_workers_1`` and
``_2``, ``handoffs_per_request_workers_2``, ``handoff_cpu_us``. On a 2-core machine the load
generator, the backend and nats-server share the cores with the gateway: a second gateway process
has no core of its own to run on, so the ratio shows the handoff's cost more than the scale-out's
gain.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import re
import signal
import socket
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gateway_overhead as overhead
import httpx
from _common import banner, finish, say

from eventlog import NatsServer, connect, free_port

JSON = dict[str, Any]
CONCURRENCY = 64
WORKERS = (1, 2)
FULL = overhead.Plan(warmup_s=1.0, measure_s=5.0, rounds=4)
QUICK = overhead.Plan(warmup_s=0.5, measure_s=2.0, rounds=2)
_STOPPED = re.compile(r"stopped: (\d+) sessions held, (\d+) connections moved out, (\d+) in")


@dataclass
class ScaleProcs:
    """CPU seconds of the backend, each gateway (with its children), nats-server, this process."""

    backend: subprocess.Popen[bytes]
    gateways: dict[str, subprocess.Popen[bytes]]
    nats: NatsServer

    def cpu(self) -> dict[str, float]:
        assert self.nats.pid is not None
        out = {"backend": overhead.cpu_seconds(self.backend.pid)}
        for name, proc in self.gateways.items():
            out[name] = overhead.tree_cpu_seconds(proc.pid)
        out["nats"] = overhead.cpu_seconds(self.nats.pid)
        return {**out, "loadgen": overhead.own_cpu_seconds()}


def gateway_name(workers: int) -> str:
    return f"workers_{workers}"


async def measure_scaleout(args: argparse.Namespace, plan: overhead.Plan, tmp: Path) -> JSON:
    from gateway.model import ensure_tiny_model

    model_dir = ensure_tiny_model(Path(args.model_cache))
    conv = overhead.build_conversation(model_dir, args.turns_per_session, "fixed-latency")
    log_dir = tmp / "logs"
    log_dir.mkdir()
    nats = NatsServer(tmp / "nats").start()
    backend = overhead.FixedLatencyBackend(args, conv, model_dir.name, log_dir)
    gateways: dict[str, subprocess.Popen[bytes]] = {}
    urls: dict[str, str] = {}
    unprofiled = argparse.Namespace(
        **{**vars(args), "profile_gateway": None, "max_inflight_per_replica": CONCURRENCY}
    )
    # rich wraps log lines at the terminal's width: the workers' counts must stay on one line.
    env = {**overhead.gateway_env(args), "COLUMNS": "400", "TURNSTREAM_LOG_LEVEL": "INFO"}
    nc = None
    try:
        await backend.ready()
        for workers in WORKERS:
            name = gateway_name(workers)
            port = free_port()
            cmd = overhead.gateway_command(
                unprofiled, model_dir, nats.url, backend.url, port, tmp / name, tmp / f"{name}.gc"
            )
            gateways[name] = overhead.spawn(
                [*cmd, "--workers", str(workers)], log_dir / f"{name}.log", env
            )
            urls[name] = f"http://127.0.0.1:{port}"
        for name, proc in gateways.items():
            await overhead.wait_http(f"{urls[name]}/health", proc, name, 300)
        procs = ScaleProcs(backend.proc, gateways, nats)
        nc = await connect(nats.url, name="scaleout-bench")
        js = nc.jetstream()
        gc.collect()
        gc.freeze()
        per = args.workers_per_client
        # Idle connections dropped by the client before uvicorn's 5 s keep-alive timeout: a path
        # idles through the other two phases, and a connection the server closes just as it is
        # reused is a ReadError (seen at load average 10), whichever path it is.
        limits = httpx.Limits(
            max_connections=per + 2, max_keepalive_connections=per + 2, keepalive_expiry=3.0
        )
        async with contextlib.AsyncExitStack() as stack:
            clients = [
                await stack.enter_async_context(httpx.AsyncClient(limits=limits, timeout=60.0))
                for _ in range(-(-CONCURRENCY // per))
            ]
            paths: dict[str, overhead.LoadPath] = {
                "direct": overhead.Direct(clients, per, backend.url, model_dir.name, conv)
            }
            for name, url in urls.items():
                paths[name] = overhead.Gateway(clients, per, url, model_dir.name, conv, name=name)
            for path in paths.values():
                path.counts = overhead.PhaseCounts()
                await path.worker(0, "first")()
            order = list(paths)
            phases: list[overhead.Phase] = []
            say(
                f"\nc={CONCURRENCY}, {plan.rounds} rounds, each path per round: "
                f"{plan.warmup_s:g} s warm-up + {plan.measure_s:g} s measured; order rotates"
            )
            for rnd in range(plan.rounds):
                line = []
                for name in order[rnd % 3 :] + order[: rnd % 3]:
                    before = await overhead.stream_messages(js)
                    phase = await overhead.run_phase(
                        paths[name], CONCURRENCY, plan, f"{name}-r{rnd}", procs, rnd
                    )
                    if name != "direct":
                        grown = await overhead.stream_messages(js) - before
                        if grown != phase.requests + phase.sessions:
                            raise RuntimeError(
                                f"{name} round {rnd}: EVENTS grew by {grown}, expected "
                                f"{phase.requests} turns + {phase.sessions} sessions"
                            )
                    phases.append(phase)
                    line.append(f"{name} {phase.throughput:7.1f}/s")
                say(f"  round {rnd}: " + ", ".join(line))
    except BaseException:
        for log_file in sorted(log_dir.iterdir()):
            say(f"--- {log_file.name} (tail) ---\n{log_file.read_text(errors='replace')[-3000:]}")
        raise
    finally:
        if nc is not None:
            await nc.close()
        for proc in gateways.values():
            overhead.stop_process(proc, signal.SIGINT, 60)
        backend.stop()
        nats.stop()
    moved = sum(int(m.group(2)) for m in _STOPPED.finditer((log_dir / "workers_2.log").read_text()))
    return report(phases, moved)


def report(phases: list[overhead.Phase], moved: int) -> JSON:
    rounds = sorted({p.round for p in phases})
    by = {(p.path, p.round): p for p in phases}
    figures: JSON = {}
    rows: JSON = {}
    for workers in WORKERS:
        name = gateway_name(workers)
        ratios = [by[name, r].throughput / by["direct", r].throughput for r in rounds]
        mine = [p for p in phases if p.path == name]
        requests = sum(p.requests for p in mine)
        cpu_ms = 1000 * sum(p.cpu_s[name] for p in mine) / requests
        figures[f"throughput_ratio_c{CONCURRENCY}_{name}"] = round(statistics.median(ratios), 3)
        figures[f"gateway_cpu_ms_per_request_c{CONCURRENCY}_{name}"] = round(cpu_ms, 3)
        rows[name] = {
            "ratios": [round(r, 3) for r in ratios],
            "requests_per_s": [round(by[name, r].throughput, 1) for r in rounds],
            "p50_ms": round(1000 * statistics.median(x for p in mine for x in p.latencies_s), 2),
            "requests": requests,
        }
    direct = [p for p in phases if p.path == "direct"]
    rows["direct"] = {
        "requests_per_s": [round(p.throughput, 1) for p in direct],
        "p50_ms": round(1000 * statistics.median(x for p in direct for x in p.latencies_s), 2),
    }
    # Every request of the 2-worker gateway's phases and its warm-up ones: the moves it counted.
    two = sum(p.requests for p in phases if p.path == gateway_name(2)) + 1
    figures["handoffs_per_request_workers_2"] = round(moved / two, 3)
    per_handoff = (
        figures[f"gateway_cpu_ms_per_request_c{CONCURRENCY}_workers_2"]
        - figures[f"gateway_cpu_ms_per_request_c{CONCURRENCY}_workers_1"]
    ) / max(figures["handoffs_per_request_workers_2"], 1e-9)
    figures["scaleout"] = {
        "rows": rows,
        "cpu_ms_added_per_handoff": round(per_handoff, 3),
        "cpus": os.cpu_count(),
        "note": "16-core machine not available: N=4/8 at c=256 not measured",
    }
    say(
        f"\n  through 1 worker: {figures['throughput_ratio_c64_workers_1']:.3f} of direct, "
        f"{figures['gateway_cpu_ms_per_request_c64_workers_1']:.3f} ms CPU/request; "
        f"2 workers: {figures['throughput_ratio_c64_workers_2']:.3f}, "
        f"{figures['gateway_cpu_ms_per_request_c64_workers_2']:.3f} ms; "
        f"{figures['handoffs_per_request_workers_2']:.2f} handoffs/request "
        f"(~{per_handoff:.3f} ms CPU each, if all of the difference is theirs)"
    )
    return figures


async def handoff_cpu_us(moves: int, request_bytes: int = 700) -> JSON:
    """CPU of moving one connection between two ``Handoff``s of this process (sending the
    descriptor and a request's bytes, receiving and taking them), less the same loop without the
    move (making and closing the socket pair): the handoff's own cost, without the uvicorn
    protocol the owner then makes for the connection."""
    from gateway.handoff import Handoff

    data = b"x" * request_bytes
    with tempfile.TemporaryDirectory(prefix="ts-handoff-") as tmp:
        here, there = Handoff(Path(tmp), 0, 2), Handoff(Path(tmp), 1, 2)
        arrived: list[int] = []
        done = asyncio.Event()

        def adopt(conn: socket.socket, body: bytes) -> None:
            conn.close()
            arrived.append(len(body))
            if len(arrived) == moves:
                done.set()

        there.listen(adopt)
        try:
            t0 = time.process_time()
            for i in range(moves):
                a, b = socket.socketpair()
                here.send(1, b.detach(), data)
                a.close()
                if i % 32 == 31:
                    await asyncio.sleep(0)  # let the owner side take them
            await done.wait()
            moved = time.process_time() - t0
            t0 = time.process_time()
            for i in range(moves):
                a, b = socket.socketpair()
                a.close()
                b.close()
                if i % 32 == 31:
                    await asyncio.sleep(0)
            base = time.process_time() - t0
        finally:
            here.close()
            there.close()
    return {
        "handoff_cpu_us": round(1e6 * (moved - base) / moves, 1),
        "handoff_moves_measured": moves,
    }


async def scaleout_figures(args: argparse.Namespace) -> JSON:
    """The scale-out keys; for the default run as well."""
    plan = QUICK if args.quick else FULL
    if args.rounds:
        plan = overhead.Plan(plan.warmup_s, plan.measure_s, args.rounds)
    with tempfile.TemporaryDirectory(prefix="ts-gwscale-", dir=args.store_dir) as tmp:
        figures = await measure_scaleout(args, plan, Path(tmp))
    figures.update(await handoff_cpu_us(2_000 if args.quick else 10_000))
    say(f"  one handoff alone (send + take, one process): {figures['handoff_cpu_us']:.1f} us CPU")
    return figures


async def scaleout_main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.compare_with is not None or args.backend_kind != "fixed-latency":
        parser.error("--scaleout runs the fixed-latency backend, without --compare-with")
    started = time.perf_counter()
    info = overhead.machine_info()
    banner("gateway scale-out (1 vs 2 processes)", args.quick, info)
    figures = await scaleout_figures(args)
    finish(figures, quick=args.quick, duration_s=time.perf_counter() - started, info=info)
