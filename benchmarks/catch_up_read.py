"""Benchmark: a catch-up read's CPU, with a reader of its own per read against a held one.

Run it from the repository root (nats-server on PATH, or in the venv's bin)::

    .venv/bin/python benchmarks/catch_up_read.py           # 12 rounds of 400 reads per case
    .venv/bin/python benchmarks/catch_up_read.py --quick   # 6 rounds of 150, ~10 s
    .venv/bin/python benchmarks/catch_up_read.py --compare-with 2ed3c0e  # and the read before

What it measures
----------------
A gateway reads a session's events after the last stream sequence it knows before many turns
(issue 36: did another gateway write to it?), and mostly finds nothing. One session of 30
turns (300-token prompts, 100-token completions, with text) sits among 40 others in EVENTS
on a nats-server started here (file store), and this process reads it with
``read_session_after`` (decoded and vetted, as the gateway reads) three ways: after its last
sequence (``none``: nothing new), after the one before (``one``), and after the 21st from the
end (``twenty``). Each case two ways, paired, alternating which goes first each round:

- ``per_read``: ``eventlog.read_session_after(js, ...)``, a ``DirectReader`` of its own for
  the read (subscribe an inbox, request, unsubscribe): what every read cost before issue 36;
- ``held``: ``DirectReader.read_session_after`` on one reader started once, each request
  routed by a token under its one wildcard inbox subscription.

Per read: this process's CPU (``time.process_time``, the figure that matters on a busy
gateway) and wall time, each the median over the rounds of a round's mean; ``*_ratio`` =
held / per_read. ``--compare-with REV`` adds a third side, ``before``: ``read_session_after``
as ``eventlog/reader.py`` held it at REV (loaded as a module of its own next to this tree's),
and ``*_ratio_to_before`` = held / before. ``concurrent_*``: 32 ``none`` reads at once
(``asyncio.gather``), per read. For scale, ``publish_ack_cpu_us``: one acknowledged
``JetStreamPublisher.publish`` of a turn of the same shape, one at a time. The event loop is
the services' (uvloop where installed, ``turnstream.stack.process.run_service``). nats-server
runs on the same machine and its CPU is not counted.

The LAST line is one JSON object of these figures and the machine.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import statistics
import string
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from harness.pipeline_load import Plan, make_session
from harness.processes import REPO, RUN
from harness.reporting import arguments, banner, finish, machine_info, say

from eventlog import (
    DirectReader,
    JetStreamPublisher,
    LogSettings,
    connect,
    provision,
    read_session_after,
)
from eventlog.server import NatsServer
from turnstream.stack.process import run_service

SESSION_PLAN = Plan(
    sessions=41, latency_sessions=0, turns=30, prompt_tokens=300, completion_tokens=100
)
CASES = {"none": 0, "one": 1, "twenty": 20}  # events after the sequence read from
CONCURRENT = 32


@dataclass(frozen=True)
class Rounds:
    rounds: int
    reads: int


FULL = Rounds(rounds=12, reads=400)
QUICK = Rounds(rounds=6, reads=150)

Read = Callable[[int], Awaitable[int]]  # after_seq -> how many events it read


async def timed(
    read: Read, after_seq: int, expected: int, n: int, at_once: int
) -> tuple[float, float]:
    """CPU and wall seconds per read over ``n`` reads, ``at_once`` at a time."""
    gc.collect()
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(n // at_once):
        # One read is awaited as such: a gather would wrap it in a task of its own.
        if at_once == 1:
            got = [await read(after_seq)]
        else:
            got = await asyncio.gather(*(read(after_seq) for _ in range(at_once)))
        if any(g != expected for g in got):
            raise AssertionError(f"read {got} events after seq {after_seq}, expected {expected}")
    done = n // at_once * at_once
    return (time.process_time() - cpu) / done, (time.perf_counter() - wall) / done


async def paired(
    sides: dict[str, Read], after_seq: int, expected: int, plan: Rounds, at_once: int = 1
) -> dict[str, dict[str, float]]:
    """Median per-read CPU and wall of each side, alternating which goes first each round."""
    cpu: dict[str, list[float]] = {side: [] for side in sides}
    wall: dict[str, list[float]] = {side: [] for side in sides}
    for read in sides.values():  # warm-up, untimed
        await timed(read, after_seq, expected, max(at_once, plan.reads // 10), at_once)
    names = list(sides)
    for r in range(plan.rounds):
        for side in names if r % 2 == 0 else names[::-1]:
            c, w = await timed(sides[side], after_seq, expected, plan.reads, at_once)
            cpu[side].append(c)
            wall[side].append(w)
    return {
        side: {
            "cpu_us": statistics.median(cpu[side]) * 1e6,
            "wall_us": statistics.median(wall[side]) * 1e6,
        }
        for side in sides
    }


def read_session_after_at(rev: str) -> Callable[..., Awaitable[Any]]:
    """``read_session_after`` as ``eventlog/reader.py`` held it at ``rev`` (a module of its own,
    run against this tree's other modules): the read before a change, in this process."""
    path = "eventlog/reader.py"
    source = subprocess.run(
        ["git", "show", f"{rev}:{path}"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    module = types.ModuleType("reader_before")
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(compile(source, f"{rev}:{path}", "exec"), module.__dict__)
    read: Callable[..., Awaitable[Any]] = module.read_session_after
    return read


async def bench(plan: Rounds, store_parent: str | None, before_rev: str | None) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    corpus = "".join(rng.choice(list(string.ascii_lowercase + " "), 200_000).tolist())
    sessions = [make_session(rng, corpus, i, SESSION_PLAN) for i in range(SESSION_PLAN.sessions)]
    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="ts-bench-", dir=store_parent) as tmp:
        server = NatsServer(Path(tmp) / "nats").start()
        try:
            nc = await connect(server.url, name="bench")
            js = nc.jetstream()
            await provision(js, LogSettings())
            publisher = await JetStreamPublisher(nc).start()
            reader = await DirectReader(nc).start()
            try:
                # The read session's turns interleaved with the others', as a busy log holds them.
                mine = []
                for index in range(len(sessions[0])):
                    await publisher.publish_many([s[index] for s in sessions[1:]])
                    mine.append((await publisher.publish(sessions[0][index])).seq)
                session = sessions[0][0].session

                async def per_read(after_seq: int) -> int:
                    return len((await read_session_after(js, RUN, session, after_seq)).events)

                async def held(after_seq: int) -> int:
                    return len((await reader.read_session_after(RUN, session, after_seq)).events)

                sides: dict[str, Read] = {"per_read": per_read, "held": held}
                if before_rev is not None:
                    read_before = read_session_after_at(before_rev)

                    async def before(after_seq: int) -> int:
                        return len((await read_before(js, RUN, session, after_seq)).events)

                    sides = {"before": before, **sides}
                for case, new in CASES.items():
                    after_seq = mine[-1 - new]
                    result = await paired(sides, after_seq, new, plan)
                    report(figures, case, result)
                result = await paired(sides, mine[-1], 0, plan, at_once=CONCURRENT)
                report(figures, "concurrent", result)
                figures["publish_ack_cpu_us"] = await publish_cpu(publisher, rng, corpus, plan)
            finally:
                await reader.close()
                await publisher.close()
                await nc.close()
        finally:
            server.stop()
    return figures


def report(figures: dict[str, Any], case: str, result: dict[str, dict[str, float]]) -> None:
    for side, values in result.items():
        for what, value in values.items():
            figures[f"{case}_{side}_{what}"] = round(value, 1)
    for what in ("cpu_us", "wall_us"):
        for side in result.keys() - {"held"}:
            ratio = round(result["held"][what] / result[side][what], 3)
            figures[f"{case}_{what}_ratio" + ("_to_before" if side == "before" else "")] = ratio
    say(
        f"  {case:<10} per read: "
        + " | ".join(
            f"{side} {values['cpu_us']:6.1f} us CPU ({values['wall_us']:6.1f} wall)"
            for side, values in result.items()
        )
        + f" | held/per_read CPU {figures[f'{case}_cpu_us_ratio']}"
    )


async def publish_cpu(
    publisher: JetStreamPublisher, rng: np.random.Generator, corpus: str, plan: Rounds
) -> float:
    """CPU per acknowledged publish of a turn, one at a time (the median round's)."""
    shape = Plan(
        sessions=1, latency_sessions=0, turns=plan.reads, prompt_tokens=300, completion_tokens=100
    )
    per: list[float] = []
    for r in range(plan.rounds):
        events = make_session(rng, corpus, 1_000 + r, shape)[1:]  # fresh Msg-Ids: no duplicates
        gc.collect()
        cpu = time.process_time()
        for event in events:
            await publisher.publish(event)
        per.append((time.process_time() - cpu) / len(events))
    value = round(statistics.median(per) * 1e6, 1)
    say(f"  publish + ack: {value} us CPU")
    return value


async def main() -> None:
    parser = arguments(__doc__, f"{QUICK.rounds} rounds of {QUICK.reads} reads", store_dir=True)
    parser.add_argument(
        "--compare-with",
        metavar="REV",
        help="also read with eventlog/reader.py's read_session_after as it was at REV (paired)",
    )
    args = parser.parse_args()
    plan = QUICK if args.quick else FULL
    started = time.perf_counter()
    info = machine_info("nats-py", "msgspec")
    info["uvloop"] = type(asyncio.get_running_loop()).__module__.startswith("uvloop")
    banner("catch-up read", args.quick, info)
    figures = await bench(plan, args.store_dir, args.compare_with)
    finish(figures, quick=args.quick, duration_s=time.perf_counter() - started, info=info)


if __name__ == "__main__":
    logging.basicConfig(level=logging.ERROR)
    run_service(main())
