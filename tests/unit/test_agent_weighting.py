"""GRPO over sessions with sub-agents (issue 35, point 6): a session's agent trajectories share
its one advantage (the issue-18 rule), the batch says each row's agent kind, side calls stay out
of the batches unless kept, and docs/verl.md's per-agent weighting block runs as written."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Literal

import pytest
import torch

from consumers import fold
from tests.helpers.agent_sessions import claude_code_session
from tests.helpers.sessions import append_only, session_events
from trainer_sink import (
    Batcher,
    BatchingSettings,
    DropReason,
    Sample,
    SessionRows,
    assemble,
    non_tensor_values,
)
from trainer_sink.assembly import assemble_jagged
from turnstream.trainer.objective import group_advantages

RUN = "agents"
DOC = Path(__file__).resolve().parents[2] / "docs" / "verl.md"
MARK = "<!-- tests/unit/test_agent_weighting.py runs this block -->"


def group_batch(
    *, keep_side_calls: bool = False, scope: Literal["last", "all"] = "all"
) -> tuple[list[Sample[None]], dict[DropReason, int]]:
    """One GRPO group of two sessions through the batcher: ``agents`` (reward 1; main, a fork,
    a fresh sub-agent and a compaction call) and ``plain`` (reward 0, one row); the released
    samples, and what was dropped by reason."""
    trajectories = claude_code_session(RUN, "agents", 1.0, final_reward_scope=scope)
    plain = session_events(append_only(1), run=RUN, session="plain", group="g", final_reward=0.0)
    trajectories += fold(plain).trajectories
    settings = BatchingSettings(
        policy="groups", group_size=2, batch_size=1, keep_side_calls=keep_side_calls
    )
    batcher = Batcher[None](settings)
    released: list[Sample[None]] = []
    for trajectory in trajectories:
        released += [s for b in batcher.add(Sample(trajectory, None), 0.0).batches for s in b]
    return released, dict(batcher.stats.dropped)


def test_a_sessions_agents_share_its_one_advantage() -> None:
    released, dropped = group_batch()

    batch = assemble([s.trajectory for s in released], uids=[s.uid for s in released])
    rows = SessionRows.of(
        non_tensor_values(batch, "session_uid"), non_tensor_values(batch, "trajectory_id")
    )
    advantages = group_advantages(
        batch["rm_scores"].sum(-1), non_tensor_values(batch, "uid"), rows
    ).tolist()

    # The compaction call is left out; the group is complete without it, at once.
    assert dropped == {"side_call": 1}
    assert [s.trajectory.session for s in released] == ["agents"] * 3 + ["plain"]
    assert non_tensor_values(batch, "agent_kind") == ["main", "fork", "fresh", ""]
    assert non_tensor_values(batch, "agent_id") == [
        "main",
        "a9e64a5ca0980ef44",
        "adfda152c31bc96cc",
        "",
    ]
    assert len(set(non_tensor_values(batch, "uid"))) == 1
    # Sessions [1, 0]: mean 0.5, unbiased std sqrt(0.5): +-0.707, the same on all three rows.
    one = 0.5 / (math.sqrt(0.5) + 1e-6)
    assert advantages == pytest.approx([one, one, one, -one], abs=1e-6)
    assert batch["side_call"].tolist() == [False] * 4


def test_the_last_reward_scope_gives_the_session_its_reward_without_the_side_call() -> None:
    released, _ = group_batch(scope="last")

    batch = assemble([s.trajectory for s in released], uids=[s.uid for s in released])
    rows = SessionRows.of(
        non_tensor_values(batch, "session_uid"), non_tensor_values(batch, "trajectory_id")
    )

    # The session's last row in the batch (its highest segment there) carries its reward.
    assert batch["rm_scores"].sum(-1)[torch.from_numpy(rows.last)].tolist() == [1.0, 0.0]


def test_side_calls_are_kept_when_asked_and_flagged() -> None:
    released, dropped = group_batch(keep_side_calls=True)

    trajectories = [s.trajectory for s in released]
    batch = assemble(trajectories, uids=[s.uid for s in released])
    jagged = assemble_jagged(trajectories)

    assert dropped == {}
    assert [s.trajectory.session for s in released] == ["agents"] * 4 + ["plain"]
    assert batch["side_call"].tolist() == [False, False, False, True, False]
    assert jagged["side_call"].tolist() == [False, False, False, True, False]
    assert non_tensor_values(batch, "agent_kind") == ["main", "fork", "fresh", "main", ""]


def test_a_kept_side_call_never_stands_for_its_session() -> None:
    """With ``final_reward_scope="last"`` the fold rewards the session's last sample that is not
    a side call; kept in the batch, the side call (its highest segment) must not be the row
    that gives the session its reward."""
    released, _ = group_batch(keep_side_calls=True, scope="last")
    batch = assemble([s.trajectory for s in released], uids=[s.uid for s in released])
    uids, ids = non_tensor_values(batch, "session_uid"), non_tensor_values(batch, "trajectory_id")

    rows = SessionRows.of(uids, ids, batch["side_call"].tolist())
    by_segment = SessionRows.of(uids, ids)

    rewards = batch["rm_scores"].sum(-1)
    assert [ids[i] for i in rows.last] == [f"{RUN}/agents/2", f"{RUN}/plain/0"]
    assert rewards[torch.from_numpy(rows.last)].tolist() == [1.0, 0.0]
    assert rewards[torch.from_numpy(by_segment.last)].tolist() == [0.0, 0.0]  # the side call's
    advantages = group_advantages(rewards, non_tensor_values(batch, "uid"), rows).tolist()
    assert len(set(advantages[:4])) == 1 and advantages[0] > 0


@pytest.mark.parametrize("policy", ["count", "tokens"])
def test_count_and_token_batches_leave_side_calls_out_too(
    policy: Literal["count", "tokens"],
) -> None:
    trajectories = claude_code_session(RUN, "agents", 1.0)
    batcher = Batcher[None](BatchingSettings(policy=policy, batch_size=3, token_budget=10_000))

    decisions = [batcher.add(Sample(t, None), 0.0) for t in trajectories]
    decisions.append(batcher.flush(1.0))

    batches = [b for d in decisions for b in d.batches]
    dropped = [(x.sample.trajectory.segment, x.reason) for d in decisions for x in d.dropped]
    assert [[s.trajectory.segment for s in b] for b in batches] == [[0, 1, 2]]
    assert dropped == [(3, "side_call")]


# -- docs/verl.md's worked example ------------------------------------------------------------


def doc_block() -> str:
    [block] = re.findall(re.escape(MARK) + r"\n```python\n(.*?)```", DOC.read_text(), re.S)
    return str(block)


def test_the_per_agent_weighting_example_runs_as_documented() -> None:
    namespace: dict[str, Any] = {}
    exec(compile(doc_block(), str(DOC), "exec"), namespace)  # the doc's own code
    released, _ = group_batch()
    batch = assemble([s.trajectory for s in released], uids=[s.uid for s in released])

    weighted = namespace["agent_weighted_advantages"](batch).tolist()

    one = 0.5 / (math.sqrt(0.5) + 1e-6)
    assert weighted == pytest.approx([one, one / 2, one / 2, -one], abs=1e-6)
    assert round(one, 3) == 0.707 and round(one / 2, 3) == 0.354  # the numbers the doc gives
    # Counted as four rows instead of two sessions, the rewards [1, 1, 1, 0] would give 0.5.
    rows_only = group_advantages(batch["rm_scores"].sum(-1), non_tensor_values(batch, "uid"))
    assert rows_only.tolist()[0] == pytest.approx(0.5, abs=1e-5)
