"""Benchmark: many gateways, one log (issue 36): what affinity saves once the log decides.

Any number of gateways may serve one session: a gateway whose copy is behind reads the events it
missed from the log before it continues (a *catch-up read*), and an append made on a stale copy
is refused by JetStream and redone (a *refused append*). Affinity (each session always to one
gateway) is an optimization, and this measures how much it buys.

* One nats-server, one fixed-latency backend (``--ttft-ms``, default 20; every answer is the same
  Bash tool call), and ``--gateways`` (default 1,2,4) ``turnstream gateway`` processes on it,
  started once: a configuration of N uses the first N.
* Agent-shaped sessions (``harness.routed_sessions``), closed loop, ``--concurrency`` (default
  32) in flight: Chat Completions (httpx), 4,000 characters of Claude Code's system text and four
  of its tools; each request the whole history: every answer is a tool call, answered by a tool
  result; 6 turns a session; every 4th session also runs a sub-agent (its own task,
  ``X-Turnstream-Agent: sub-1``) whose 3 turns are each sent together with one of its main
  agent's (a background agent: round robin sends the two to different gateways at once).
* The client routes each request: **round robin** (the fleet's next gateway, whatever the
  session: a load balancer without affinity) or **affinity** (the gateway of the session id's
  CRC-32 mod N, ``schemas.ids.session_owner``). N = 1 is the control (both the same).
* Per round one phase per (N, routing), the two routings of an N back to back, which goes first
  alternating from round to round and N's order reversed every other round.
* Per configuration: gateway CPU per turn (the N processes' user + system CPU over the phases,
  over the turns answered in them), throughput (turns answered in the measured windows / s),
  and from the gateways' ``/metrics``: catch-up reads per turn
  (``turnstream_gateway_catch_up_reads_total``), refused appends per 1,000 turns
  (``turnstream_gateway_appends_refused_total``), stale prompts
  (``turnstream_gateway_stale_prompts_total``, must be 0). A counter a gateway lacks reads 0.
  ``cpu_ratio_gateways_N``: CPU per turn round robin / affinity (target <= 1.3).
* The workers section (``--only workers``: it alone; ``--only fleet``: the above alone): one
  ``turnstream gateway --workers 2`` per ``--worker-routing`` (owner: each connection handed to
  its session's worker; any: SO_REUSEPORT, any worker serves any session and catches up), the
  same load to its one port (one keep-alive pool for all sessions, so a session's requests ride
  whichever connection is free); ``cpu_ratio_workers_2_any_to_owner`` and
  ``throughput_ratio_workers_2_any_to_owner``, paired the same way.
* Checked from EVENTS at the end (exit 1 otherwise, after the report): every answered turn of
  every conversation continues that conversation's previous turn token for token (its
  ``parent_turn``, its whole context as ``prefix_len``); the count of those that do not is
  reported as ``retokenized_continuations``.

    .venv/bin/python benchmarks/fleet.py            # ~4.5 min
    .venv/bin/python benchmarks/fleet.py --quick    # ~70 s
    .venv/bin/python benchmarks/fleet.py --only workers --quick
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import statistics
import subprocess
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import harness
import httpx
from harness import banner, finish, reply_ids, say
from harness.routed_sessions import AgentSessions, RoutedLoad, check_continued

from eventlog import connect
from eventlog.server import NatsServer, free_port

JSON = dict[str, Any]
MAX_CONTEXT = 32_768
TARGET_RATIO = 1.3
ROUTINGS = ("round_robin", "affinity")
WORKER_ROUTINGS = ("owner", "any")
FULL = harness.Plan(warmup_s=1.0, measure_s=6.0, rounds=4)
QUICK = harness.Plan(warmup_s=0.5, measure_s=1.5, rounds=2)
COUNTERS = {
    "turnstream_gateway_catch_up_reads_total": "catch_up_reads",
    "turnstream_gateway_appends_refused_total": "appends_refused",
    "turnstream_gateway_caught_up_events_total": "caught_up_events",
    "turnstream_gateway_stale_prompts_total": "stale_prompts",
}
REASONS = ("refused", "unsure", "idle")  # turnstream_gateway_catch_up_reads_total{reason=...}


# -- the processes ------------------------------------------------------------------------------


@dataclass
class Gateways:
    """CPU seconds of each gateway (with its children: ``--workers``' processes), the backend,
    nats-server and this load generator."""

    procs: dict[str, subprocess.Popen[bytes]]
    urls: dict[str, str]
    backend: subprocess.Popen[bytes]
    nats: NatsServer

    def cpu(self) -> dict[str, float]:
        assert self.nats.pid is not None
        out = {name: harness.tree_cpu_seconds(p.pid) for name, p in self.procs.items()}
        out["backend"] = harness.cpu_seconds(self.backend.pid)
        out["nats"] = harness.cpu_seconds(self.nats.pid)
        return {**out, "loadgen": harness.own_cpu_seconds()}


def gateway_specs(args: argparse.Namespace) -> dict[str, list[str]]:
    """The gateways to start, by name, with the flags each adds."""
    specs: dict[str, list[str]] = {}
    if args.only in (None, "fleet"):
        specs |= {f"gw{i}": [] for i in range(max(args.gateways))}
    if args.only in (None, "workers"):
        specs |= {
            f"workers_{r}": ["--workers", "2", "--worker-routing", r] for r in WORKER_ROUTINGS
        }
    return specs


async def counters(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    """The issue-36 counters of one gateway's /metrics, summed over their labels (0: absent),
    and the catch-up reads by reason."""
    out = dict.fromkeys([*COUNTERS.values(), *(f"catch_up_reads_{r}" for r in REASONS)], 0.0)
    for line in (await client.get(f"{url}/metrics")).text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in COUNTERS:
            value = float(line.rsplit(" ", 1)[1])
            out[COUNTERS[name]] += value
            for reason in REASONS:
                if f'reason="{reason}"' in line:
                    out[f"catch_up_reads_{reason}"] += value
    return out


async def metered_phase(
    path: RoutedLoad,
    client: httpx.AsyncClient,
    args: argparse.Namespace,
    plan: harness.Plan,
    tag: str,
    meter: Gateways,
    rnd: int,
) -> harness.Phase:
    before = [await counters(client, url) for url in set(path.urls)]
    phase = await harness.run_phase(path, args.concurrency, plan, tag, meter, rnd)
    after = [await counters(client, url) for url in set(path.urls)]
    phase.gateway_metrics = {
        key: sum(a[key] - b[key] for a, b in zip(after, before, strict=True)) for key in before[0]
    }
    return phase


# -- the run ------------------------------------------------------------------------------------


def order_of(rnd: int, items: list[str], pairs: tuple[str, str]) -> list[tuple[str, str]]:
    """Round ``rnd``'s phases: each item's two routings back to back, which first alternating
    by round and item, the items reversed every other round."""
    items = items if rnd % 2 == 0 else items[::-1]
    return [
        (item, routing)
        for i, item in enumerate(items)
        for routing in (pairs if (rnd + i) % 2 == 0 else pairs[::-1])
    ]


async def run(args: argparse.Namespace, plan: harness.Plan, tmp: Path) -> JSON:
    from gateway.model import ensure_tiny_model

    model_dir = ensure_tiny_model(Path(args.model_cache))
    completion = reply_ids(model_dir)
    conv = harness.Conversation([], [], (completion[-1],), completion, len(completion))
    log_dir = tmp / "logs"
    log_dir.mkdir()
    nats = NatsServer(tmp / "nats").start()
    backend_port = free_port()
    backend_url = f"http://127.0.0.1:{backend_port}"
    command = harness.backend_command(args, backend_port, conv, model_dir.name)
    backend = harness.spawn(
        [*command, "--max-model-len", str(MAX_CONTEXT)], log_dir / "backend.log", os.environ
    )
    gw_args = argparse.Namespace(**{**vars(args), "max_inflight_per_replica": args.concurrency})
    meter = Gateways({}, {}, backend, nats)
    phases: list[harness.Phase] = []
    paths: list[RoutedLoad] = []
    load = AgentSessions(model_dir.name)
    try:
        await harness.wait_http(f"{backend_url}/health", backend, "fixed-latency backend", 30)
        t0 = time.perf_counter()
        for name, extra in gateway_specs(args).items():
            port = free_port()
            cmd = harness.gateway_command(
                gw_args, model_dir, nats.url, backend_url, port, tmp / name, tmp / f"{name}.gc"
            )
            cmd[cmd.index("--max-context") + 1] = str(MAX_CONTEXT)
            env = harness.gateway_env(args)
            meter.procs[name] = harness.spawn([*cmd, *extra], log_dir / f"{name}.log", env)
            meter.urls[name] = f"http://127.0.0.1:{port}"
        for name, proc in meter.procs.items():
            await harness.wait_http(f"{meter.urls[name]}/health", proc, name, 300)
        say(f"{len(meter.procs)} gateways up in {time.perf_counter() - t0:.1f} s")
        # A pooled connection idle as long as the gateway keeps it (uvicorn: 5 s, httpx's
        # default expiry too) may be closed by the gateway just as it is reused: a ReadError
        # no retry covers for a POST. Idle ones are dropped well before, and each phase starts
        # with a pool of its own.
        limits = httpx.Limits(
            max_connections=None, max_keepalive_connections=None, keepalive_expiry=2.0
        )
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            warm = RoutedLoad("warm-up", client, list(meter.urls.values()), "round_robin", load)
            await asyncio.gather(*(warm.worker(w, "warm")() for w in range(len(meter.urls))))
        for rnd in range(plan.rounds):
            line = []
            for item, routing in schedule(args, rnd):
                urls = fleet_urls(meter, item, routing)
                async with httpx.AsyncClient(timeout=120, limits=limits) as client:
                    path = RoutedLoad(f"{item}/{routing}", client, urls, routing, load)
                    phase = await metered_phase(
                        path, client, args, plan, f"{item}-{routing}-r{rnd}", meter, rnd
                    )
                phases.append(phase)
                paths.append(path)
                line.append(f"{path.name} {phase.throughput:6.1f}/s")
            say(f"  round {rnd + 1}/{plan.rounds}: " + ", ".join(line))
        nc = await connect(nats.url, name="fleet-bench")
        try:
            checked, forked = await check_continued(nc.jetstream(), paths)
        finally:
            await nc.close()
    except BaseException:
        for log_file in sorted(log_dir.iterdir()):
            say(f"--- {log_file.name} (tail) ---\n{log_file.read_text(errors='replace')[-3000:]}")
        raise
    finally:
        for proc in meter.procs.values():
            harness.stop_process(proc, signal.SIGINT, 60)
        harness.stop_process(backend, signal.SIGTERM)
        nats.stop()
    return {
        **report(phases, {id(p): path.landings() for p, path in zip(phases, paths, strict=True)}),
        "continuations_checked": checked,
        "retokenized_continuations": len(forked),
        "retokenized_examples": forked[:20],
        "requests_sent_again": dict(Counter(p.name for p in paths for _ in range(p.retried))),
    }


def schedule(args: argparse.Namespace, rnd: int) -> list[tuple[str, str]]:
    """Round ``rnd``'s (gateways or workers item, routing) phases."""
    out = []
    if args.only in (None, "fleet"):
        out += order_of(rnd, [f"gateways_{n}" for n in args.gateways], ROUTINGS)
    if args.only in (None, "workers"):
        out += order_of(rnd, ["workers_2"], WORKER_ROUTINGS)
    return out


def fleet_urls(meter: Gateways, item: str, routing: str) -> list[str]:
    """The URLs a configuration's requests go to: its N gateways, or its workers' one port."""
    if item.startswith("workers"):
        return [meter.urls[f"workers_{routing}"]]
    return [meter.urls[f"gw{i}"] for i in range(int(item.rsplit("_", 1)[1]))]


def cpu_keys(item: str, routing: str) -> list[str]:
    """The processes whose CPU is the configuration's."""
    if item.startswith("workers"):
        return [f"workers_{routing}"]
    return [f"gw{i}" for i in range(int(item.rsplit("_", 1)[1]))]


# -- the report and the check -------------------------------------------------------------------


def table_order(name: str) -> tuple[bool, int, bool]:
    """gateways_1 .. N, then the workers; round robin (any) above affinity (owner)."""
    item, routing = name.split("/")
    return item.startswith("workers"), int(item.rsplit("_", 1)[1]), routing in ("affinity", "owner")


def cpu_per_turn(phase: harness.Phase, keys: list[str]) -> float:
    return sum(phase.cpu_s[k] for k in keys) / max(phase.requests, 1)


def report(phases: list[harness.Phase], landings: dict[int, tuple[int, int]]) -> JSON:
    """Per configuration its figures; per pair of routings the ratios (median over rounds of
    each round's ratio, the two phases of a round run back to back)."""
    rows: JSON = {}
    by = {(p.path, p.round): p for p in phases}
    rounds = sorted({p.round for p in phases})
    for name in sorted({p.path for p in phases}, key=table_order):
        item, routing = name.split("/")
        mine = [p for p in phases if p.path == name]
        turns = sum(p.requests for p in mine)
        keys = cpu_keys(item, routing)
        wall = sum(p.wall[1] - p.wall[0] for p in mine)
        counted = {k: sum(p.gateway_metrics[k] for p in mine) for k in mine[0].gateway_metrics}
        moved, new = (sum(x) for x in zip(*(landings[id(p)] for p in mine), strict=True))
        rows[name] = {
            "cpu_ms_per_turn": round(1000 * sum(p.cpu_s[k] for p in mine for k in keys) / turns, 3),
            "turns_per_s": round(
                sum(p.completed_in_window for p in mine) / sum(p.window_s for p in mine), 1
            ),
            "catch_up_reads_per_turn": round(counted["catch_up_reads"] / turns, 3),
            "catch_up_reads_per_turn_by_reason": {
                r: round(counted[f"catch_up_reads_{r}"] / turns, 3) for r in REASONS
            },
            # Client-side, N gateways only: turns sent to another gateway than their session's
            # previous one, and first requests of a session on a gateway after its first (the
            # gateway loads the session whole: not a catch-up read).
            "moved_per_turn": None if item.startswith("workers") else round(moved / turns, 3),
            "session_loads_elsewhere_per_turn": (
                None if item.startswith("workers") else round(new / turns, 3)
            ),
            "appends_refused_per_1000_turns": round(1000 * counted["appends_refused"] / turns, 1),
            "caught_up_events_per_turn": round(counted["caught_up_events"] / turns, 3),
            "stale_prompts": counted["stale_prompts"],
            "turns": turns,
            "round_cpu_ms_per_turn": [round(1000 * cpu_per_turn(p, keys), 3) for p in mine],
            # Cores each kept busy over the phases: on 2 cores, which one ran out.
            "busy_cores": {
                group: round(sum(p.cpu_s[k] for p in mine for k in members) / wall, 2)
                for group, members in (
                    ("gateways", keys),
                    ("backend", ["backend"]),
                    ("nats", ["nats"]),
                    ("loadgen", ["loadgen"]),
                )
            },
        }
    figures: JSON = {"rows": rows}
    pairs = [("gateways", "round_robin", "affinity"), ("workers", "any", "owner")]
    for kind, top, bottom in pairs:
        for item in dict.fromkeys(n.split("/")[0] for n in rows if n.startswith(kind)):
            a, b = f"{item}/{top}", f"{item}/{bottom}"
            cpu = [
                cpu_per_turn(by[a, r], cpu_keys(item, top))
                / cpu_per_turn(by[b, r], cpu_keys(item, bottom))
                for r in rounds
            ]
            rate = [by[a, r].throughput / by[b, r].throughput for r in rounds]
            suffix = item if kind == "gateways" else f"{item}_any_to_owner"
            figures[f"cpu_ratio_{suffix}"] = round(statistics.median(cpu), 3)
            figures[f"throughput_ratio_{suffix}"] = round(statistics.median(rate), 3)
            figures[f"round_cpu_ratios_{suffix}"] = [round(x, 3) for x in cpu]
    fleet = [v for k, v in figures.items() if k.startswith("cpu_ratio_gateways")]
    figures["targets"] = {
        "cpu_ratio_max": TARGET_RATIO,
        "met": all(r <= TARGET_RATIO for r in fleet),
    }
    say(
        f"\n{'configuration':<26}{'CPU ms/turn':>12}{'turns/s':>9}{'moved/turn':>11}"
        f"{'catch-up/turn':>15}{'refused/1k':>12}{'stale':>7}{'turns':>8}"
        "  busy cores (gateways/loadgen)"
    )
    for name, row in rows.items():
        say(
            f"{name:<26}{row['cpu_ms_per_turn']:>12.2f}{row['turns_per_s']:>9.1f}"
            f"{'-' if row['moved_per_turn'] is None else row['moved_per_turn']:>11}"
            f"{row['catch_up_reads_per_turn']:>15.3f}{row['appends_refused_per_1000_turns']:>12.1f}"
            f"{row['stale_prompts']:>7.0f}{row['turns']:>8}  {row['busy_cores']['gateways']:.2f}"
            f"/{row['busy_cores']['loadgen']:.2f}"
        )
    for key, value in figures.items():
        if key.startswith(("cpu_ratio", "throughput_ratio")):
            say(f"  {key}: {value:.3f}")
    return figures


async def bench(args: argparse.Namespace) -> JSON:
    plan = harness.plan_of(args, QUICK if args.quick else FULL)
    started = time.perf_counter()
    info = harness.gateway_machine_info()
    banner("fleet (many gateways, one log)", args.quick, info)
    say(
        f"c={args.concurrency}, {plan.rounds} rounds, each phase {plan.warmup_s:g} s warm-up + "
        f"{plan.measure_s:g} s measured; gateways {args.gateways}"
    )
    with tempfile.TemporaryDirectory(prefix="ts-fleet-", dir=args.store_dir) as tmp:
        figures = await run(args, plan, Path(tmp))
    finish(figures, quick=args.quick, duration_s=time.perf_counter() - started, info=info)
    return figures


def main() -> None:
    logging.basicConfig(level=logging.ERROR)
    parser = harness.gateway_arguments(__doc__)
    parser.add_argument(
        "--gateways",
        type=lambda text: [int(n) for n in text.split(",")],
        default=[1, 2, 4],
        help="gateway counts of the fleet section (default 1,2,4)",
    )
    parser.add_argument(
        "--only", choices=("fleet", "workers"), default=None, help="run one section"
    )
    args = parser.parse_args()
    args.concurrency = int(args.concurrency or 32)
    figures = asyncio.run(bench(args))
    stale = sum(row["stale_prompts"] for row in figures["rows"].values())
    if figures["retokenized_continuations"] or stale:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
