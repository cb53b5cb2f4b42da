"""Benchmark: how the fold's time and memory grow with a session's turns (issue 16, point 1).

Run it from the repository root::

    .venv/bin/python benchmarks/fold_scaling.py           # 25/50/100/200 turns, 15 repeats
    .venv/bin/python benchmarks/fold_scaling.py --quick   # the same sessions, 5 repeats
    .venv/bin/python benchmarks/fold_scaling.py --before /tmp/fold-before  # and an old tree's

What it measures
----------------
One synthetic agent session per size, seeded, of 25, 50, 100 and 200 turns; the 200-turn one
holds 128k tokens (a 1,000-token system prompt and task, then per turn 160 generated tokens
and a tool result of 475 tokens), the others are its first 25, 50 and 100 turns, so tokens
grow with turns. Real events (``SessionOpened``, ``TurnCompleted`` delta-encoded against the
previous turn as the gateway publishes them, with the tool result as a new message of ~4
characters per token, ``SessionClosed``), each turn delivered twice (a redelivery), in a
shuffled order: the fold worker's input.

Per size, ``consumers.fold.fold(events)`` (accumulate with ``apply``, then ``finish``: one
trajectory) is timed ``repeats`` times after a warm-up, the sizes taking turns (a change of
load on a shared machine hits them all), in CPU time of the thread (``time.thread_time``: on a
shared machine wall time also counts the waits for a core); the median and the best are
reported, the ``apply`` loop's median and the wall-clock median (``fold_wall_ms_<n>``) beside
them. Peak memory: ``tracemalloc``'s peak over one fold,
counted from the start of the fold (the events themselves are not counted; numpy reports its
buffers to tracemalloc). ``time_ratio_200_over_100`` = time(200 turns) / time(100 turns), from
the best times (a shared machine's load only adds time): ~2 when the fold is linear in the
session, ~4 when quadratic; likewise ``apply_ratio_200_over_100`` (medians of the ``apply``
loop) and ``peak_ratio_200_over_100``.

``--before DIR`` folds the same sessions with the ``consumers`` package of another checkout
(``git worktree add /tmp/fold-before HEAD``), each phase in its own child process, the phases
alternating (after, before, after, before, ...) so both see the same load; the ``before_``
keys and ``speedup_200`` (before time / after time at 200 turns) are added.

Reading the output: a table per phase, then the LAST line: one JSON object with
``fold_ms_<n>``, ``fold_ms_best_<n>``, ``fold_wall_ms_<n>``, ``apply_ms_<n>``, ``peak_mib_<n>``
for n = 25, 50, 100, 200, the three ratios,
the machine and the date.

Today's figures (2026-11-25, the 2-core VM at load ~10 from other work, full run, 3 rounds):
fold CPU time (best) 0.93 / 1.30 / 3.25 / 6.25 ms at 25 / 50 / 100 / 200 turns, ratio 200/100
2.08 (HEAD before the change: 10.0 ms at 200 turns, ratio 2.57); ``apply`` loop 1.56 ms at 200
turns (3.71 before); peak 1.72 MiB at 200 turns, ratio 2.00 (2.34 MiB, 2.32 before). The quick
run: ratios 2.23 (before 2.31), 1.77, 2.00. Wall-clock medians were 3-7x the CPU times.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
import tracemalloc
from dataclasses import dataclass
from functools import reduce
from pathlib import Path
from typing import Any

import numpy as np
from harness.reporting import arguments, banner, finish, machine_info, say

from schemas.events import SessionClosed, SessionEvent, SessionOpened, TurnCompleted

SIZES = (25, 50, 100, 200)
SYSTEM_TOKENS = 1_000
COMPLETION_TOKENS = 160
TOOL_TOKENS = 475  # 200 turns: 1,000 + 200 x (160 + 475) = 128,000 tokens
CHARS_PER_TOKEN = 4
VOCAB = 151_000


@dataclass(frozen=True)
class Plan:
    """How much work the run does (``--quick`` only repeats less: same sessions, same ratios)."""

    repeats: int
    rounds: int  # alternating phases with --before


FULL = Plan(repeats=15, rounds=3)
QUICK = Plan(repeats=5, rounds=1)


def session_events(turns: int, seed: int) -> list[SessionEvent]:
    """Open, ``turns`` delta-encoded turns (each twice), close; shuffled with ``seed``."""
    rng = np.random.default_rng(seed)
    run, session = "bench", "s0"
    events: list[SessionEvent] = [SessionOpened(run=run, session=session, created_at=1.0)]
    context = 0
    for t in range(turns):
        prompt = SYSTEM_TOKENS if t == 0 else TOOL_TOKENS
        events.append(
            TurnCompleted(
                run=run,
                session=session,
                turn=t,
                created_at=2.0 + t,
                prefix_len=context,
                prompt_ids=rng.integers(0, VOCAB, prompt, dtype=np.int32),
                completion_ids=rng.integers(0, VOCAB, COMPLETION_TOKENS, dtype=np.int32),
                logprobs=-rng.random(COMPLETION_TOKENS, dtype=np.float32),
                message_prefix_len=2 * t,
                new_messages=[
                    {"role": "tool" if t else "user", "content": "x" * prompt * CHARS_PER_TOKEN}
                ],
                text="y" * COMPLETION_TOKENS * CHARS_PER_TOKEN,
                weight_version=1 + t // 50,
            )
        )
        context += prompt + COMPLETION_TOKENS
    events.append(
        SessionClosed(run=run, session=session, reward=1.0, num_turns=turns, created_at=3.0 + turns)
    )
    delivered = [*events, *events[1:-1]]  # every turn redelivered once
    order = rng.permutation(len(delivered))
    return [delivered[i] for i in order]


def measure(repeats: int, seed: int) -> dict[str, Any]:
    """Median fold and apply-loop ms and the peak MiB per size, with the ``consumers`` on
    sys.path (this tree's, or ``--source``'s)."""
    from consumers.fold import apply, finish, fold, initial

    figures: dict[str, Any] = {}
    sessions = {turns: session_events(turns, seed) for turns in SIZES}
    for turns, events in sessions.items():
        result = fold(events)  # warm-up, and a check that the session folds as expected
        [trajectory] = result.trajectories
        expected = SYSTEM_TOKENS + turns * COMPLETION_TOKENS + (turns - 1) * TOOL_TOKENS
        assert len(trajectory.input_ids) == expected, (len(trajectory.input_ids), expected)
        assert result.duplicates == turns
        figures[f"tokens_{turns}"] = expected
    fold_s: dict[int, list[float]] = {turns: [] for turns in SIZES}
    apply_s: dict[int, list[float]] = {turns: [] for turns in SIZES}
    wall_s: dict[int, list[float]] = {turns: [] for turns in SIZES}
    for _ in range(repeats):  # the sizes take turns, so a change of load hits them all
        for turns, events in sessions.items():
            wall, started = time.perf_counter(), time.thread_time()
            state = reduce(apply, events, initial())
            applied = time.thread_time()
            finish(state)
            apply_s[turns].append(applied - started)
            fold_s[turns].append(time.thread_time() - started)
            wall_s[turns].append(time.perf_counter() - wall)
    for turns, events in sessions.items():
        tracemalloc.start()
        fold(events)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        figures[f"fold_ms_{turns}"] = round(statistics.median(fold_s[turns]) * 1e3, 3)
        figures[f"fold_ms_best_{turns}"] = round(min(fold_s[turns]) * 1e3, 3)
        figures[f"fold_wall_ms_{turns}"] = round(statistics.median(wall_s[turns]) * 1e3, 3)
        figures[f"apply_ms_{turns}"] = round(statistics.median(apply_s[turns]) * 1e3, 3)
        figures[f"peak_mib_{turns}"] = round(peak / 2**20, 2)
    # The ratios from the best times: the load of a shared machine only ever adds time.
    for name, prefix in (("time", "fold_ms_best"), ("apply", "apply_ms"), ("peak", "peak_mib")):
        ratio = figures[f"{prefix}_200"] / figures[f"{prefix}_100"]
        figures[f"{name}_ratio_200_over_100"] = round(ratio, 2)
    return figures


def table(name: str, figures: dict[str, Any]) -> None:
    say(f"  {name}:")
    for turns in SIZES:
        say(
            f"    {turns:>3} turns {figures[f'tokens_{turns}']:>7,} tokens: fold "
            f"{figures[f'fold_ms_{turns}']:8.2f} ms (apply {figures[f'apply_ms_{turns}']:7.2f}), "
            f"peak {figures[f'peak_mib_{turns}']:6.2f} MiB"
        )
    say(
        f"    200/100 turns: time x{figures['time_ratio_200_over_100']}, "
        f"apply x{figures['apply_ratio_200_over_100']}, peak x{figures['peak_ratio_200_over_100']}"
    )


def phase(source: Path, repeats: int, seed: int) -> dict[str, Any]:
    """One measurement in a child process whose ``consumers`` and ``schemas`` are ``source``'s
    (first on its PYTHONPATH)."""
    options = ["--phase", str(source), "--repeats", str(repeats), "--seed", str(seed)]
    out = subprocess.run(
        [sys.executable, __file__, *options],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(source)},
    ).stdout
    figures: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return figures


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {key: round(statistics.median(run[key] for run in runs), 3) for key in runs[0]}


def main() -> int:
    parser = arguments(__doc__, "5 repeats instead of 15, same sessions", seed="session seed")
    parser.add_argument("--before", type=Path, help="a checkout whose fold to compare with")
    parser.add_argument("--phase", type=Path, help=argparse_hidden())
    parser.add_argument("--repeats", type=int, help=argparse_hidden())
    args = parser.parse_args()
    if args.phase is not None:  # a child of phase(): measure only, print one JSON line
        import consumers

        where = Path(consumers.__file__).resolve().parents[1]
        assert where == args.phase.resolve(), f"imported {where}, not {args.phase}"
        print(json.dumps(measure(args.repeats, args.seed)))
        return 0
    plan = QUICK if args.quick else FULL
    started = time.perf_counter()
    info = machine_info("numpy", "msgspec")
    banner("fold scaling", args.quick, info, f"numpy {info['numpy']}")
    here = Path(__file__).resolve().parents[1]
    after: list[dict[str, Any]] = []
    before: list[dict[str, Any]] = []
    for _ in range(plan.rounds if args.before else 1):
        after.append(phase(here, plan.repeats, args.seed))
        if args.before:
            before.append(phase(args.before, plan.repeats, args.seed))
    figures = median_of(after)
    table("this tree", figures)
    if before:
        old = median_of(before)
        table(f"before ({args.before})", old)
        figures.update({f"before_{key}": value for key, value in old.items()})
        figures["speedup_200"] = round(old["fold_ms_200"] / figures["fold_ms_200"], 2)
        say(f"  200 turns: {figures['speedup_200']}x faster than before")
    figures["rounds"] = len(after)
    figures["repeats"] = plan.repeats
    finish(figures, quick=args.quick, duration_s=time.perf_counter() - started, info=info)
    return 0


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    sys.exit(main())
