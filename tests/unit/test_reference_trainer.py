"""The reference trainer's math, and its log-probs against the local backend's, with no NATS."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

import msgspec
import numpy as np
import pytest
import torch
from tensordict import TensorDict

from consumers import fold
from gateway.backends.interface import Prompt, SamplingParams
from gateway.backends.local import LocalBackend
from schemas.events import TrajectoryReady, TurnCompleted
from tests.helpers.grpo_sessions import SESSION_ADVANTAGE, WON_SEGMENTS, segmented_group
from tests.helpers.sampled_sessions import sampled_sessions
from tests.helpers.sessions import append_only, session_events
from trainer_sink.assembly import assemble_padded, non_tensor_values
from trainer_sink.errors import BatchError
from trainer_sink.sessions import SessionRows
from turnstream.trainer.objective import (
    batch_advantages,
    check_sampled_logprobs,
    check_sampling,
    check_temperature,
    clipped_objective,
    group_advantages,
    max_logprob_delta,
    response_log_probs,
)
from turnstream.trainer.reference import ReferenceTrainer, ReferenceTrainerSettings


def test_group_advantages_compare_samples_within_their_group_only() -> None:
    rewards = torch.tensor([1.0, 0.0, 5.0, 5.0, 7.0])
    advantages = group_advantages(rewards, ["a", "a", "b", "b", "c"])
    # group a: mean 0.5, sample std 0.7071; group b is uniform; c is alone
    assert advantages[:2].tolist() == pytest.approx([1 / math.sqrt(2), -1 / math.sqrt(2)], 1e-4)
    assert advantages[2:].tolist() == [0.0, 0.0, 0.0]
    # ppo without a critic: the whole batch is the baseline
    assert batch_advantages(torch.tensor([1.0, 0.0])).tolist() == pytest.approx(
        [0.7071, -0.7071], 1e-3
    )


def rows_of(batch: TensorDict) -> SessionRows:
    return SessionRows.of(
        non_tensor_values(batch, "session_uid"), non_tensor_values(batch, "trajectory_id")
    )


@pytest.mark.parametrize("scope", ["all", "last"])
@pytest.mark.parametrize("order", ["folded", "reversed"])
def test_grpo_compares_sessions_one_reward_each_and_gives_every_row_its_sessions_advantage(
    scope: Literal["all", "last"], order: str
) -> None:
    """A 6-segment session with reward 1 and three 1-segment sessions with 0 (issue 18): the
    sessions [1, 0, 0, 0] have baseline 0.25 and std 0.5, so 1.5 on each of the six rows and
    -0.5 on the others, whichever segment carries the reward and whatever the rows' order."""
    trajectories = segmented_group(scope)
    if order == "reversed":  # the session's last segment is no longer its last row
        trajectories = trajectories[::-1]
    batch = assemble_padded(trajectories)
    rewards = batch["rm_scores"].sum(-1)
    advantages = group_advantages(rewards, non_tensor_values(batch, "uid"), rows_of(batch))
    expected = [SESSION_ADVANTAGE[t.session] for t in trajectories]
    assert advantages.tolist() == pytest.approx(expected, abs=1e-5)
    assert sum(a == pytest.approx(1.5, abs=1e-5) for a in advantages.tolist()) == WON_SEGMENTS
    if scope == "all":  # counted by rows: [1]*6 + [0]*3, baseline 2/3, std 0.5
        by_rows = group_advantages(rewards, non_tensor_values(batch, "uid"))
        assert max(by_rows.tolist()) == pytest.approx(2 / 3, abs=1e-5)


def test_a_session_alone_in_its_group_and_a_session_split_over_two_groups() -> None:
    batch = assemble_padded(segmented_group())
    rows = rows_of(batch)
    rewards = batch["rm_scores"].sum(-1)
    # Every session in a group of its own: nothing to compare with.
    alone = group_advantages(rewards, non_tensor_values(batch, "session_uid"), rows)
    assert alone.tolist() == [0.0] * len(rewards)
    split = ["g"] * len(rewards)
    split[2] = "h"  # a segment of session "won" in another group
    with pytest.raises(BatchError, match="session grpo/won has rows in two groups"):
        group_advantages(rewards, split, rows)


def test_session_balanced_weights_each_row_by_one_over_its_sessions_rows(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The first epoch's loss is the clipped objective on advantages times 1 / (rows of the
    session): 1/6 on the six rows of "won", 1 elsewhere."""
    batch = assemble_padded(segmented_group())
    weights = rows_of(batch).balanced_weights()
    assert weights.tolist() == pytest.approx([1 / WON_SEGMENTS] * WON_SEGMENTS + [1.0] * 3)
    for balanced in (False, True):
        settings = ReferenceTrainerSettings(
            model_dir=tiny_model_dir,
            checkpoint_dir=tmp_path / str(balanced),
            run="grpo",
            session_balanced=balanced,
        )
        trainer = ReferenceTrainer(settings)
        advantages = torch.tensor(
            [SESSION_ADVANTAGE[s] for s in non_tensor_values(batch, "session")]
        )
        if balanced:
            advantages = advantages * torch.from_numpy(weights)
        with torch.no_grad():
            log_probs = response_log_probs(trainer.model, batch)
            expected, _ = clipped_objective(
                log_probs,
                batch["rollout_log_probs"],
                advantages,
                batch["response_mask"].float(),
                settings.clip,
            )
        report = trainer.train_step(batch)
        assert report.loss == pytest.approx(float(expected), rel=1e-4, abs=1e-6)


@pytest.mark.parametrize(
    ("log_ratio", "advantage", "loss", "clipped"),
    [
        (0.0, 1.0, -1.0, 0.0),  # on-policy: the ratio is 1
        (math.log(1.5), 1.0, -1.2, 1.0),  # a good token made much likelier: clipped at 1 + eps
        (math.log(1.5), -1.0, 1.5, 0.0),  # a bad one made likelier: never clipped, full penalty
        (math.log(0.5), -1.0, 0.8, 1.0),  # a bad one made rarer: clipped at 1 - eps
    ],
)
def test_the_clipped_objective(
    log_ratio: float, advantage: float, loss: float, clipped: float
) -> None:
    old = torch.tensor([[-2.0, -1.0, 0.0]])
    new = old + log_ratio
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # the last column is padding: ignored
    new[0, 2] = 100.0
    got, fraction = clipped_objective(new, old, torch.tensor([advantage]), mask, clip=0.2)
    assert float(got) == pytest.approx(loss, 1e-5)
    assert float(fraction) == clipped


def test_no_agreement_is_claimed_on_no_token() -> None:
    zeros = torch.zeros(2, 3)
    assert max_logprob_delta(zeros, zeros + 1, torch.zeros(2, 3, dtype=torch.bool)) is None


async def test_recomputed_log_probs_match_the_local_backends_on_a_padded_batch(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Prompts and responses of different lengths (left and right padding), sampled at a
    temperature: the padded full forward agrees with the backend's KV-cached decode."""
    backend = LocalBackend.load(tiny_model_dir)
    trajectories = []
    for i in range(4):
        prompt = [257, *f"user\nhello{'!' * 5 * i}".encode(), 258, 10, 257, *b"assistant\n"]
        params = SamplingParams(max_tokens=6 + 4 * i, temperature=0.7, seed=i)
        completion: list[int] = []
        logprobs: list[float] = []
        async for chunk in backend.generate(Prompt(prompt), params):
            completion += chunk.token_ids
            logprobs += chunk.logprobs
        n, p = len(prompt) + len(completion), len(prompt)
        trajectories.append(
            TrajectoryReady(
                run="r",
                session=f"s{i}",
                trajectory_id=f"r/s{i}/0",
                group="g",
                segment=0,
                status="completed",
                input_ids=np.array(prompt + completion),
                loss_mask=np.array([0] * p + [1] * len(completion)),
                logprobs=np.array([0.0] * p + logprobs),
                versions=np.array([-1] * p + [0] * len(completion)),
                prompt_len=p,
                turn_ends=np.array([n]),
                turn_rewards=[None],
                reward=float(i % 2),
                num_turns=1,
                finish_reason="length",
                messages=[],
                metadata={},
                fold_version=2,
            )
        )
    await backend.close()
    batch = assemble_padded(trajectories)
    settings = ReferenceTrainerSettings(
        model_dir=tiny_model_dir, checkpoint_dir=tmp_path, run="r", temperature=0.7
    )
    trainer = ReferenceTrainer(settings)
    with torch.no_grad():
        log_probs = response_log_probs(trainer.model, batch, settings.temperature)
        untempered = response_log_probs(trainer.model, batch, 1.0)
    mask = batch["response_mask"].bool()
    delta = max_logprob_delta(log_probs, batch["rollout_log_probs"], mask)
    assert delta is not None and delta <= 1e-4
    # the temperature matters: forgetting it is caught
    assert (max_logprob_delta(untempered, batch["rollout_log_probs"], mask) or 0) > 1e-2

    report = trainer.train_step(batch)
    assert report.version == 1 and report.logprob_delta == delta
    assert (tmp_path / "v1" / "model.safetensors").is_file()


def test_samples_drawn_at_another_temperature_are_refused() -> None:
    events = session_events(append_only(2), session="hot")
    hot = [
        msgspec.structs.replace(e, sampling={"temperature": 1.0})
        if isinstance(e, TurnCompleted)
        else e
        for e in events
    ]
    [sample] = fold(hot).trajectories
    assert sample.metadata["temperatures"] == [1.0]
    check_temperature([sample], 0.8)  # fold v7: each turn's sampling, recomputed at its own
    del sample.metadata["sampling"]  # a row folded before v7: the trainer's temperature
    check_temperature([sample], 1.0)
    check_temperature([sample], 0.0)  # greedy records the raw logits: temperature 1
    with pytest.raises(BatchError, match=r"sampled at temperature 1\.0 .* at 0\.8"):
        check_temperature([sample], 0.8)
    [unknown] = fold(events).trajectories  # no temperature recorded: nothing to check
    check_temperature([unknown], 0.8)


def test_a_batch_holding_raw_log_probs_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Issue 19: turns recorded with the model's raw log-probs (the gateway's
    --allow-raw-logprobs against a vLLM in its default mode) are flagged by the sink; the
    trainer takes no importance ratio against them and says what to change."""
    events = session_events(append_only(2), session="raw")
    raw = [
        msgspec.structs.replace(e, logprobs_kind="raw") if isinstance(e, TurnCompleted) else e
        for e in events
    ]
    [flagged] = fold(raw).trajectories
    [clean] = fold(session_events(append_only(2), session="clean")).trajectories
    check_sampled_logprobs(assemble_padded([clean]))
    batch = assemble_padded([clean, flagged])
    refusal = r"trajectory run-1/raw/0: .*raw.*--logprobs-mode processed_logprobs"
    with pytest.raises(BatchError, match=refusal):
        check_sampled_logprobs(batch)
    settings = ReferenceTrainerSettings(model_dir=tiny_model_dir, checkpoint_dir=tmp_path, run="r")
    with pytest.raises(BatchError, match=refusal):
        ReferenceTrainer(settings).train_step(batch)
    assert not (tmp_path / "v1").exists()  # nothing trained, nothing published
    # A batch made before the flag existed has nothing to refuse.
    del batch["raw_logprobs"]
    check_sampled_logprobs(batch)


async def test_recomputed_log_probs_apply_each_turns_nucleus(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Issue 38: sampled at top_p 0.9 (and, in a later turn, at another temperature and top-p,
    or greedy), the trainer's recomputed log-probs agree with the recorded ones per token; with
    the nucleus left out (a trainer that knows no top-p) they are off by log(nucleus mass)."""
    trajectories = await sampled_sessions(
        tiny_model_dir,
        [
            [(0.8, 0.9)],
            [(0.8, 0.9), (1.3, 0.7)],
            [(0.8, 0.9), (0.0, 0.5)],  # greedy: raw log-probs whatever top_p
            [(1e-6, 0.3)],  # greedy as vLLM has it
        ],
    )
    assert [t.metadata["sampling"][-1]["top_p"] for t in trajectories] == [0.9, 0.7, 0.5, 0.3]
    batch = assemble_padded(trajectories)
    settings = ReferenceTrainerSettings(model_dir=tiny_model_dir, checkpoint_dir=tmp_path, run="r")
    trainer = ReferenceTrainer(settings)
    mask = batch["response_mask"].bool()
    with torch.no_grad():
        log_probs = response_log_probs(trainer.model, batch, settings.temperature)
        # what the trainer computed before: every row at one temperature, no nucleus
        del batch["rollout_top_p"]
        batch["rollout_temperature"] = torch.full_like(batch["rollout_log_probs"], 0.8)
        no_nucleus = response_log_probs(trainer.model, batch, settings.temperature)
    delta = max_logprob_delta(log_probs, batch["rollout_log_probs"], mask)
    assert delta is not None and delta <= 1e-4
    first = mask[0]  # the first session: one turn at 0.8 / 0.9, off by the nucleus' mass
    off = (no_nucleus[0] - batch["rollout_log_probs"][0])[first]
    assert float(off.abs().max()) > 1e-2
    assert not bool(off.gt(1e-4).any())  # log(the nucleus' mass) at each token: <= 0


def test_samples_drawn_with_top_k_or_min_p_are_refused() -> None:
    """The gateway sets neither; a record from elsewhere might: refused, naming the setting."""
    events = session_events(append_only(2), session="topk")
    sampled = [
        msgspec.structs.replace(e, sampling={"temperature": 0.7, "top_k": 20 * e.turn})
        if isinstance(e, TurnCompleted)
        else e
        for e in events
    ]
    [sample] = fold(sampled).trajectories
    with pytest.raises(BatchError, match=r"run-1/topk/0 \(its turn 1\) .* top_k=20"):
        check_sampling([sample])
    greedy = [
        msgspec.structs.replace(e, sampling={"temperature": 0.0, "min_p": 0.1})
        if isinstance(e, TurnCompleted)
        else e
        for e in events
    ]
    check_sampling(fold(greedy).trajectories)  # greedy: vLLM turns min_p off
    check_temperature(fold(sampled).trajectories, 1.0)  # each turn records its own: no check
