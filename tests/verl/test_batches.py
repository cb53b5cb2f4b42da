"""Sink batches in verl's own code (verl 0.9.1, tensordict 0.10): GRPO groups, DataProto, metrics.

The batches come from a real live sink on a real nats-server; the advantages, metrics and the
DataProto are verl's own functions, run as verl's trainer runs them.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
import torch
from verl import DataProto
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.core_algos import AdvantageEstimator
from verl.trainer.ppo.metric_utils import compute_data_metrics
from verl.trainer.ppo.ray_trainer import compute_advantage

from schemas.events import SessionEvent
from tests.conftest import Log
from tests.helpers.sessions import append_only, session_events
from tests.integration.test_sink import fold_into_traj, live_sink, take
from trainer_sink import (
    AssemblySettings,
    BatchError,
    BatchingSettings,
    assemble,
    non_tensor_values,
    to_dataproto,
)

pytestmark = pytest.mark.integration


def epochs_of_two_runs() -> list[list[SessionEvent]]:
    """Runs r1 and r2 both name their prompts g0, g1 (as every demo does), and r1 sends g0 again
    in a second epoch: five groups of four sessions, three of them named g0."""
    planned: list[list[SessionEvent]] = []
    for run, group, epoch in [
        ("r1", "g0", 0),
        ("r1", "g1", 0),
        ("r2", "g0", 0),
        ("r2", "g1", 0),
        ("r1", "g0", 1),
    ]:
        for member in range(4):
            planned.append(
                session_events(
                    append_only(1 + member % 2),
                    run=run,
                    session=f"{group}-e{epoch}-m{member}",
                    group=group,
                    final_reward=float(member * (epoch + 1) + (run == "r2")),
                )
            )
    return planned


async def test_grpo_advantages_are_zero_mean_per_sink_group_across_runs_and_epochs(
    log: Log,
) -> None:
    planned = epochs_of_two_runs()
    # r1's second epoch of g0 comes after its first (a fold worker folds many sessions at once:
    # published together, the two epochs' trajectories would reach TRAJ interleaved).
    await fold_into_traj(log, planned[:16])
    await fold_into_traj(log, planned[16:])
    batching = BatchingSettings(policy="groups", group_size=4, batch_size=5)
    async with live_sink(log, batching) as sink:
        [batch] = await take(sink, 1, commit=True)
    uids = non_tensor_values(batch.tensors, "uid")
    sessions = non_tensor_values(batch.tensors, "session")
    runs = [t.run for t in batch.trajectories]
    # One uid per sink group: five groups, each four sessions of one run and one group name.
    members: dict[str, set[tuple[str, str]]] = defaultdict(set)
    for uid, run, session in zip(uids, runs, sessions, strict=True):
        members[uid].add((run, session.split("-")[0] + "-" + session.split("-")[1]))
    assert len(members) == 5 and all(len(m) == 1 for m in members.values())
    assert sorted(non_tensor_values(batch.tensors, "group")).count("g0") == 12

    data = to_dataproto(batch)
    rewards = data.batch["rm_scores"]
    advantages, _ = core_algos.compute_grpo_outcome_advantage(
        token_level_rewards=rewards,
        response_mask=data.batch["response_mask"],
        index=data.non_tensor_batch["uid"],
    )
    scores = advantages[torch.arange(len(uids)), data.batch["response_mask"].sum(-1) - 1]
    for uid in members:
        rows = [i for i, u in enumerate(uids) if u == uid]
        assert abs(float(scores[rows].mean())) < 1e-5, uid
    # Pooled by bare group name (the old uid), the three g0 groups would share one baseline.
    pooled, _ = core_algos.compute_grpo_outcome_advantage(
        token_level_rewards=rewards,
        response_mask=data.batch["response_mask"],
        index=np.array(non_tensor_values(batch.tensors, "group"), dtype=object),
    )
    assert not torch.allclose(pooled, advantages)


async def test_a_sink_batch_goes_through_verls_advantage_and_metrics_as_a_dataproto(
    log: Log,
) -> None:
    await fold_into_traj(log, epochs_of_two_runs()[:8])
    async with live_sink(
        log, BatchingSettings(policy="groups", group_size=4, batch_size=2)
    ) as sink:
        [batch] = await take(sink, 1, commit=True)
    data = to_dataproto(batch)
    assert isinstance(data, DataProto) and len(data) == 8
    assert data.non_tensor_batch["__num_turns__"].dtype == np.int32
    assert data.non_tensor_batch["__num_turns__"].tolist() == [
        t.num_turns for t in batch.trajectories
    ]
    # verl's trainer reads every sample's multi_modal_inputs (ray_trainer.fit).
    assert all("image_grid_thw" not in m for m in data.non_tensor_batch["multi_modal_inputs"])
    data.check_consistency()
    # As verl's fit does without a reward model or KL penalty: the scores are the rewards.
    data.batch["token_level_scores"] = data.batch["rm_scores"]
    data.batch["token_level_rewards"] = data.batch["rm_scores"]
    data = compute_advantage(data, AdvantageEstimator.GRPO)
    metrics = compute_data_metrics(data, use_critic=False)
    assert metrics["num_turns/min"] == 1 and metrics["num_turns/max"] == 2
    assert np.isfinite(metrics["critic/advantages/mean"])
    # verl's own DataProto.from_tensordict reads the same batch alike (its __num_turns__ stays
    # an object array); to_dataproto does not depend on it (verl < 0.5 has none).
    theirs = DataProto.from_tensordict(batch.tensors)
    assert set(theirs.non_tensor_batch) == set(data.non_tensor_batch)
    for key, values in theirs.non_tensor_batch.items():
        assert list(values) == list(data.non_tensor_batch[key]), key
    for key in theirs.batch.keys():  # noqa: SIM118  # TensorDict
        # NaN where NaN: rollout_temperature / rollout_top_p of rows that recorded no sampling
        ours = data.batch[key]
        torch.testing.assert_close(theirs.batch[key], ours, rtol=0, atol=0, equal_nan=True)


async def test_an_indexed_batch_and_a_jagged_one(log: Log) -> None:
    """tensordict collapses equal non-tensor values when a batch is indexed (0.8); to_dataproto
    still gives one value per sample. A jagged batch is refused with what to do instead."""
    await fold_into_traj(log, epochs_of_two_runs()[:4])
    async with live_sink(
        log, BatchingSettings(policy="groups", group_size=4, batch_size=1)
    ) as sink:
        [batch] = await take(sink, 1, commit=True)
    picked = to_dataproto(batch.tensors[torch.tensor([0, 2])])
    assert len(set(picked.non_tensor_batch["uid"])) == 1 and len(picked) == 2
    jagged = assemble(batch.trajectories, AssemblySettings(layout="jagged"))
    with pytest.raises(BatchError, match="padded layout"):
        to_dataproto(jagged)
