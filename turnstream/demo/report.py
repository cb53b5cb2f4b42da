"""What the demo made, counted where it lives, and shown: a table, a reward curve, JSON.

Every number is read from its source after the run: turns and sessions from the EVENTS stream
(``TurnCompleted`` and ``SessionOpened`` messages of the run), trajectories and forks from the
run's Parquet shards (rows; forks as the fold recorded them per session), shards from the shard
files, batches and steps from the trainer and its sink. ``DemoSummary.as_json`` is what
``turnstream demo --json`` prints.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
from rich.table import Table

from eventlog import JetStream, StreamNames
from schemas.ids import EVENT_SUBJECT_PREFIX, traj_subject
from shardstore import FileShardStore, open_shards_dataset
from turnstream.trainer.reference import StepReport

__all__ = [
    "DemoSummary",
    "ShardCounts",
    "StreamCounts",
    "count_shards",
    "count_streams",
    "steps_table",
    "summary_table",
    "write_reward_png",
]


@dataclass(frozen=True)
class StreamCounts:
    sessions: int  # SessionOpened messages of the run in EVENTS
    turns: int  # TurnCompleted messages of the run in EVENTS
    traj_messages: int  # TrajectoryReady messages of the run in TRAJ


@dataclass(frozen=True)
class ShardCounts:
    shards: int  # committed shard files of the run
    trajectories: int  # rows in them
    forks: int  # sum over the run's sessions of the forks the fold found
    tool_call_turns: int  # assistant messages with tool_calls, over the rows' conversations


async def _subject_counts(js: JetStream, stream: str, subjects: str) -> dict[str, int]:
    info = await js.stream_info(stream, subjects_filter=subjects)
    return dict(info.state.subjects or {})


async def count_streams(js: JetStream, names: StreamNames, run: str) -> StreamCounts:
    """The run's sessions and turns in EVENTS, its trajectories in TRAJ."""
    prefix = f"{EVENT_SUBJECT_PREFIX}.{run}.*"
    opened = await _subject_counts(js, names.events, f"{prefix}.open")
    turns = await _subject_counts(js, names.events, f"{prefix}.turn")
    traj = await _subject_counts(js, names.trajectories, traj_subject(run))
    return StreamCounts(len(opened), sum(turns.values()), sum(traj.values()))


def count_shards(target: str, run: str) -> ShardCounts:
    """The run's committed shards under ``target``, their rows, forks and tool calls."""
    shards = [s for s in FileShardStore(target).committed() if s.run == run]
    if not shards:
        return ShardCounts(0, 0, 0, 0)
    table = open_shards_dataset(target).to_table(
        columns=["session", "metadata", "messages"], filter=pc.field("run") == run
    )
    forks: dict[str, int] = {}
    tool_calls = 0
    for session, metadata, messages in zip(
        table["session"].to_pylist(),
        table["metadata"].to_pylist(),
        table["messages"].to_pylist(),
        strict=True,
    ):
        forks[session] = int(json.loads(metadata).get("forks", 0))
        tool_calls += sum(
            1 for m in json.loads(messages) if m.get("role") == "assistant" and m.get("tool_calls")
        )
    return ShardCounts(len(shards), table.num_rows, sum(forks.values()), tool_calls)


@dataclass(frozen=True)
class DemoSummary:
    run: str
    streams: StreamCounts
    shards: ShardCounts
    batches: int  # committed by the trainer
    reports: Sequence[StepReport]
    wall_s: float  # the whole demo: stack, agents, trainer, read-back
    train_s: float  # from the first episode to the last step's policy
    png: Path

    @property
    def reward_per_step(self) -> list[float]:
        return [r.mean_reward for r in self.reports]

    @property
    def logprob_max_abs_diff(self) -> float | None:
        deltas = [r.logprob_delta for r in self.reports if r.logprob_delta is not None]
        return max(deltas) if deltas else None

    def as_json(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "turns": self.streams.turns,
            "sessions": self.streams.sessions,
            "trajectories": self.shards.trajectories,
            "forks": self.shards.forks,
            "shards": self.shards.shards,
            "batches": self.batches,
            "steps": len(self.reports),
            "reward_per_step": self.reward_per_step,
            "samples_per_step": [r.samples for r in self.reports],
            "versions": [r.version for r in self.reports],
            "logprob_max_abs_diff": self.logprob_max_abs_diff,
            "tool_call_turns": self.shards.tool_call_turns,
            "traj_messages": self.streams.traj_messages,
            "wall_s": round(self.wall_s, 3),
            "train_s": round(self.train_s, 3),
            "png": str(self.png),
        }


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def steps_table(reports: Sequence[StepReport]) -> Table:
    """One row per trainer step; "drawn by it": samples generated wholly by the weights the
    step started from (their log-probs were checked against the gateway's)."""
    table = Table(
        "step",
        "policy",
        "samples",
        "drawn by it",
        "mean reward",
        "max |Δ logprob|",
        title="reference GRPO trainer, fed live by the sink",
    )
    for report in reports:
        delta = "-" if report.logprob_delta is None else f"{report.logprob_delta:.1e}"
        table.add_row(
            str(report.step),
            f"v{report.version - 1} → v{report.version}",
            str(report.samples),
            str(report.agreement_samples),
            f"{report.mean_reward:.3f}",
            delta,
        )
    return table


def summary_table(summary: DemoSummary) -> Table:
    rewards = summary.reward_per_step
    window = min(5, len(rewards))
    first, last = _mean(rewards[:window]), _mean(rewards[-window:])
    delta = summary.logprob_max_abs_diff
    table = Table("", "", title=f"run {summary.run}", show_header=False)
    rows = [
        (f"mean reward, first {window} steps", f"{first:.3f}"),
        (f"mean reward, last {window} steps", f"[bold]{last:.3f}[/] ({last - first:+.3f})"),
        ("steps (policy versions published)", f"{len(summary.reports)}"),
        ("batches committed", f"{summary.batches}"),
        ("sessions (EVENTS)", f"{summary.streams.sessions}"),
        ("turns (EVENTS)", f"{summary.streams.turns}"),
        ("trajectories (shards)", f"{summary.shards.trajectories}"),
        ("forks (shards)", f"{summary.shards.forks}"),
        ("tool calls (shards)", f"{summary.shards.tool_call_turns}"),
        ("shards", f"{summary.shards.shards}"),
        ("max |Δ logprob| gateway vs trainer", "-" if delta is None else f"{delta:.1e}"),
        ("wall time", f"{summary.wall_s:.1f} s (training loop {summary.train_s:.1f} s)"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table


def write_reward_png(
    path: Path, rewards: Sequence[float], *, title: str, chance: float | None = None
) -> Path:
    """The mean reward per step as a line chart (matplotlib, Agg: no display needed), with the
    reward of a random policy (``chance``) as a dotted line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = list(range(1, len(rewards) + 1))
    figure, axes = plt.subplots(figsize=(7, 4), dpi=100)
    try:
        axes.plot(steps, rewards, marker="o", markersize=3, label="mean reward of the step's batch")
        window = 5
        if len(rewards) >= window:
            smooth = [_mean(rewards[i - window : i]) for i in range(window, len(rewards) + 1)]
            axes.plot(steps[window - 1 :], smooth, linewidth=2, label=f"mean of {window} steps")
        if chance is not None:
            axes.axhline(chance, color="grey", linestyle=":", label="a random policy")
        axes.set_xlabel("trainer step")
        axes.set_ylabel("mean reward")
        axes.set_title(title, fontsize=10)
        axes.grid(alpha=0.3)
        axes.legend(loc="upper left", fontsize=8)
        figure.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_name(f".{path.name}.tmp")
        figure.savefig(staging, format="png")
        staging.replace(path)
    finally:
        plt.close(figure)
    return path
