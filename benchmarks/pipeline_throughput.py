"""Benchmark: closed sessions -> fold workers -> TRAJ -> shard writer -> Parquet, against raw reads.

Run it from the repository root (nats-server on PATH, or in the venv's bin)::

    .venv/bin/python benchmarks/pipeline_throughput.py           # 2,000 sessions x 10 turns
    .venv/bin/python benchmarks/pipeline_throughput.py --quick   # 1,000 sessions, ~15 s

What it measures
----------------
Sessions of 10 turns, each turn adding 2,000 new tokens (a 1,500-token tool result or task and
a 500-token completion, with ~4 characters of message text per token), published as real
events to a nats-server started here (file store). Then, in one run:

1. **raw**: one pull consumer reads every message of EVENTS (batches of 512, no decoding, no
   acks): the rate at which this machine can move those bytes out of JetStream into Python.
2. **rehydrate**: reading sessions back three ways (the fold worker's batched direct get, one
   direct get per event, an ordered consumer per session), in sessions/s.
3. **throughput**: ``--workers`` ``turnstream worker`` processes and one ``turnstream
   shard-writer`` run against the stream; once they are idle (the reapers have tracked the
   pre-published events), every close is published in one burst, and the clock stops when the
   shards hold every trajectory. tokens/s = tokens in the trajectories / that time.
   ``ratio_to_raw`` = that rate / the raw rate (the mean of the raw read just before and just
   after this phase: a machine whose load changes meanwhile skews the ratio less). Over the
   phase, the CPU of each stage (``/proc/<pid>/stat``: the worker process(es), the shard
   writer, nats-server, and this script) per 1k tokens: ``worker_cpu_us_per_1k_tokens``,
   ``writer_cpu_us_per_1k_tokens``, ``nats_cpu_us_per_1k_tokens`` (and the raw read's own,
   ``raw_cpu_us_per_1k_tokens``); CPU does not depend on what else the machine runs the way
   wall time does.
4. **latency**: more sessions, their closes published at half the measured session rate; for
   each, close ack -> its TrajectoryReady stored in TRAJ (server timestamp), and close ack ->
   its shard committed (the shard file's modification time; the writer rotates every
   ``--shard-age`` seconds, which bounds this latency from below).

5. **stages apart** (a second pass, on a fresh server with fresh sessions): each stage with the
   machine to itself: the fold with the shard writer stopped (SIGSTOP) until TRAJ holds every
   trajectory, then the shard writer (SIGCONT) until the shards do. ``fold_stage_ratio_to_raw``
   and ``write_stage_ratio_to_raw`` (and each process's CPU per 1k tokens and busy cores in
   each), and ``stages_apart_ratio_to_raw``, the slower of the two: about what the pipeline
   reaches where each stage has a core of its own.
Both passes run by default (issue 40: the pipeline's limit stated beside each stage's);
``--stages-apart`` runs the second alone, ``--pipeline-only`` the first.

The LAST line is one JSON object: ``tokens_per_s`` (per worker), ``ratio_to_raw``, the CPU per
stage, ``traj_bytes_per_token`` (TRAJ stream bytes / tokens), ``close_to_shard_ms_p50/p99``,
``close_to_traj_ms_p50/p99``, the rehydrate rates, the machine. ``--quick`` reports the same
keys at 1,000 sessions (the full run: 2,000, ~50 s in all). The clock stops when the last
shard is committed, and the writer commits it only at its rotation age (1 s here), so each run
ends with up to a second that is no work: at 120 sessions that tail was a large share of a
~2.4 s phase (quick 0.075), at 500 still ~20% of ~2.5 s, with the shard writer's first shards
faulting in fresh memory on top (quick 0.09-0.165 against full 0.158-0.185, 2026-11-28); at
1,000 sessions (a ~4-5 s phase) quick reads 0.155 and 0.159 against full 0.168 and 0.166,
alternating minutes apart.

Today's figures on 16 cores (2026-11-28 17:40, the device machine, a 16-core Xeon, raw read
33-46 M tokens/s): full runs ``ratio_to_raw`` 0.239, 0.194, 0.187, 0.186 (8.0-8.6 M tokens/s;
worker 87-98, shard writer 96-117, nats-server 97-106 us per 1k tokens, ~2.5 cores busy);
``--workers 2`` 0.229, 0.221; ``--stages-apart`` the fold 0.272 and 0.236 (the worker 0.97 of a
core), the shard writer 0.292 and 0.264 (1.04 cores): each stage is one Python process at one
core, so more cores do not lift the pipeline past its slower stage (docs/PERFORMANCE.md, issue
16, section 1, "16 cores").

On 2 cores (2026-11-28 15:30, the quiet 2-core VM, nothing else running; raw read 34-37 M
tokens/s; the worker folding 32 sessions at once, ``fold.concurrency``'s default since that round):
full runs ``ratio_to_raw`` 0.187 and 0.190 (6.4 and 6.9 M tokens/s), against 0.159 and 0.173 with
``TURNSTREAM_FOLD__CONCURRENCY=8`` alternating; worker 81-87, shard writer 90-107, nats-server
74-81 us per 1k tokens (245-275 in all), ~1.7 of the 2 cores busy; quick 0.151 and 0.166
(docs/PERFORMANCE.md, issue 16, section 1, tenth round). Earlier that day, with 8 sessions at once
(raw read 25-31 M tokens/s): full runs 0.158, 0.185, 0.171, 0.168, 0.166, 0.156; worker 116-142,
shard writer 104-152, nats-server 114-154 us per 1k tokens (334-448 in all) against 46-56 for the
raw read: CPU-bound on 2 cores (seventh round). Earlier (2026-11-26, the quiet 2-core VM, nothing
else running; its speed moved 3x between runs, the raw read 6.9-20.4 M tokens/s): full runs
``ratio_to_raw`` 0.128, 0.236, 0.176 and 0.172 (the last two minutes apart agree, as do their CPU
ratios), ``--quick`` 0.161. CPU per 1k tokens over the phase: worker 196-322 us, shard writer
145-211 us, nats-server 140-205 us (480-740 us in all) against 58-97 us for the raw read itself:
the pipeline is CPU-bound at ~0.13-0.2 of raw on 2 cores. TRAJ carries 9.06 bytes per token (17.05
before the compact TrajectoryReady). Runs on a VM loaded by other jobs (2026-11-25, load 11-15)
gave 0.103-0.119 (docs/PERFORMANCE.md, issue 16, section 1). Later the same day, with the session
read-back taking its answers in a callback (rehydrate 330-349 -> 457-513 sessions/s, paired):
0.193, 0.175, 0.204 (before it, in the same alternation: 0.192, 0.212); worker 262-278, writer
207-218, nats-server 194-207 us per 1k tokens. On a faster VM (raw read 28-34 M tokens/s, its own
CPU 38-47 us per 1k tokens), with the consumers on uvloop: 0.174, 0.164, 0.158; worker 87-96,
writer 107-120, nats-server 113-122 us per 1k tokens (330-400 in all): CPU-bound, 1.7 of the 2
cores busy over the phase (docs/PERFORMANCE.md, issue 16, section 1, sixth round).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
from harness.pipeline_load import Plan, close_of, consumers_idle, make_session, tokens_of, wait_for
from harness.processes import RUN
from harness.reporting import finish, machine_info, say
from nats.js import JetStreamContext
from nats.js import api as js_api

from eventlog import (
    JetStreamPublisher,
    LogSettings,
    PublisherSettings,
    connect,
    provision,
    read_session_messages,
)
from eventlog.server import NatsServer
from schemas.events import SessionClosed, SessionEvent

TARGET_RATIO = 0.25  # issue 16 (0.5 before: out of reach on 2 cores)


FULL = Plan(sessions=2_000, latency_sessions=300)
QUICK = Plan(sessions=1_000, latency_sessions=40)


_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int, kinds: tuple[int, ...] = (11, 12)) -> float:
    """User + system CPU of process ``pid`` so far (``/proc/<pid>/stat``: utime, stime)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return sum(int(fields[k]) for k in kinds) / _TICKS_PER_S


def cpu_of(pids: dict[str, list[int]], kinds: tuple[int, ...] = (11, 12)) -> dict[str, float]:
    """CPU seconds so far per stage (summed over the stage's processes)."""
    return {stage: sum(cpu_seconds(p, kinds) for p in ps) for stage, ps in pids.items()}


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


# -- phases ---------------------------------------------------------------------------------


async def publish_sessions(js_pub: JetStreamPublisher, sessions: list[list[SessionEvent]]) -> None:
    for start in range(0, len(sessions), 50):
        await js_pub.publish_many([e for s in sessions[start : start + 50] for e in s])


async def raw_read(js: JetStreamContext) -> tuple[float, int, int]:
    """Seconds to pull every EVENTS message once, the messages and the bytes."""
    info = await js.stream_info("EVENTS")
    total = info.state.messages
    await js.add_consumer(
        "EVENTS",
        js_api.ConsumerConfig(
            durable_name="bench-raw",
            ack_policy=js_api.AckPolicy.NONE,
            deliver_policy=js_api.DeliverPolicy.ALL,
            max_ack_pending=-1,
        ),
    )
    sub = await js.pull_subscribe_bind("bench-raw", stream="EVENTS")
    got = size = 0
    start = time.perf_counter()
    while got < total:
        for msg in await sub.fetch(512, timeout=5.0):
            got += 1
            size += len(msg.data)
    elapsed = time.perf_counter() - start
    await sub.unsubscribe()
    await js.delete_consumer("EVENTS", "bench-raw")
    return elapsed, got, size


async def rehydrate_rates(js: JetStreamContext, sessions: list[str]) -> dict[str, float]:
    """Sessions/s read back by batched direct get, per-event direct get, ordered consumer."""

    async def batched(session: str) -> int:
        return len(await read_session_messages(js, RUN, session))

    async def per_event(session: str) -> int:
        seq, n = 1, 0
        while True:
            try:
                msg = await js.get_msg(
                    "EVENTS", seq=seq, subject=f"ts.ev.{RUN}.{session}.*", next=True, direct=True
                )
            except Exception:
                return n
            n += 1
            assert msg.seq is not None
            seq = msg.seq + 1

    async def ordered(session: str) -> int:
        sub = await js.subscribe(f"ts.ev.{RUN}.{session}.*", ordered_consumer=True)
        n = 0
        try:
            while True:
                msg = await sub.next_msg(timeout=5.0)
                n += 1
                if msg.metadata.num_pending == 0:
                    return n
        finally:
            await sub.unsubscribe()

    rates = {}
    for name, read in (
        ("batched_direct_get", batched),
        ("direct_get_per_event", per_event),
        ("ordered_consumer", ordered),
    ):
        start = time.perf_counter()
        counts = [await read(s) for s in sessions]
        elapsed = time.perf_counter() - start
        assert len(set(counts)) == 1 and counts[0] > 0, f"{name} read {set(counts)} events"
        rates[name] = len(sessions) / elapsed
        say(f"  rehydrate {name:<22} {rates[name]:8.0f} sessions/s ({counts[0]} events each)")
    return rates


def shard_rows(root: Path) -> dict[str, float]:
    """trajectory_id -> commit time (the shard file's mtime) of every committed shard."""
    found: dict[str, float] = {}
    for path in root.glob("run=*/*.parquet"):
        if path.name.startswith((".", "_")):
            continue
        mtime = path.stat().st_mtime
        for tid in pq.read_table(path, columns=["trajectory_id"]).column(0).to_pylist():
            found[tid] = mtime
    return found


_ROWS: dict[Path, int] = {}  # committed shards are never changed: each footer is read once


def count_rows(root: Path) -> int:
    for p in root.glob("run=*/*.parquet"):
        if not p.name.startswith((".", "_")) and p not in _ROWS:
            _ROWS[p] = pq.read_metadata(p).num_rows
    return sum(n for p, n in _ROWS.items() if p.is_relative_to(root))


async def until_in_shards(
    what: str, root: Path, rows: int, poll_s: float, timeout_s: float = 1800
) -> None:
    """Wait until the committed shards under ``root`` hold ``rows`` trajectories."""

    async def held() -> bool:
        return count_rows(root) >= rows

    await wait_for(what, held, timeout_s, poll_s)


async def raw_again(js: JetStreamContext, first: float, tokens: int) -> tuple[float, float]:
    """The raw read again, right after a phase: the rates (tokens/s) before and after it. A
    ratio takes their mean, so a machine whose load changes meanwhile skews it less."""
    raw2_s, _, _ = await raw_read(js)
    rates = (first, tokens / raw2_s)
    say(f"raw again: {rates[1] / 1e6:.2f} M tokens/s; mean of the two {sum(rates) / 2e6:.2f}")
    return rates


def start_services(
    url: str, data_dir: Path, workers: int, shard_age: float
) -> list[subprocess.Popen[bytes]]:
    exe = [sys.executable, "-m", "turnstream.cli"]
    common = ["--log.url", url, "--data-dir", str(data_dir)]
    env = {**os.environ, "TURNSTREAM_LOG_LEVEL": "WARNING"}
    procs = [subprocess.Popen([*exe, "worker", *common], env=env) for _ in range(workers)]
    procs.append(
        subprocess.Popen(
            [*exe, "shard-writer", *common, "--shards.max-age-s", str(shard_age)], env=env
        )
    )
    return procs


def stop_services(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()


async def stages_apart(
    js: JetStreamContext,
    pub: JetStreamPublisher,
    stages: dict[str, list[int]],
    writer: subprocess.Popen[bytes],
    closes: list[SessionClosed],
    plan: Plan,
    shard_root: Path,
) -> dict[str, dict[str, float]]:
    """Each stage with the machine to itself: the fold with the shard writer stopped
    (SIGSTOP), then the shard writer (SIGCONT) on the whole TRAJ. Per stage: its seconds, and
    each process's CPU over it. A machine with a core for each stage would run the pipeline at
    about the slower stage's rate, if nats-server keeps up with both at once."""
    phases: dict[str, dict[str, float]] = {}
    before = cpu_of(stages)
    writer.send_signal(signal.SIGSTOP)
    try:
        start = time.perf_counter()
        await pub.publish_many(closes)

        async def all_in_traj() -> bool:
            return (await js.stream_info("TRAJ")).state.messages >= plan.sessions

        await wait_for("every trajectory in TRAJ", all_in_traj, 1800, 0.05)
        phases["fold"] = {"seconds": time.perf_counter() - start}
    finally:
        writer.send_signal(signal.SIGCONT)
    middle = cpu_of(stages)
    start = time.perf_counter()
    await until_in_shards("every trajectory in a shard", shard_root, plan.sessions, 0.05)
    phases["write"] = {"seconds": time.perf_counter() - start}
    after = cpu_of(stages)
    for phase, (a, b) in {"fold": (before, middle), "write": (middle, after)}.items():
        phases[phase] |= {f"{stage}_cpu_s": b[stage] - a[stage] for stage in stages}
    return phases


def apart_figures(
    phases: dict[str, dict[str, float]], plan: Plan, raw_rates: tuple[float, float]
) -> dict[str, object]:
    """The stages-apart run's lines and figures: each stage's rate and ratio to raw, the
    slower one's (what a core per stage would give), and each process's CPU per 1k tokens and
    busy cores in each phase."""
    total = plan.sessions * tokens_of(plan)
    raw = sum(raw_rates) / 2
    figures: dict[str, object] = {}
    ratios: dict[str, float] = {}
    for phase, got in phases.items():
        rate = total / got["seconds"]
        ratios[phase] = rate / raw
        figures[f"{phase}_stage_tokens_per_s"] = round(rate)
        figures[f"{phase}_stage_ratio_to_raw"] = round(rate / raw, 3)
        cpu = {k.removesuffix("_cpu_s"): v for k, v in got.items() if k.endswith("_cpu_s")}
        for stage, seconds in cpu.items():
            figures[f"{phase}_stage_{stage}_cpu_us_per_1k_tokens"] = round(
                seconds * 1e6 / (total / 1000), 1
            )
            figures[f"{phase}_stage_{stage}_busy_cores"] = round(seconds / got["seconds"], 2)
        say(
            f"  {phase} alone: {got['seconds']:.1f} s, {rate / 1e6:.2f} M tokens/s, "
            f"{rate / raw:.3f} of raw; busy cores "
            + ", ".join(f"{stage} {seconds / got['seconds']:.2f}" for stage, seconds in cpu.items())
        )
    slower = round(min(ratios.values()), 3)
    say(f"  the slower stage: {slower:.3f} of raw (a core per stage, nats-server keeping up)")
    return {
        **figures,
        "stages_apart_ratio_to_raw": slower,
        "raw_tokens_per_s": round(raw),
        "raw_tokens_per_s_before_after": [round(r) for r in raw_rates],
        "target_ratio": TARGET_RATIO,
        "sessions": plan.sessions,
        "turns": plan.turns,
    }


async def main(quick: bool, workers: int, shard_age: float, passes: tuple[str, ...]) -> None:
    """The pipeline pass (throughput and latency), then the stages-apart pass on a fresh
    server and fresh sessions: one JSON line holding both's figures (issue 40 point 4: the
    pipeline's limit is stated beside what each stage reaches alone, in every default run)."""
    plan = QUICK if quick else FULL
    began = time.perf_counter()
    info = machine_info("nats-py", "msgspec", "numpy", "pyarrow")
    rng = np.random.default_rng(7)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz "))
    corpus = "".join(rng.choice(letters, 400_000).tolist())
    figures: dict[str, object] = {}
    for kind in passes:
        got = await one_pass(plan, rng, corpus, workers, shard_age, apart=kind == "apart")
        if figures:  # the pipeline's raw read and shape stay the headline; the second pass's apart
            got["stages_apart_raw_tokens_per_s"] = got.pop("raw_tokens_per_s")
            got["stages_apart_raw_tokens_per_s_before_after"] = got.pop(
                "raw_tokens_per_s_before_after"
            )
        figures = got | figures
    figures["passes"] = list(passes)
    finish(figures, quick=quick, duration_s=time.perf_counter() - began, info=info)


async def one_pass(
    plan: Plan, rng: np.random.Generator, corpus: str, workers: int, shard_age: float, apart: bool
) -> dict[str, object]:
    """One server, sessions published, the raw read, then the pipeline (``apart`` False) or
    each stage alone: that pass's figures."""
    say(
        f"\n{'stages apart' if apart else 'pipeline throughput'}: {plan.sessions} sessions x "
        f"{plan.turns} turns x {plan.prompt_tokens + plan.completion_tokens} new tokens, "
        f"{workers} worker(s)"
    )
    with tempfile.TemporaryDirectory(prefix="ts-bench-pipeline-") as tmp:
        tmp_path = Path(tmp)
        server = NatsServer(tmp_path / "nats", max_payload=8 * 1024 * 1024).start()
        procs: list[subprocess.Popen[bytes]] = []
        try:
            settings = LogSettings()
            nc = await connect(server.url, settings)
            js = nc.jetstream()
            await provision(js, settings)
            pub = await JetStreamPublisher(
                nc, PublisherSettings(max_inflight_bytes=64 << 20)
            ).start()

            say("publishing sessions (opens + turns) ...")
            sessions = [make_session(rng, corpus, i, plan) for i in range(plan.sessions)]
            t = time.perf_counter()
            await publish_sessions(pub, sessions)
            say(f"  {plan.sessions * (plan.turns + 1):,} events in {time.perf_counter() - t:.1f} s")

            raw_stages = {"nats": [server.pid], "bench": [os.getpid()]} if server.pid else {}
            raw_cpu = cpu_of(raw_stages)
            raw_s, raw_msgs, raw_bytes = await raw_read(js)
            raw_tokens_per_s = plan.sessions * tokens_of(plan) / raw_s
            raw_cpu_us = sum(cpu_of(raw_stages).values()) - sum(raw_cpu.values())
            raw_cpu_us *= 1e6 / (plan.sessions * tokens_of(plan) / 1000)
            say(
                f"raw: {raw_msgs:,} messages, {raw_bytes / 1e6:,.0f} MB in {raw_s:.2f} s: "
                f"{raw_bytes / raw_s / 1e6:,.0f} MB/s, {raw_tokens_per_s / 1e6:.2f} M tokens/s"
            )

            rates = await rehydrate_rates(
                js, [s[0].session for s in sessions[: min(100, plan.sessions)]]
            )

            procs = start_services(server.url, tmp_path / "data", workers, shard_age)
            say(f"  services: {', '.join(f'{p.args[3]} pid {p.pid}' for p in procs)}")
            names = ["fold", "reaper"]
            await wait_for(
                "workers ready and reapers caught up", lambda: consumers_idle(js, names), 600, 0.5
            )
            shard_root = tmp_path / "data" / "shards"

            say("throughput: publishing every close ...")
            closes = [close_of(s, plan) for s in sessions]
            assert server.pid is not None
            stages = {
                "worker": [p.pid for p in procs[:-1]],
                "writer": [procs[-1].pid],
                "nats": [server.pid],
                "bench": [os.getpid()],
            }
            if apart:
                del stages["bench"]
                phases = await stages_apart(js, pub, stages, procs[-1], closes, plan, shard_root)
                total = plan.sessions * tokens_of(plan)
                raw_rates = await raw_again(js, raw_tokens_per_s, total)
                figures = apart_figures(phases, plan, raw_rates)
                await pub.close()
                await nc.close()
                figures |= {"workers": workers, "shard_age_s": shard_age}
                figures |= {f"rehydrate_{k}_sessions_per_s": round(v, 1) for k, v in rates.items()}
                return figures
            cpu_before, sys_before = cpu_of(stages), cpu_of(stages, (12,))
            start = time.perf_counter()
            await pub.publish_many(closes)
            await until_in_shards("every trajectory in a shard", shard_root, plan.sessions, 0.1)
            elapsed = time.perf_counter() - start
            cpu_after, sys_after = cpu_of(stages), cpu_of(stages, (12,))
            # How much of each stage's CPU is the kernel's (socket copies, loopback TCP, disk).
            sys_share = {
                stage: (sys_after[stage] - sys_before[stage])
                / max(cpu_after[stage] - cpu_before[stage], 1e-9)
                for stage in stages
            }
            total_tokens = plan.sessions * tokens_of(plan)
            tokens_per_s = total_tokens / elapsed
            # CPU per 1k tokens of each stage over the throughput phase (summed over processes).
            cpu_us = {
                stage: (cpu_after[stage] - cpu_before[stage]) * 1e6 / (total_tokens / 1000)
                for stage in stages
            }
            traj_bytes = (await js.stream_info("TRAJ")).state.bytes
            raw_rates = await raw_again(js, raw_tokens_per_s, total_tokens)
            raw_tokens_per_s = sum(raw_rates) / 2
            say(
                f"  {plan.sessions} sessions, {total_tokens / 1e6:.1f} M tokens in "
                f"{elapsed:.1f} s: {tokens_per_s / 1e6:.2f} M tokens/s "
                f"({tokens_per_s / workers / 1e6:.2f} per worker), "
                f"{tokens_per_s / raw_tokens_per_s:.3f} of raw; TRAJ "
                f"{traj_bytes / total_tokens:.1f} bytes/token"
            )
            say(
                "  CPU per 1k tokens: "
                + ", ".join(f"{stage} {us:.0f} us" for stage, us in cpu_us.items())
                + f"; CPU busy {sum(cpu_after.values()) - sum(cpu_before.values()):.1f} s of "
                f"{elapsed:.1f} s x {os.cpu_count()} cores"
            )

            say(f"latency: {plan.latency_sessions} sessions, closes at half the measured rate ...")
            later = [
                make_session(rng, corpus, plan.sessions + i, plan)
                for i in range(plan.latency_sessions)
            ]
            await publish_sessions(pub, later)
            await wait_for("reapers caught up", lambda: consumers_idle(js, names), 600, 0.2)
            interval = 2.0 * elapsed / plan.sessions
            close_at: dict[str, float] = {}
            for events in later:
                await pub.publish(close_of(events, plan))
                close_at[f"{RUN}/{events[0].session}/0"] = time.time()
                await asyncio.sleep(interval)
            await until_in_shards(
                "latency sessions in shards",
                shard_root,
                plan.sessions + plan.latency_sessions,
                0.2,
                timeout_s=600,
            )
            committed = shard_rows(shard_root)
            to_shard = [(committed[tid] - at) * 1000 for tid, at in close_at.items()]
            to_traj = []
            traj_info = await js.stream_info("TRAJ")
            for seq in range(traj_info.state.first_seq, traj_info.state.last_seq + 1):
                msg = await js.get_msg("TRAJ", seq=seq, direct=True)
                stamp = (msg.headers or {}).get("Nats-Time-Stamp")
                tid = (msg.headers or {}).get("Nats-Msg-Id")
                if tid in close_at and stamp:
                    to_traj.append((_parse_time(stamp) - close_at[tid]) * 1000)
            say(f"  close -> TRAJ  p50 {pct(to_traj, 50):7.1f} ms  p99 {pct(to_traj, 99):7.1f} ms")
            say(
                f"  close -> shard p50 {pct(to_shard, 50):7.1f} ms  "
                f"p99 {pct(to_shard, 99):7.1f} ms (shards rotate every {shard_age:g} s)"
            )
            await pub.close()
            await nc.close()
        finally:
            stop_services(procs)
            server.stop()

    return {
        "tokens_per_s": round(tokens_per_s / workers),
        "tokens_per_s_total": round(tokens_per_s),
        "raw_tokens_per_s": round(raw_tokens_per_s),
        "raw_tokens_per_s_before_after": [round(r) for r in raw_rates],
        "ratio_to_raw": round(tokens_per_s / raw_tokens_per_s, 3),
        "target_ratio": TARGET_RATIO,
        "worker_cpu_us_per_1k_tokens": round(cpu_us["worker"], 1),
        "writer_cpu_us_per_1k_tokens": round(cpu_us["writer"], 1),
        "nats_cpu_us_per_1k_tokens": round(cpu_us["nats"], 1),
        "bench_cpu_us_per_1k_tokens": round(cpu_us["bench"], 1),
        "raw_cpu_us_per_1k_tokens": round(raw_cpu_us, 1),
        "pipeline_cpu_us_per_1k_tokens": round(
            cpu_us["worker"] + cpu_us["writer"] + cpu_us["nats"], 1
        ),
        "traj_bytes_per_token": round(traj_bytes / total_tokens, 2),
        "cpu_system_share": {k: round(v, 2) for k, v in sys_share.items()},
        "throughput_s": round(elapsed, 2),
        "close_to_shard_ms_p50": round(pct(to_shard, 50), 1),
        "close_to_shard_ms_p99": round(pct(to_shard, 99), 1),
        "close_to_traj_ms_p50": round(pct(to_traj, 50), 1),
        "close_to_traj_ms_p99": round(pct(to_traj, 99), 1),
        "shard_age_s": shard_age,
        "workers": workers,
        "sessions": plan.sessions,
        "turns": plan.turns,
        "raw_mb_per_s": round(raw_bytes / raw_s / 1e6, 1),
        **{f"rehydrate_{k}_sessions_per_s": round(v, 1) for k, v in rates.items()},
    }


def _parse_time(stamp: str) -> float:
    """RFC 3339 with nanoseconds (as nats-server writes it) to epoch seconds."""
    import datetime as dt

    head, _, frac = stamp.rstrip("Z").partition(".")
    base = dt.datetime.fromisoformat(head).replace(tzinfo=dt.UTC).timestamp()
    return base + (float(f"0.{frac}") if frac else 0.0)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a small run, ~30 s")
    parser.add_argument("--workers", type=int, default=1, help="fold worker processes")
    parser.add_argument("--shard-age", type=float, default=1.0, help="shard rotation age, seconds")
    only = parser.add_mutually_exclusive_group()
    only.add_argument(
        "--stages-apart",
        action="store_true",
        help="only the second pass: the fold alone (the shard writer stopped), then the "
        "shard writer alone on the whole TRAJ: each stage's rate with the machine to itself",
    )
    only.add_argument(
        "--pipeline-only", action="store_true", help="only the first pass: the whole pipeline"
    )
    args = parser.parse_args()
    passes = ("apart",) if args.stages_apart else ("pipeline",) if args.pipeline_only else None
    asyncio.run(main(args.quick, args.workers, args.shard_age, passes or ("pipeline", "apart")))
