"""GRPO over sessions with verl's own code (issue 18, point 3): docs/verl.md's blocks, as written.

One group of four sessions, one of them six segments (rows) long with reward 1, the others one
row with 0: the sessions [1, 0, 0, 0] give 1.5 on each of the six rows and -0.5 on the others.
The batch is the batcher's (one uid per group instance) assembled and turned into a DataProto
by ``to_dataproto``; the advantages are verl's ``core_algos`` and ``compute_advantage``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pytest
import torch
from verl import DataProto
from verl.trainer.ppo import core_algos, ray_trainer
from verl.trainer.ppo.core_algos import AdvantageEstimator
from verl.workers.config import ActorConfig, PolicyLossConfig

from tests.helpers.grpo_sessions import SESSION_ADVANTAGE, WON_SEGMENTS, segmented_group
from trainer_sink import (
    Batcher,
    BatchingSettings,
    Sample,
    SessionRows,
    assemble,
    to_dataproto,
)
from turnstream.trainer.objective import group_advantages

DOC = Path(__file__).resolve().parents[2] / "docs" / "verl.md"
MARK = "<!-- tests/verl/test_session_grpo.py runs this block -->"


def doc_blocks() -> list[str]:
    """The python blocks docs/verl.md marks for this test, in order."""
    return re.findall(re.escape(MARK) + r"\n```python\n(.*?)```", DOC.read_text(), re.S)


@pytest.fixture
def doc() -> Iterator[dict[str, Any]]:
    """docs/verl.md's blocks run in one namespace; verl's compute_advantage put back after."""
    blocks = doc_blocks()
    assert len(blocks) == 2, "docs/verl.md: the GRPO-over-sessions blocks are not marked"
    original = ray_trainer.compute_advantage
    namespace: dict[str, Any] = {}
    try:
        for block in blocks:
            exec(compile(block, str(DOC), "exec"), namespace)  # the doc's own code
        yield namespace
    finally:
        ray_trainer.compute_advantage = original


def batch_of(scope: Literal["last", "all"]) -> tuple[DataProto, list[str]]:
    """The group through the batcher (groups of 4 sessions) and to_dataproto, as verl's fit
    has it before advantages (no KL penalty: the rewards are the scores); its rows' sessions."""
    batcher = Batcher[None](BatchingSettings(policy="groups", group_size=4, batch_size=1))
    released: list[Sample[None]] = []
    for trajectory in segmented_group(scope):
        released += [s for b in batcher.add(Sample(trajectory, None), 0.0).batches for s in b]
    assert len(released) == WON_SEGMENTS + 3
    batch = assemble([s.trajectory for s in released], uids=[s.uid for s in released])
    data = to_dataproto(batch)
    data.batch["token_level_scores"] = data.batch["rm_scores"]
    data.batch["token_level_rewards"] = data.batch["rm_scores"]
    return data, [s.trajectory.session for s in released]


def per_row(advantages: torch.Tensor, mask: torch.Tensor) -> list[float]:
    """The one value each row's advantages hold on its generated tokens."""
    assert advantages.shape == mask.shape
    values = (advantages * mask).sum(-1) / mask.sum(-1)
    assert torch.allclose(advantages, values.unsqueeze(-1) * mask)
    return [float(v) for v in values]


@pytest.mark.parametrize("scope", ["all", "last"])
def test_the_documented_path_gives_each_session_one_advantage_with_verls_core_algos(
    doc: dict[str, Any], scope: Literal["last", "all"]
) -> None:
    data, sessions = batch_of(scope)
    assert len(set(data.non_tensor_batch["uid"])) == 1  # one group instance
    assert list(data.non_tensor_batch["session_uid"]) == [f"grpo/{s}" for s in sessions]
    mask = data.batch["response_mask"]
    expected = [SESSION_ADVANTAGE[s] for s in sessions]

    rows_counted, _ = core_algos.compute_grpo_outcome_advantage(
        token_level_rewards=data.batch["token_level_rewards"],
        response_mask=mask,
        index=data.non_tensor_batch["uid"],
    )
    advantages = doc["session_grpo_advantage"](data).batch["advantages"]
    assert per_row(advantages, mask) == pytest.approx(expected, abs=1e-5)
    assert per_row(advantages, mask)[:WON_SEGMENTS] == pytest.approx([1.5] * WON_SEGMENTS, 1e-5)
    # The reference trainer's function gives the same numbers on the same rows.
    rows = SessionRows.of(
        data.non_tensor_batch["session_uid"], data.non_tensor_batch["trajectory_id"]
    )
    ours = group_advantages(
        data.batch["rm_scores"].sum(-1), list(data.non_tensor_batch["uid"]), rows
    )
    assert ours.tolist() == pytest.approx(per_row(advantages, mask), abs=1e-5)
    if scope == "all":  # verl's GRPO on the rows: baseline 0.67, advantage 0.67 for "won"
        assert per_row(rows_counted, mask)[0] == pytest.approx(2 / 3, abs=1e-5)


def test_verls_compute_advantage_takes_the_session_path_once_routed(
    doc: dict[str, Any],
) -> None:
    data, sessions = batch_of("last")
    mask = data.batch["response_mask"]
    routed = ray_trainer.compute_advantage(
        data, adv_estimator=AdvantageEstimator.GRPO, norm_adv_by_std_in_grpo=True
    )
    expected = [SESSION_ADVANTAGE[s] for s in sessions]
    assert per_row(routed.batch["advantages"], mask) == pytest.approx(expected, abs=1e-5)
    # Another estimator still goes to verl's own function.
    other, _ = batch_of("last")
    other = ray_trainer.compute_advantage(other, adv_estimator=AdvantageEstimator.RLOO)
    assert not torch.allclose(other.batch["advantages"], routed.batch["advantages"])


@pytest.mark.parametrize(
    "mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
)
def test_session_balanced_is_each_rows_loss_times_one_over_its_sessions_rows(
    doc: dict[str, Any], mode: str
) -> None:
    """As docs/verl.md says: scaled advantages scale verl's vanilla per-token losses (clip
    fractions unchanged), and under seq-mean-token-mean each session's rows weigh 1 together."""
    plain, sessions = batch_of("all")
    balanced, _ = batch_of("all")
    plain = doc["session_grpo_advantage"](plain)
    balanced = doc["session_grpo_advantage"](balanced, session_balanced=True)
    mask = plain.batch["response_mask"]
    weights = [1 / WON_SEGMENTS if s == "won" else 1.0 for s in sessions]
    assert per_row(balanced.batch["advantages"], mask) == pytest.approx(
        [a * w for a, w in zip(per_row(plain.batch["advantages"], mask), weights, strict=True)]
    )
    old = plain.batch["rollout_log_probs"]
    new = old + 0.3 * torch.sin(torch.arange(old.numel(), dtype=torch.float32)).view(old.shape)
    config = ActorConfig(
        strategy="fsdp",
        rollout_n=4,
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio=0.2,
        loss_agg_mode=mode,
        policy_loss=PolicyLossConfig(loss_mode="vanilla"),
    )
    policy_loss = core_algos.get_policy_loss_fn("vanilla")

    def loss_of(advantages: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        return policy_loss(
            old_log_prob=old,
            log_prob=new,
            advantages=advantages,
            response_mask=mask,
            loss_agg_mode=mode,
            config=config,
        )

    weighted, weighted_metrics = loss_of(balanced.batch["advantages"])
    _, plain_metrics = loss_of(plain.batch["advantages"])
    assert weighted_metrics["actor/pg_clipfrac"] == pytest.approx(
        plain_metrics["actor/pg_clipfrac"]
    )
    # The same loss from each row's per-token losses (at unit weight) times its weight.
    row_losses = []
    for i in range(len(sessions)):
        one, _ = loss_of(
            torch.where(torch.arange(len(sessions))[:, None] == i, plain.batch["advantages"], 0.0)
        )
        row_losses.append(float(one))
    assert float(weighted) == pytest.approx(
        sum(w * r for w, r in zip(weights, row_losses, strict=True)), rel=1e-5, abs=1e-7
    )
    if mode == "seq-mean-token-mean":  # one vote per session, over the B rows
        tokens = mask.sum(-1).float()
        pg = np.array(row_losses) * len(sessions)  # each row's token-mean loss
        by_session = {s: [] for s in SESSION_ADVANTAGE}
        for s, value in zip(sessions, pg.tolist(), strict=True):
            by_session[s].append(value)
        assert bool((tokens > 0).all())
        votes = sum(float(np.mean(v)) for v in by_session.values())
        assert float(weighted) == pytest.approx(votes / len(sessions), rel=1e-5)
