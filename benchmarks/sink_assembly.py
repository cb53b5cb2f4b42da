"""Benchmark: trainer-sink batch assembly, trajectories -> TensorDict, padded and jagged.

Run it from the repository root::

    .venv/bin/python benchmarks/sink_assembly.py           # 256 samples, 20 repeats
    .venv/bin/python benchmarks/sink_assembly.py --quick   # the same 256, 10 repeats

What it measures
----------------
256 synthetic ``TrajectoryReady`` samples, seeded, built the way the fold builds agent
sessions: a total length uniform in 1,000-16,000 tokens; a prompt (system + task) of 300-2,000
tokens, at most half the sample; then turns until the length is reached, each a completion of
100-300 generated tokens (loss_mask 1, float32 logprobs, weight_version 40-41) followed by a
tool result of 100-800 tokens (loss_mask 0, cut short before the end so that a completion ends
the sample). One
final reward per sample and a per-turn reward on every other turn; 4 samples per GRPO group.

``trainer_sink.assembly.assemble`` turns the whole list into one batch, ``layout="padded"``
(verl's keys, prompts left-padded to the batch's longest prompt P, responses right-padded to
its longest response R) and ``layout="jagged"`` (torch.nested jagged tensors).
tokens/s = real tokens in the batch (the sum of the samples' lengths, no padding) / time.
The padded batch also holds B x (P + R) padded positions per int64 tensor; its fill ratio is
reported. Single process; numpy's fills are single-threaded, so this is one core's rate.

The yardstick, in the same run: a plain copy of each layout's output bytes (the sum of its
tensors' bytes; a jagged tensor's values) with torch ``copy_`` into a preallocated tensor,
as tokens/s-equivalent (the batch's tokens / the copy's time). ``<layout>_ratio_to_copy`` =
copy time / assembly time; target ``padded_ratio_to_copy`` >= 0.5.
``<layout>_cpu_ratio_to_copy`` is the same in CPU time of the process (``time.process_time``,
all threads), which a shared machine's load moves less. Absolute rates move with the machine
(127 M -> 49 M tokens/s padded between two VMs of one kind); the ratio does not.
The padded batch is assembled as ``TrainerSink`` assembles it: into a ``BatchBuffers`` pool,
each timed batch dropped at once as a trainer drops the batch it trained on, so the next is
written into the same pages; ``padded_fresh_ratio_to_copy`` is the same batch into fresh
memory each time (``AssemblySettings.reuse_memory=False``), where the kernel maps and zeroes
every page first. Each layout and each copy runs once to warm up, then ``repeats`` rounds of
copy, padded, copy, jagged, padded into fresh memory, alternating so all see the same load;
medians (best alongside) are reported. ``--quick`` assembles the same 256 samples with fewer
repeats, so its rates and ratios are the full run's (on a 2-core VM shared with other work,
within ~20%).

Today's figures (2026-11-26, the quiet 2-core VM): padded 59 M tokens/s, 36 ms per [256,
17,057] batch against a copy of its 192 MiB in 22 ms: ``padded_ratio_to_copy`` 0.61 and 0.62
(quick 0.59); into fresh memory 59-62 ms, ``padded_fresh_ratio_to_copy`` 0.36-0.37 (before
the pool the padded figure was that one: 0.28-0.51 over four runs); jagged 46 M tokens/s, ratio
0.23-0.24. close -> batch p50 7-9 ms. See docs/PERFORMANCE.md (issue 16, section 6) for the
per-stage profile.

Then the latency of the live path (``pipeline_latency``): session close -> the batch holding
its trajectory yielded by a ``TrainerSink`` on the live TRAJ feed, with ``turnstream worker``
and ``turnstream shard-writer`` processes running (see that function's docstring).

Reading the output: progress lines, then the LAST line: one JSON object with
``padded_tokens_per_s``, ``jagged_tokens_per_s``, their ``_best`` values, the median ms per
batch, ``<layout>_output_bytes``, ``<layout>_copy_tokens_per_s``, ``<layout>_copy_ms_median``,
``padded_ratio_to_copy``, ``jagged_ratio_to_copy``, their ``_cpu_`` variants,
``padded_fresh_ms_median``, ``padded_fresh_ratio_to_copy``, the batch shape,
``close_to_batch_ms_p50`` / ``_p99``, ``target_padded_ratio_to_copy`` (0.5) and ``target_met``,
the machine and the date.
"""

from __future__ import annotations

import functools
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from harness.reporting import arguments, banner, finish, machine_info, say
from tensordict import TensorDict

from schemas.events import TrajectoryReady
from trainer_sink import AssemblySettings, BatchBuffers, assemble

VOCAB = 151_000
TARGET_PADDED_RATIO_TO_COPY = 0.5
GROUP_SIZE = 4
LAYOUTS = ("padded", "jagged")


@dataclass(frozen=True)
class Plan:
    """How much work the run does (``--quick`` shrinks it)."""

    samples: int
    repeats: int
    latency_sessions: int


# --quick: the same batch (so the same rates and ratios), fewer repeats and latency sessions.
FULL = Plan(samples=256, repeats=20, latency_sessions=300)
QUICK = Plan(samples=256, repeats=10, latency_sessions=50)


def trajectory(rng: np.random.Generator, index: int) -> TrajectoryReady:
    """One agent sample of 1k-16k tokens: prompt, then (completion, tool result) turns."""
    length = int(rng.integers(1_000, 16_001))
    prompt_len = min(int(rng.integers(300, 2_001)), length // 2)
    input_ids = rng.integers(0, VOCAB, length, dtype=np.int32)
    loss_mask = np.zeros(length, dtype=np.int8)
    logprobs = np.zeros(length, dtype=np.float32)
    versions = np.full(length, -1, dtype=np.int32)
    turn_ends: list[int] = []
    at = prompt_len
    while True:
        end = min(at + int(rng.integers(100, 301)), length)
        loss_mask[at:end] = 1
        logprobs[at:end] = -rng.exponential(0.4, end - at)
        versions[at:end] = 40 + len(turn_ends) // 8
        turn_ends.append(end)
        if end == length:
            break
        # A tool result, cut so that a last completion of at least one token ends the sample.
        at = min(end + int(rng.integers(100, 801)), length - 1)
    run, session = "bench", f"s{index:04d}"
    return TrajectoryReady(
        run=run,
        session=session,
        trajectory_id=f"{run}/{session}/0",
        group=f"g{index // GROUP_SIZE:04d}",
        segment=0,
        status="completed",
        input_ids=input_ids,
        loss_mask=loss_mask,
        logprobs=logprobs,
        versions=versions,
        prompt_len=prompt_len,
        turn_ends=np.asarray(turn_ends, dtype=np.int32),
        turn_rewards=[0.1 if t % 2 else None for t in range(len(turn_ends))],
        reward=float(rng.random()),
        num_turns=len(turn_ends),
        finish_reason="stop",
        messages=[],
        metadata={},
        fold_version=1,
    )


def output_bytes(batch: TensorDict) -> int:
    """The bytes of the batch's tensors (a jagged tensor's values), what assembly writes."""
    total = 0
    for value in batch.values():
        if isinstance(value, torch.Tensor):
            total += (value.values() if value.is_nested else value).nbytes
    return total


def assembly(samples: list[TrajectoryReady], repeats: int) -> dict[str, Any]:
    """Median and best tokens/s of both layouts over the same samples, and of a plain copy of
    each layout's output bytes, the phases alternating (copy, padded, copy, jagged) so that all
    four see the same load."""
    tokens = sum(len(t.input_ids) for t in samples)
    figures: dict[str, Any] = {"samples": len(samples), "tokens": tokens}
    runs: dict[str, Callable[[], object]] = {}
    batches: dict[str, TensorDict] = {}
    for layout in LAYOUTS:
        # padded: as the sink assembles, into the memory of the batches before (each timed
        # batch is dropped at once, as a trainer drops the batch it trained on)
        pool = BatchBuffers() if layout == "padded" else None
        run = functools.partial(assemble, samples, AssemblySettings(layout=layout), buffers=pool)
        batches[layout] = run()  # warm-up
        source = torch.ones(output_bytes(batches[layout]), dtype=torch.uint8)
        target = torch.empty_like(source)
        target.copy_(source)  # warm-up: the target's pages exist, as "preallocated" says
        runs[layout] = run
        runs[f"{layout}_copy"] = functools.partial(target.copy_, source)
    # and into fresh memory each time (AssemblySettings.reuse_memory=False)
    runs["padded_fresh"] = functools.partial(assemble, samples, AssemblySettings())
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    cpu: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            started, cpu_started = time.perf_counter(), time.process_time()
            run()
            seconds[name].append(time.perf_counter() - started)
            cpu[name].append(time.process_time() - cpu_started)
    for layout in LAYOUTS:
        median, best = statistics.median(seconds[layout]), min(seconds[layout])
        copy_median = statistics.median(seconds[f"{layout}_copy"])
        nbytes = output_bytes(batches[layout])
        figures[f"{layout}_tokens_per_s"] = round(tokens / median)
        figures[f"{layout}_tokens_per_s_best"] = round(tokens / best)
        figures[f"{layout}_ms_median"] = round(median * 1e3, 2)
        figures[f"{layout}_output_bytes"] = nbytes
        figures[f"{layout}_copy_tokens_per_s"] = round(tokens / copy_median)
        figures[f"{layout}_copy_ms_median"] = round(copy_median * 1e3, 2)
        figures[f"{layout}_ratio_to_copy"] = round(copy_median / median, 3)
        # CPU seconds (every thread of the process: torch copies on several): on a machine
        # shared with other work, wall time also counts the waits for a core.
        figures[f"{layout}_cpu_ratio_to_copy"] = round(
            statistics.median(cpu[f"{layout}_copy"]) / statistics.median(cpu[layout]), 3
        )
        line = (
            f"  {layout:<6} {tokens / median / 1e6:8.1f} M tokens/s median "
            f"({tokens / best / 1e6:.1f} best), {median * 1e3:.1f} ms per batch; a copy of its "
            f"{nbytes / 2**20:.0f} MiB {copy_median * 1e3:.1f} ms: "
            f"ratio {figures[f'{layout}_ratio_to_copy']:.2f}"
        )
        if layout == "padded":
            fresh = statistics.median(seconds["padded_fresh"])
            figures["padded_fresh_ms_median"] = round(fresh * 1e3, 2)
            figures["padded_fresh_ratio_to_copy"] = round(copy_median / fresh, 3)
            line += f" (fresh memory {fresh * 1e3:.1f} ms: ratio {copy_median / fresh:.2f})"
            batch = batches[layout]
            width = int(batch["input_ids"].shape[1])
            figures["padded_prompt_width"] = int(batch["prompts"].shape[1])
            figures["padded_response_width"] = int(batch["responses"].shape[1])
            figures["padded_fill_ratio"] = round(tokens / (len(samples) * width), 3)
            line += (
                f", [B, P+R] = [{len(samples)}, {width}], {figures['padded_fill_ratio']:.0%} real"
            )
        say(line)
    return figures


async def pipeline_latency(sessions: int, interval_s: float) -> dict[str, Any]:
    """Session close -> its batch yielded by a live TrainerSink, with a fold worker running.

    A nats-server, one ``turnstream worker`` process (reaper on) and one ``turnstream
    shard-writer`` (the whole pipeline); the sink in this process
    (LiveSource, count policy with batch_size 1, so no wait for batch mates is included). Opens
    and turns (4 turns x 1,000 tokens) are published first; then one close every
    ``interval_s``, and each close's ack time is compared with the moment the sink yields the
    batch holding its trajectory (commit included after the measurement).
    """
    import asyncio
    import os
    import signal
    import subprocess
    import tempfile
    from pathlib import Path

    from harness.pipeline_load import Plan, close_of, consumers_idle, make_session, wait_for

    from eventlog import JetStreamPublisher, LogSettings, connect, provision
    from eventlog.server import NatsServer
    from trainer_sink import BatchingSettings, LiveSource, LiveSourceSettings, TrainerSink

    plan = Plan(
        sessions=sessions, latency_sessions=0, turns=4, prompt_tokens=750, completion_tokens=250
    )
    rng = np.random.default_rng(3)
    corpus = "".join(rng.choice(np.array(list("abcdefghij ")), 200_000).tolist())
    with tempfile.TemporaryDirectory(prefix="ts-bench-sink-") as tmp:
        server = NatsServer(Path(tmp) / "nats").start()
        services: list[subprocess.Popen[bytes]] = []
        try:
            nc = await connect(server.url, LogSettings())
            js = nc.jetstream()
            await provision(js, LogSettings())
            pub = await JetStreamPublisher(nc).start()
            planned = [make_session(rng, corpus, i, plan) for i in range(sessions)]
            for events in planned:
                await pub.publish_many(events)
            services = [
                subprocess.Popen(  # noqa: ASYNC220 - started once, before timing
                    [
                        sys.executable,
                        "-m",
                        "turnstream.cli",
                        command,
                        "--log.url",
                        server.url,
                        "--data-dir",
                        tmp,
                    ],
                    env={**os.environ, "TURNSTREAM_LOG_LEVEL": "WARNING"},
                )
                for command in ("worker", "shard-writer")
            ]
            await wait_for(
                "the worker's consumers exist and the reaper caught up",
                lambda: consumers_idle(js, ["fold", "reaper"]),
                60,
            )
            source = LiveSource(js, pub, LiveSourceSettings(durable="bench"))
            sink = TrainerSink(source, BatchingSettings(batch_size=1), wait_s=0.05)
            yielded: dict[str, float] = {}

            async def train() -> None:
                async for batch in sink:
                    now = time.time()
                    for tid in batch.trajectory_ids:
                        yielded[tid] = now
                    await sink.commit(batch)
                    if len(yielded) >= sessions:
                        return

            trainer = asyncio.create_task(train())
            closed: dict[str, float] = {}
            for events in planned:
                await pub.publish(close_of(events, plan))
                closed[f"bench/{events[0].session}/0"] = time.time()
                await asyncio.sleep(interval_s)
            await asyncio.wait_for(trainer, timeout=120)
            await sink.close()
            await pub.close()
            await nc.close()
        finally:
            for service in services:
                service.send_signal(signal.SIGTERM)
            for service in services:
                service.wait(timeout=60)
            server.stop()
    latencies = np.array([(yielded[tid] - at) * 1000 for tid, at in closed.items()])
    p50, p99 = float(np.percentile(latencies, 50)), float(np.percentile(latencies, 99))
    say(
        f"close -> batch: p50 {p50:.1f} ms, p99 {p99:.1f} ms over {sessions} sessions "
        f"(one close every {interval_s * 1000:.0f} ms, batch_size 1)"
    )
    return {
        "close_to_batch_ms_p50": round(p50, 1),
        "close_to_batch_ms_p99": round(p99, 1),
        "latency_sessions": sessions,
    }


def main() -> int:
    parser = arguments(
        __doc__, "the same batch, 10 repeats, 50 latency sessions", seed="synthetic samples' seed"
    )
    args = parser.parse_args()
    plan = QUICK if args.quick else FULL
    started = time.perf_counter()
    info = machine_info("numpy", "torch", "tensordict")
    banner(
        "sink assembly", args.quick, info, f"torch {info['torch']}, tensordict {info['tensordict']}"
    )
    rng = np.random.default_rng(args.seed)
    samples = [trajectory(rng, i) for i in range(plan.samples)]
    say(
        f"{len(samples)} samples, {sum(len(t.input_ids) for t in samples):,} tokens, "
        f"{plan.repeats} repeats per layout"
    )
    figures = assembly(samples, plan.repeats)
    import asyncio

    figures.update(asyncio.run(pipeline_latency(plan.latency_sessions, 0.02)))
    figures["target_padded_ratio_to_copy"] = TARGET_PADDED_RATIO_TO_COPY
    figures["target_met"] = figures["padded_ratio_to_copy"] >= TARGET_PADDED_RATIO_TO_COPY
    if not figures["target_met"]:
        say(f"target not met: padded {figures['padded_ratio_to_copy']} of a copy < 0.5")
    finish(figures, quick=args.quick, duration_s=time.perf_counter() - started, info=info)
    return 0


if __name__ == "__main__":
    sys.exit(main())
