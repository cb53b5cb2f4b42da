"""Benchmark: the gateway's CPU per request before and after a change, paired (also
``gateway_overhead.py --compare-with REV``; run alone, REV defaults to HEAD).

Two gateways, the code at git revision REV (a temporary ``git worktree``) and the checkout
``--after-tree`` (default: this work tree), on one backend and one nats-server, phases
alternating; the headline is ``cpu_per_request_ratio_after_over_before``. What is sent, measured
and checked is described in the docstring of ``gateway_overhead.py`` ("Paired before/after:
--compare-with REV"); ``make bench`` leaves it out (it checks a change, it is no figure of the
code's own).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from harness import (
    REPLY,
    REPO,
    Conversation,
    Gateway,
    LoadPath,
    Phase,
    Plan,
    backend_command,
    banner,
    conversation_messages,
    cpu_seconds,
    finish,
    gateway_command,
    gateway_env,
    gateway_machine_info,
    own_cpu_seconds,
    plan_of,
    run_gateway_mode,
    run_phase,
    say,
    spawn,
    stop_process,
    wait_http,
)

from eventlog.server import NatsServer, free_port

# -- --compare-with: the gateway's CPU per request, before and after a change ----------------


def git(*argv: str, cwd: Path = REPO) -> str:
    done = subprocess.run(["git", *argv], cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"git {' '.join(argv)} (in {cwd}): {done.stderr.strip()}")
    return done.stdout.strip()


def tree_state(tree: Path) -> str:
    """``<commit>`` of a checkout, ``+ N changed files`` when its work tree differs from it."""
    try:
        commit = git("rev-parse", "HEAD", cwd=tree)
        changed = len(git("status", "--porcelain", "--untracked-files=no", cwd=tree).splitlines())
    except (RuntimeError, OSError) as exc:
        return f"unknown ({exc})"
    return commit + (f" + {changed} changed files" if changed else "")


@contextlib.contextmanager
def worktree(rev: str, path: Path) -> Iterator[Path]:
    """``git worktree add --detach path rev``, removed (``--force``) on the way out."""
    git("worktree", "add", "--detach", str(path), rev)
    try:
        yield path
    finally:
        try:
            git("worktree", "remove", "--force", str(path))
        except RuntimeError as exc:
            say(f"warning: {exc}; run `git worktree prune` once {path} is gone")


def tiny_model_in_tree(tree: Path, cache: Path) -> Path:
    """``gateway.model.ensure_tiny_model(cache)`` run with ``tree``'s code, in a child process:
    this process does not import the gateway package in ``--compare-with`` mode (the work tree's
    may be half-edited)."""
    code = (
        "import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); "
        "from gateway.model import ensure_tiny_model; print(ensure_tiny_model(Path(sys.argv[2])))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tree), str(cache)],
        cwd=tree,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the tiny model could not be made with {tree}'s code:\n{done.stderr}")
    return Path(done.stdout.strip().splitlines()[-1])


def compare_conversation(model_dir: Path, turns: int) -> Conversation:
    """What the gateway path needs (messages; the backend's completion ids), from the tokenizer
    alone: reply text + end of turn, as ``build_conversation`` makes them with ChatTemplate."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    eos = int(tokenizer.eos_token_id)
    completion = [*tokenizer.encode(REPLY, add_special_tokens=False), eos]
    return Conversation(
        conversation_messages(turns), [], (eos,), completion, max_tokens=len(completion)
    )


@dataclass
class PairProcs:
    """The backend, the ``before`` and ``after`` gateways and nats-server (a ``CpuMeter``)."""

    backend: subprocess.Popen[bytes]
    gateways: dict[str, subprocess.Popen[bytes]]
    nats: NatsServer

    def cpu(self) -> dict[str, float]:
        assert self.nats.pid is not None
        out = {"backend": cpu_seconds(self.backend.pid)}
        for name, proc in self.gateways.items():
            out[name] = cpu_seconds(proc.pid)
            out[f"{name}_user"] = cpu_seconds(proc.pid, user_only=True)
        return {**out, "nats": cpu_seconds(self.nats.pid), "loadgen": own_cpu_seconds()}


GATEWAYS = ("before", "after")


async def compare(
    args: argparse.Namespace, plan: Plan, tmp: Path, trees: dict[str, Path]
) -> list[Phase]:
    """Both gateways on one backend and one nats-server; phases alternate between them."""
    c = args.levels[0]
    t0 = time.perf_counter()
    model_dir = tiny_model_in_tree(trees["before"], Path(args.model_cache))
    conv = compare_conversation(model_dir, args.turns_per_session)
    say(f"tiny model and tokenizer ready in {time.perf_counter() - t0:.1f} s ({model_dir})")

    nats = NatsServer(tmp / "nats").start()
    backend_port = free_port()
    backend_url = f"http://127.0.0.1:{backend_port}"
    urls = {name: f"http://127.0.0.1:{free_port()}" for name in GATEWAYS}
    log_dir = tmp / "logs"
    log_dir.mkdir()
    t0 = time.perf_counter()
    procs = PairProcs(
        spawn(
            backend_command(args, backend_port, conv, model_dir.name),
            log_dir / "backend.log",
            os.environ,
        ),
        {},
        nats,
    )
    try:
        for name in GATEWAYS:
            tree = trees[name]
            cmd = gateway_command(
                args,
                model_dir,
                nats.url,
                backend_url,
                int(urls[name].rsplit(":", 1)[1]),
                tmp / f"data-{name}",
                tmp / f"gc-{name}.json",
                source_tree=tree,
            )
            env = {**gateway_env(args), "PYTHONPATH": str(tree)}
            procs.gateways[name] = spawn(cmd, log_dir / f"gateway-{name}.log", env, cwd=tree)
        await wait_http(f"{backend_url}/health", procs.backend, "fixed-latency backend", 30)
        for name, proc in procs.gateways.items():
            await wait_http(f"{urls[name]}/health", proc, f"{name} gateway ({trees[name]})", 120)
        say(
            f"backend (pid {procs.backend.pid}), gateways before (pid "
            f"{procs.gateways['before'].pid}) and after (pid {procs.gateways['after'].pid}), "
            f"nats-server (pid {nats.pid}) up in {time.perf_counter() - t0:.1f} s"
        )
        for name in GATEWAYS:  # the launcher checked and printed where the packages came from
            text = (log_dir / f"gateway-{name}.log").read_text(errors="replace")
            resolved = [
                ln.rsplit(" ", 1)[-1]
                for ln in text.splitlines()
                if ln.startswith("launcher: ") and " from " in ln
            ]
            say(f"  {name}: {', '.join(resolved)}")
        gc.collect()
        gc.freeze()
        per = args.workers_per_client
        limits = httpx.Limits(max_connections=per + 2, max_keepalive_connections=per + 2)
        async with contextlib.AsyncExitStack() as stack:
            paths: dict[str, LoadPath] = {}
            for name in GATEWAYS:  # pools of their own: no connection to one counts for the other
                clients = [
                    await stack.enter_async_context(httpx.AsyncClient(limits=limits, timeout=60.0))
                    for _ in range(-(-c // per))
                ]
                load = Gateway(
                    clients, per, urls[name], model_dir.name, conv, name=name, check_id=False
                )
                await load.worker(0, f"first-{name}")()
                paths[name] = load
            if args.gateway_gc_freeze:
                for proc in procs.gateways.values():
                    proc.send_signal(signal.SIGUSR2)
                await asyncio.sleep(1.0)
            return await compare_rounds(plan, c, paths, procs)
    except BaseException:
        for log_file in sorted(log_dir.iterdir()):
            say(f"--- {log_file.name} (tail) ---\n{log_file.read_text(errors='replace')[-4000:]}")
        raise
    finally:
        for proc in procs.gateways.values():
            stop_process(proc, signal.SIGINT)
        stop_process(procs.backend, signal.SIGTERM)
        nats.stop()


def cpu_ms_per_request(phase: Phase, key: str) -> float:
    return 1000 * phase.cpu_s[key] / max(phase.requests, 1)


async def compare_rounds(
    plan: Plan, c: int, paths: dict[str, LoadPath], procs: PairProcs
) -> list[Phase]:
    say(
        f"\nclosed loop at c={c}, {plan.rounds} rounds, each gateway per round: "
        f"{plan.warmup_s:g} s warm-up + {plan.measure_s:g} s measured; gateway CPU (user + "
        f"system) per request answered in its phase"
    )
    phases: list[Phase] = []
    for rnd in range(plan.rounds):
        order = GATEWAYS if rnd % 2 == 0 else GATEWAYS[::-1]
        done = {}
        for name in order:
            try:
                phase = await run_phase(paths[name], c, plan, f"{name}-r{rnd}", procs, rnd)
            except (httpx.HTTPError, RuntimeError) as exc:
                code = procs.gateways[name].poll()
                raise RuntimeError(
                    f"round {rnd + 1}: a request to the {name} gateway failed, run aborted"
                    + (f" (the gateway exited with code {code})" if code is not None else "")
                    + f": {exc!r}"
                ) from exc
            if phase.requests == 0:
                raise RuntimeError(f"round {rnd}: the {name} gateway answered no request")
            done[name] = phase
            phases.append(phase)
        ms = {name: cpu_ms_per_request(done[name], name) for name in GATEWAYS}
        say(
            f"  round {rnd + 1:>2}/{plan.rounds} ({order[0]} first): "
            + " | ".join(
                f"{name} {ms[name]:.3f} ms/req ({done[name].requests:,} req, "
                f"{done[name].throughput:,.0f} req/s)"
                for name in GATEWAYS
            )
            + f" | after/before {ms['after'] / ms['before']:.3f}"
        )
    return phases


def compare_report(phases: list[Phase]) -> dict[str, Any]:
    by = {name: [p for p in phases if p.path == name] for name in GATEWAYS}
    rounds = {name: sorted(ps, key=lambda p: p.round) for name, ps in by.items()}
    ms = {n: [cpu_ms_per_request(p, n) for p in rounds[n]] for n in GATEWAYS}
    user_ms = {n: [cpu_ms_per_request(p, f"{n}_user") for p in rounds[n]] for n in GATEWAYS}
    ratios = [a / b for a, b in zip(ms["after"], ms["before"], strict=True)]
    user_ratios = [a / b for a, b in zip(user_ms["after"], user_ms["before"], strict=True)]
    requests = {n: [p.requests for p in rounds[n]] for n in GATEWAYS}
    pooled = {n: 1000 * sum(p.cpu_s[n] for p in rounds[n]) / sum(requests[n]) for n in GATEWAYS}
    ratio = statistics.median(ratios)
    say(
        f"\ngateway CPU ms per request, median of {len(ratios)} rounds: before "
        f"{statistics.median(ms['before']):.3f}, after {statistics.median(ms['after']):.3f} "
        f"(pooled: {pooled['before']:.3f} -> {pooled['after']:.3f}); requests counted: before "
        f"{sum(requests['before']):,}, after {sum(requests['after']):,}"
    )
    say(
        f"per-round after/before: {', '.join(f'{r:.3f}' for r in ratios)} "
        f"(range {min(ratios):.3f}-{max(ratios):.3f}); user time only: median "
        f"{statistics.median(user_ratios):.3f}"
    )
    say(f"\nCPU per request after / before (median of per-round ratios): {ratio:.3f}")
    return {
        "cpu_per_request_ratio_after_over_before": round(ratio, 4),
        "user_cpu_per_request_ratio_after_over_before": round(statistics.median(user_ratios), 4),
        "cpu_ms_per_request_median": {n: round(statistics.median(ms[n]), 4) for n in GATEWAYS},
        "cpu_ms_per_request_pooled": {n: round(pooled[n], 4) for n in GATEWAYS},
        "requests_counted": {n: sum(requests[n]) for n in GATEWAYS},
        "round_ratios": [round(r, 4) for r in ratios],
        "round_user_ratios": [round(r, 4) for r in user_ratios],
        "round_first": [GATEWAYS[r % 2] for r in range(len(ratios))],
        **{f"round_{n}_cpu_ms_per_request": [round(x, 4) for x in ms[n]] for n in GATEWAYS},
        **{
            f"round_{n}_user_cpu_ms_per_request": [round(x, 4) for x in user_ms[n]]
            for n in GATEWAYS
        },
        **{f"round_{n}_requests": requests[n] for n in GATEWAYS},
        **{
            f"round_{n}_throughput_rps": [round(p.throughput, 1) for p in rounds[n]]
            for n in GATEWAYS
        },
    }


async def compare_main(
    args: argparse.Namespace, plan: Plan, info: dict[str, Any], started: float
) -> None:
    before_commit = git("rev-parse", "--verify", f"{args.compare_with}^{{commit}}")
    after_tree: Path = args.after_tree
    say(
        f"before: {args.compare_with} ({before_commit[:12]}, in a temporary git worktree); "
        f"after: {after_tree} ({tree_state(after_tree)}); backend: 16 tokens after "
        f"{args.ttft_ms:g} ms; sessions of {args.turns_per_session} turns, "
        f"max_inflight_per_replica {args.max_inflight_per_replica}, log level "
        f"{args.gateway_log_level or 'as shipped'}"
        + (", gc.freeze() after start" if args.gateway_gc_freeze else "")
    )
    with (
        tempfile.TemporaryDirectory(prefix="ts-gwcmp-", dir=args.store_dir) as tmp,
        worktree(before_commit, Path(tmp) / "before-tree") as before_tree,
    ):
        phases = await compare(args, plan, Path(tmp), {"before": before_tree, "after": after_tree})
    out = compare_report(phases)
    figures = {
        "cpu_per_request_ratio_after_over_before": out.pop(
            "cpu_per_request_ratio_after_over_before"
        ),
        "before_rev": args.compare_with,
        "before_commit": before_commit,
        "after_tree": str(after_tree),
        "after_state": tree_state(after_tree),
        "rounds": plan.rounds,
        "concurrency": args.levels[0],
        **out,
        "settings": {
            "ttft_ms": args.ttft_ms,
            "itl_ms": args.itl_ms,
            "completion_tokens": 16,
            "turns_per_session": args.turns_per_session,
            "max_inflight_per_replica": args.max_inflight_per_replica,
            "gateway_log_level": args.gateway_log_level or "as shipped",
            "warmup_s": plan.warmup_s,
            "measure_s": plan.measure_s,
            "gateway_gc_freeze": args.gateway_gc_freeze,
        },
    }
    finish(figures, quick=args.quick, duration_s=time.perf_counter() - started, info=info)


COMPARE_FULL = Plan(warmup_s=1.0, measure_s=2.0, rounds=10)
COMPARE_QUICK = Plan(warmup_s=0.5, measure_s=1.0, rounds=4)


async def compare_mode_main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The mode's checks and defaults (one concurrency level, 16; the fixed-latency backend;
    no profiler), then the paired rounds."""
    if args.profile_gateway and (args.rounds or 2) < 2:
        parser.error("--profile-gateway profiles odd rounds and needs at least 2")
    if args.profile_gateway:
        parser.error("--profile-gateway does not go with --compare-with")
    if args.backend_kind == "vllm-cpu":
        parser.error("--compare-with runs the fixed-latency backend only")
    if args.concurrency is None:
        args.concurrency = "16"
    levels = [int(c) for c in args.concurrency.split(",")]
    if len(levels) != 1:
        parser.error("--compare-with measures one concurrency level")
    args.levels = levels
    plan = plan_of(args, COMPARE_QUICK if args.quick else COMPARE_FULL)
    if args.max_inflight_per_replica is None:
        args.max_inflight_per_replica = max(levels)
    started = time.perf_counter()
    info = gateway_machine_info()
    banner("gateway CPU before/after", args.quick, info)
    await compare_main(args, plan, info, started)


if __name__ == "__main__":
    run_gateway_mode(__doc__, compare_mode_main, compare_with="HEAD")
