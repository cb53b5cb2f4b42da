"""Benchmark: throughput through 1 vs N gateway processes, issue 16.5 (also
``gateway_overhead.py --scaleout``, and part of its default run).

``turnstream gateway --workers N`` runs N processes on one port; each request is served by the
worker that holds its session, its connection moved there when it landed elsewhere
(``gateway.http.handoff``). This measures what that buys and costs at the short shape of the default
run (4-turn sessions, 16 output tokens, the fixed-latency backend ~20 ms to first token)::

    .venv/bin/python benchmarks/gateway_overhead.py --scaleout           # ~3 min
    .venv/bin/python benchmarks/gateway_overhead.py --scaleout --quick   # ~1.5 min
    # 16 cores (issue 16.5's target shape; ~2.5 min):
    python benchmarks/gateway_overhead.py --scaleout --scaleout-workers 1,4,8 \
        --concurrency 256 --load-processes 8 --backend-processes 2

* One nats-server, the fixed-latency backend (``--backend-processes K``: K of them on one port,
  SO_REUSEPORT, uvloop), one gateway per ``--scaleout-workers`` count (default 1 and 2), all
  through ``harness/gateway_launcher.py``, as the default run starts its gateway.
* Per round one phase per path at c=``--concurrency`` (default 64; closed loop; 8 workers share
  each httpx pool, so one keep-alive connection carries many sessions, as an agent host's does):
  direct to the backend, then each gateway; the order rotates every round. ``--load-processes
  K``: the closed loop spread over K processes (c/K workers each, a phase's throughput the sum
  of theirs), so that on many cores the load generator does not bound the direct path.
* CPU of a gateway: its process and its live children (the supervisor and workers), user +
  system, from /proc, per answered request; ``busy_cores``: each process group's CPU seconds over
  the phases' wall time, which shows which one ran out of cores.
* ``handoffs_per_request_workers_N``: connections moved between workers per request, from the
  workers' own count (logged when they stop); with the CPU per request of the gateways it gives
  the cost of a handoff beside what more processes bring.
* Checked: every answer (text and id); EVENTS grew by exactly the turns answered + the sessions
  opened in each gateway phase.

* ``handoff_cpu_us``: one connection moved between two ``Handoff``s of one process (its
  descriptor and 700 bytes sent, received, taken), less the same loop without the move: the
  handoff's own CPU, apart from the machine's load.

Keys: ``throughput_ratio_c{C}_workers_{N}`` (requests/s over the same round's direct, median
over rounds), ``gateway_cpu_ms_per_request_c{C}_workers_{N}``, ``handoffs_per_request_workers_N``,
``handoff_cpu_us``. Today (2026-11-26, docs/PERFORMANCE.md): on this 2-core VM at c=64, 1 worker
0.556 of direct, 2 workers 0.535 (2026-11-28, quick, after the backend transport and template
changes: 0.786 and 0.714; a second process has no core of its own: the load generator,
the backend and nats-server share the cores with the gateway); on 16 cores at c=256
(2026-11-28, the device machine), 1 / 4 / 8 workers ~1,000 / ~2,700 / ~4,400 requests/s (1.0 /
1.4 / 1.6 ms of CPU per request), 8 workers 0.923 of a direct path bound by 4 load processes and
0.708 of one on 8 (~6,100/s); on 2026-11-26 ~540 / ~1,800 / ~3,300, 0.93-0.98 and 0.56.
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

import harness
from harness import (
    LoadProcesses,
    LoadSpec,
    banner,
    finish,
    http_clients,
    load_paths,
    run_gateway_mode,
    say,
)

from eventlog import connect
from eventlog.server import NatsServer, free_port

JSON = dict[str, Any]
CONCURRENCY = 64
WORKERS = (1, 2)
FULL = harness.Plan(warmup_s=1.0, measure_s=5.0, rounds=4)
QUICK = harness.Plan(warmup_s=0.5, measure_s=2.0, rounds=2)
_STOPPED = re.compile(r"stopped: (\d+) sessions held, (\d+) connections moved out, (\d+) in")


@dataclass(frozen=True)
class Shape:
    """What one scale-out run measures: the default (c=64, 1 vs 2 workers, everything in one
    process each) or, on many cores, e.g. c=256 through 1, 4 and 8 workers with the load and the
    backend spread over processes so that neither limits the direct path."""

    concurrency: int = CONCURRENCY
    workers: tuple[int, ...] = WORKERS
    load_processes: int = 1
    backend_processes: int = 1

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Shape:
        levels = [int(c) for c in (args.concurrency or str(CONCURRENCY)).split(",")]
        workers = tuple(int(n) for n in args.scaleout_workers.split(","))
        if len(levels) != 1 or levels[0] < 1:
            raise SystemExit("--scaleout measures one concurrency level (--concurrency C)")
        if not workers or min(workers) < 1 or len(set(workers)) != len(workers):
            raise SystemExit("--scaleout-workers: distinct positive counts, e.g. 1,4,8")
        if args.load_processes < 1 or args.backend_processes < 1:
            raise SystemExit("--load-processes and --backend-processes are at least 1")
        return cls(levels[0], workers, args.load_processes, args.backend_processes)


@dataclass
class ScaleProcs:
    """CPU seconds of the backend processes, each gateway (with its children), nats-server and
    the load generator (this process and its load processes)."""

    backends: list[subprocess.Popen[bytes]]
    gateways: dict[str, subprocess.Popen[bytes]]
    nats: NatsServer
    load_pids: list[int]

    def cpu(self) -> dict[str, float]:
        assert self.nats.pid is not None
        out = {"backend": sum(harness.cpu_seconds(p.pid) for p in self.backends)}
        for name, proc in self.gateways.items():
            out[name] = harness.tree_cpu_seconds(proc.pid)
        out["nats"] = harness.cpu_seconds(self.nats.pid)
        load = harness.own_cpu_seconds()
        for pid in self.load_pids:
            with contextlib.suppress(OSError):
                load += harness.cpu_seconds(pid)
        return {**out, "loadgen": load}


def gateway_name(workers: int) -> str:
    return f"workers_{workers}"


def start_backends(
    args: argparse.Namespace, conv: harness.Conversation, model: str, log_dir: Path, count: int
) -> tuple[str, list[subprocess.Popen[bytes]]]:
    """One fixed-latency backend, or ``count`` of them on one port (SO_REUSEPORT, uvloop)."""
    port = free_port()
    command = harness.backend_command(args, port, conv, model)
    if count > 1:
        command += ["--reuse-port", "--uvloop"]
    procs = [harness.spawn(command, log_dir / f"backend-{i}.log", os.environ) for i in range(count)]
    return f"http://127.0.0.1:{port}", procs


async def measure_scaleout(
    args: argparse.Namespace, plan: harness.Plan, tmp: Path, shape: Shape
) -> JSON:
    from gateway.model import ensure_tiny_model

    model_dir = ensure_tiny_model(Path(args.model_cache))
    conv = harness.build_conversation(model_dir, args.turns_per_session, "fixed-latency")
    log_dir = tmp / "logs"
    log_dir.mkdir()
    nats = NatsServer(tmp / "nats").start()
    backend_url, backends = start_backends(
        args, conv, model_dir.name, log_dir, shape.backend_processes
    )
    gateways: dict[str, subprocess.Popen[bytes]] = {}
    urls: dict[str, str] = {}
    unprofiled = argparse.Namespace(
        **{**vars(args), "profile_gateway": None, "max_inflight_per_replica": shape.concurrency}
    )
    # rich wraps log lines at the terminal's width: the workers' counts must stay on one line.
    env = {**harness.gateway_env(args), "COLUMNS": "400", "TURNSTREAM_LOG_LEVEL": "INFO"}
    nc = None
    load: LoadProcesses | None = None
    try:
        for proc in backends:
            await harness.wait_http(f"{backend_url}/health", proc, "fixed-latency backend", 30)
        for workers in shape.workers:
            name = gateway_name(workers)
            port = free_port()
            cmd = harness.gateway_command(
                unprofiled, model_dir, nats.url, backend_url, port, tmp / name, tmp / f"{name}.gc"
            )
            gateways[name] = harness.spawn(
                [*cmd, "--workers", str(workers)], log_dir / f"{name}.log", env
            )
            urls[name] = f"http://127.0.0.1:{port}"
        for name, proc in gateways.items():
            await harness.wait_http(f"{urls[name]}/health", proc, name, 300)
        spec = LoadSpec(urls, backend_url, model_dir.name, conv, args.workers_per_client)
        if shape.load_processes > 1:
            load = LoadProcesses(spec, shape.concurrency, shape.load_processes)
            await load.receive()
        procs = ScaleProcs(backends, gateways, nats, load.pids if load is not None else [])
        nc = await connect(nats.url, name="scaleout-bench")
        js = nc.jetstream()
        gc.collect()
        gc.freeze()
        async with contextlib.AsyncExitStack() as stack:
            paths: dict[str, harness.LoadPath] = {}
            if load is None:
                clients = await http_clients(stack, shape.concurrency, spec.per)
                paths = await load_paths(spec, clients)
                for path in paths.values():
                    path.counts = harness.PhaseCounts()
                    await path.worker(0, "first")()
            order = ["direct", *urls]
            phases: list[harness.Phase] = []
            say(
                f"\nc={shape.concurrency} ({shape.load_processes} load process(es), "
                f"{shape.backend_processes} backend process(es)), {plan.rounds} rounds, each path "
                f"per round: {plan.warmup_s:g} s warm-up + {plan.measure_s:g} s measured; order "
                "rotates"
            )
            for rnd in range(plan.rounds):
                line = []
                shift = rnd % len(order)
                for name in order[shift:] + order[:shift]:
                    before = await harness.stream_messages(js)
                    tag = f"{name}-r{rnd}"
                    if load is not None:
                        phase = await load.phase(name, plan, tag, procs, rnd)
                    else:
                        phase = await harness.run_phase(
                            paths[name], shape.concurrency, plan, tag, procs, rnd
                        )
                    if name != "direct":
                        grown = await harness.stream_messages(js) - before
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
        if load is not None:
            load.close()
        if nc is not None:
            await nc.close()
        for proc in gateways.values():
            harness.stop_process(proc, signal.SIGINT, 60)
        for proc in backends:
            harness.stop_process(proc, signal.SIGTERM)
        nats.stop()
    moved = {
        workers: sum(
            int(m.group(2))
            for m in _STOPPED.finditer((log_dir / f"{gateway_name(workers)}.log").read_text())
        )
        for workers in shape.workers
    }
    return report(phases, moved, shape)


def report(phases: list[harness.Phase], moved: dict[int, int], shape: Shape) -> JSON:
    rounds = sorted({p.round for p in phases})
    by = {(p.path, p.round): p for p in phases}
    c = shape.concurrency
    figures: JSON = {}
    rows: JSON = {}
    cores: JSON = {}
    for workers in shape.workers:
        name = gateway_name(workers)
        ratios = [by[name, r].throughput / by["direct", r].throughput for r in rounds]
        mine = [p for p in phases if p.path == name]
        requests = sum(p.requests for p in mine)
        cpu_ms = 1000 * sum(p.cpu_s[name] for p in mine) / requests
        figures[f"throughput_ratio_c{c}_{name}"] = round(statistics.median(ratios), 3)
        figures[f"gateway_cpu_ms_per_request_c{c}_{name}"] = round(cpu_ms, 3)
        # Every request of the gateway's phases and its warm-up ones: the moves it counted.
        figures[f"handoffs_per_request_{name}"] = round(moved[workers] / (requests + 1), 3)
        rows[name] = {
            "ratios": [round(r, 3) for r in ratios],
            "requests_per_s": [round(by[name, r].throughput, 1) for r in rounds],
            "p50_ms": round(1000 * statistics.median(x for p in mine for x in p.latencies_s), 2),
            "requests": requests,
        }
        cores[name] = busy_cores(mine)
    direct = [p for p in phases if p.path == "direct"]
    rows["direct"] = {
        "requests_per_s": [round(p.throughput, 1) for p in direct],
        "p50_ms": round(1000 * statistics.median(x for p in direct for x in p.latencies_s), 2),
    }
    cores["direct"] = busy_cores(direct)
    extra: JSON = {}
    many = [n for n in shape.workers if n > 1]
    if 1 in shape.workers and many:
        n = many[0]
        extra["cpu_ms_added_per_handoff"] = round(
            (
                figures[f"gateway_cpu_ms_per_request_c{c}_{gateway_name(n)}"]
                - figures[f"gateway_cpu_ms_per_request_c{c}_workers_1"]
            )
            / max(figures[f"handoffs_per_request_{gateway_name(n)}"], 1e-9),
            3,
        )
    figures["scaleout"] = {
        "rows": rows,
        "busy_cores": cores,
        **extra,
        "cpus": os.cpu_count(),
        "load_processes": shape.load_processes,
        "backend_processes": shape.backend_processes,
    }
    say("")
    for workers in shape.workers:
        name = gateway_name(workers)
        say(
            f"  through {workers} worker(s): {figures[f'throughput_ratio_c{c}_{name}']:.3f} of "
            f"direct, {figures[f'gateway_cpu_ms_per_request_c{c}_{name}']:.3f} ms CPU/request, "
            f"{figures[f'handoffs_per_request_{name}']:.2f} handoffs/request; busy cores "
            + ", ".join(f"{k} {v:.2f}" for k, v in cores[name].items())
        )
    say("  direct: busy cores " + ", ".join(f"{k} {v:.2f}" for k, v in cores["direct"].items()))
    return figures


def busy_cores(phases: list[harness.Phase]) -> JSON:
    """Mean cores each process kept busy over the phases (CPU seconds / wall seconds): which
    one ran out of cores first."""
    wall = sum(p.wall[1] - p.wall[0] for p in phases)
    return {
        key: round(sum(p.cpu_s[key] for p in phases) / wall, 2)
        for key in phases[0].cpu_s
        if any(p.cpu_s[key] for p in phases)
    }


async def handoff_cpu_us(moves: int, request_bytes: int = 700) -> JSON:
    """CPU of moving one connection between two ``Handoff``s of this process (sending the
    descriptor and a request's bytes, receiving and taking them), less the same loop without the
    move (making and closing the socket pair): the handoff's own cost, without the uvicorn
    protocol the owner then makes for the connection."""
    from gateway.http.handoff import Handoff

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


async def scaleout_figures(args: argparse.Namespace, shape: Shape | None = None) -> JSON:
    """The scale-out keys; for the default run as well (``shape`` None: c=64, 1 vs 2)."""
    plan = QUICK if args.quick else FULL
    if args.rounds or args.measure_s:
        plan = harness.Plan(
            plan.warmup_s, args.measure_s or plan.measure_s, args.rounds or plan.rounds
        )
    with tempfile.TemporaryDirectory(prefix="ts-gwscale-", dir=args.store_dir) as tmp:
        figures = await measure_scaleout(args, plan, Path(tmp), shape or Shape())
    figures.update(await handoff_cpu_us(2_000 if args.quick else 10_000))
    say(f"  one handoff alone (send + take, one process): {figures['handoff_cpu_us']:.1f} us CPU")
    return figures


async def scaleout_main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.compare_with is not None or args.backend_kind != "fixed-latency":
        parser.error("--scaleout runs the fixed-latency backend, without --compare-with")
    started = time.perf_counter()
    info = harness.gateway_machine_info()
    shape = Shape.from_args(args)
    workers = " vs ".join(str(n) for n in shape.workers)
    banner(f"gateway scale-out ({workers} processes)", args.quick, info)
    figures = await scaleout_figures(args, shape)
    finish(figures, quick=args.quick, duration_s=time.perf_counter() - started, info=info)


if __name__ == "__main__":
    run_gateway_mode(__doc__, scaleout_main)
