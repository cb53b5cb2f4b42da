"""Runs ``turnstream gateway`` exactly as the CLI does, and observes it from the outside.

``benchmarks/gateway_overhead.py`` starts the gateway through this script, which calls
``turnstream.cli.main(["gateway", ...])`` unchanged and adds:

* ``--gc-log FILE``: every collection of the oldest generation (wall-clock start, pause in ms,
  objects collected) and per-generation counts and total pause, written as JSON at exit. The
  gateway process imports transformers (which imports torch) and loads a tokenizer: several
  hundred thousand long-lived objects that every full collection walks again.
* ``--gc-freeze``: an experiment, not the product: on SIGUSR2 (sent by the benchmark once the
  gateway has started and answered a request), ``gc.collect(); gc.freeze()``, which moves every
  object alive then out of the collector's reach, as a service would do at the end of startup.
* ``--profile FILE``: a ``cProfile.Profile`` that SIGUSR1 switches on and off (the benchmark
  does so at the edges of its measured windows), so that startup is not in the profile;
  written at exit (``pstats`` format).
* ``--tracemalloc FILE``: a diagnostic: the first SIGUSR1 starts ``tracemalloc`` (which slows
  every allocation; started at launch it would hold the imports past the health wait), the
  second writes to FILE, as text, what was allocated since and is still alive, by the line that
  allocated it (the largest first; each traceback's innermost project frame). Not with
  ``--profile`` (the same signal).
* ``--source-tree DIR``: run the project's code from ``DIR`` (a checkout, e.g. a ``git worktree``
  of another revision) instead of what the virtual environment has installed: ``DIR`` goes
  first on ``sys.path`` and the editable install's import hook is dropped, so ``gateway``,
  ``schemas``, ``turnstream``, ``consumers`` and ``trainer_sink`` resolve to ``DIR`` or not at
  all. Where each one resolves is checked (a package found outside ``DIR`` exits with code 3)
  and printed as ``launcher: <package> from <file>`` before the gateway starts.

Usage::

    python benchmarks/harness/gateway_launcher.py [--gc-log F] [--gc-freeze] [--profile F]
        [--source-tree DIR] -- gateway --flags...
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import importlib.util
import json
import signal
import sys
import time
import tracemalloc
from pathlib import Path
from types import FrameType
from typing import Any

# The top-level packages of the project (pyproject.toml's [tool.setuptools.packages.find]).
PACKAGES = ("gateway", "schemas", "turnstream", "consumers", "trainer_sink")


class ProfileSwitch:
    """SIGUSR1 turns the profiler on, the next one off, and so on.

    Full collections are kept out of the profile (cProfile would charge a 100+ ms pause to
    whichever function happened to allocate) and counted in ``full_gc_s`` instead. Younger
    collections are short and frequent and stay in, spread over the allocating code.
    """

    def __init__(self) -> None:
        # Process CPU time, not wall time: on a loaded machine a wall-clock profile charges the
        # time the process waits for a core to whatever function it was preempted in.
        self.profile = cProfile.Profile(time.process_time)
        self.on = False
        self.switches = 0
        self.full_gc_s = 0.0
        self.full_gcs = 0
        self._paused_at: float | None = None

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if self.on:
            self.profile.disable()
        else:
            self.profile.enable()
        self.on = not self.on
        self.switches += 1

    def full_gc(self, phase: str) -> None:
        if not self.on:
            return
        if phase == "start":
            self.profile.disable()
            self._paused_at = time.perf_counter()
        elif self._paused_at is not None:
            self.full_gc_s += time.perf_counter() - self._paused_at
            self.full_gcs += 1
            self._paused_at = None
            self.profile.enable()


class GCRecorder:
    def __init__(self, switch: ProfileSwitch | None = None) -> None:
        self.switch = switch
        self.started: float | None = None
        self.counts = [0, 0, 0]
        self.pause_s = [0.0, 0.0, 0.0]
        self.full: list[dict[str, float]] = []

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if self.switch is not None and info["generation"] == 2:
            self.switch.full_gc(phase)
        if phase == "start":
            self.started = time.perf_counter()
            return
        if self.started is None:
            return
        pause = time.perf_counter() - self.started
        generation = int(info["generation"])
        self.counts[generation] += 1
        self.pause_s[generation] += pause
        if generation == 2:
            self.full.append(
                {
                    "at": time.time() - pause,  # wall clock: lines up with the benchmark's phases
                    "pause_ms": round(pause * 1000, 3),
                    "collected": int(info["collected"]),
                }
            )
        self.started = None

    def report(self) -> dict[str, Any]:
        return {
            "counts": self.counts,
            "pause_ms_total": [round(s * 1000, 3) for s in self.pause_s],
            "full_collections": self.full,
            "frozen_objects": gc.get_freeze_count(),
        }


def freeze(signum: int, frame: FrameType | None) -> None:
    gc.collect()
    gc.freeze()


class MemorySnapshot:
    """SIGUSR1 starts tracing, the next one writes the live allocations since by the project
    line that made them into ``path``."""

    def __init__(self, path: Path, top: int = 40) -> None:
        self.path, self.top = path, top

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if not tracemalloc.is_tracing():
            tracemalloc.start(25)
            return
        snapshot = tracemalloc.take_snapshot()
        by_line: dict[str, list[int]] = {}
        for stat in snapshot.statistics("traceback"):
            where = next(
                (
                    f"{f.filename}:{f.lineno}"
                    for f in reversed(stat.traceback)
                    if any(f"/{p}/" in f.filename for p in PACKAGES)
                ),
                f"{stat.traceback[-1].filename}:{stat.traceback[-1].lineno}",
            )
            sizes = by_line.setdefault(where, [0, 0])
            sizes[0] += stat.size
            sizes[1] += stat.count
        total = sum(size for size, _ in by_line.values())
        lines = [f"total {total / 2**20:.1f} MiB traced"]
        ranked = sorted(by_line.items(), key=lambda kv: -kv[1][0])[: self.top]
        lines += [f"{size / 2**20:9.2f} MiB {count:>9} blocks  {w}" for w, (size, count) in ranked]
        self.path.write_text("\n".join(lines) + "\n")


def use_source_tree(tree: Path) -> None:
    """Import the project's packages from ``tree`` only (see ``--source-tree``)."""
    # The editable install (``pip install -e``) adds an import hook that maps the package names
    # to the main checkout; it sits after the path finder, but it would still answer for a
    # package that ``tree`` lacks. Drop it, so that such a package fails to import instead.
    sys.meta_path[:] = [
        finder
        for finder in sys.meta_path
        if not getattr(finder, "__module__", "").startswith("__editable__")
    ]
    sys.path.insert(0, str(tree))


def check_source_tree(tree: Path) -> None:
    """Print where each project package resolves; exit 3 if one resolves outside ``tree``."""
    for name in PACKAGES:
        spec = importlib.util.find_spec(name)
        origin = spec.origin if spec is not None else None
        if origin is None:
            print(f"launcher: {name} not importable (not in {tree})", flush=True)
            continue
        print(f"launcher: {name} from {origin}", flush=True)
        if not Path(origin).resolve().is_relative_to(tree):
            print(f"launcher: {name} resolves outside the source tree {tree}", flush=True)
            sys.exit(3)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gc-log", type=Path, default=None)
    parser.add_argument("--gc-freeze", action="store_true")
    parser.add_argument("--profile", type=Path, default=None)
    parser.add_argument("--tracemalloc", type=Path, default=None)
    parser.add_argument("--source-tree", type=Path, default=None)
    parser.add_argument("cli_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    cli_args = args.cli_args[1:] if args.cli_args[:1] == ["--"] else args.cli_args

    tree = args.source_tree.resolve() if args.source_tree is not None else None
    if tree is not None:
        use_source_tree(tree)

    from turnstream.cli import main as cli_main

    if tree is not None:
        check_source_tree(tree)

    if args.gc_freeze:
        signal.signal(signal.SIGUSR2, freeze)
    switch = ProfileSwitch() if args.profile is not None else None
    if switch is not None:
        signal.signal(signal.SIGUSR1, switch)
    elif args.tracemalloc is not None:
        signal.signal(signal.SIGUSR1, MemorySnapshot(args.tracemalloc))
    recorder = GCRecorder(switch)
    gc.callbacks.append(recorder)
    try:
        return cli_main(cli_args)
    finally:
        gc.callbacks.remove(recorder)
        if args.gc_log is not None:
            args.gc_log.write_text(json.dumps(recorder.report()))
        if switch is not None and args.profile is not None:
            if switch.on:
                switch.profile.disable()
            switch.profile.dump_stats(args.profile)
            args.profile.with_suffix(".gc.json").write_text(
                json.dumps({"full_gcs": switch.full_gcs, "full_gc_s": switch.full_gc_s})
            )


if __name__ == "__main__":
    sys.exit(main())
