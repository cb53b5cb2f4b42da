"""The reference trainer's math (pure: tensors in, tensors out), meant to be read.

**GRPO over sessions.** A session may be several rows (segments: sub-agents, forks), all with
one ``session_uid``. The group's baseline is taken over its *sessions*, one reward each (its last
segment's: ``trainer_sink.sessions``), and each row gets its session's advantage: a 6-segment
session with reward 1 among three 1-row sessions with 0 gets 1.5 on all six rows (sessions
[1, 0, 0, 0]), not the 0.67 of nine rows [1]*6 + [0]*3. By default each row then weighs like any
other row in the loss (token-mean), so that session's tokens count six times; with
``session_balanced`` each row's loss is weighted by 1 / (rows of its session), applied to its
advantage (the clipped objective is linear in it for a positive weight: the clip fraction does
not change). docs/verl.md says what verl's loss aggregation modes make of such a weight.

**PPO.** ``algorithm="ppo"`` is the same clipped objective with advantages normalized over the
batch instead of per group: PPO without a critic (the batch mean is the baseline). A value model
and GAE are out of scope for a reference.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch
from tensordict import TensorDict
from transformers import PreTrainedModel

from gateway.backends.sampler import processed_log_probs
from schemas.events import TrajectoryReady
from schemas.sampling import TurnSampling, is_greedy
from trainer_sink.assembly import non_tensor_values
from trainer_sink.errors import BatchError
from trainer_sink.sessions import SessionRows

__all__ = [
    "batch_advantages",
    "check_sampled_logprobs",
    "check_sampling",
    "check_temperature",
    "clipped_objective",
    "group_advantages",
    "max_logprob_delta",
    "response_log_probs",
    "response_logits",
    "token_sampling",
]


def response_log_probs(
    model: PreTrainedModel, batch: TensorDict, temperature: float = 1.0
) -> torch.Tensor:
    """[B, R] log-probs of ``responses`` under ``model``, as the backend recorded them: each
    token's under the distribution it was drawn from, its turn's temperature and top-p (the
    batch's ``rollout_temperature`` / ``rollout_top_p``) with the nucleus cut as the gateway's
    sampler cuts it (``gateway.backends.sampler.processed_log_probs``; greedy: raw). Where the
    batch recorded none (rows folded before fold v7, a batch without those keys), at
    ``temperature`` and top-p 1, as before.

    """
    temperatures, top_ps = token_sampling(batch, temperature)
    log_probs = processed_log_probs(response_logits(model, batch), temperatures, top_ps)
    return log_probs.gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)


def response_logits(model: PreTrainedModel, batch: TensorDict) -> torch.Tensor:
    """[B, R, vocab] float32: the untempered logits that predict each response token.

    One forward pass over ``input_ids`` with the batch's ``attention_mask`` and
    ``position_ids``: positions count from the first real token whatever the left padding,
    like the gateway's unpadded prompt. The logits at column P-1+j predict response token j.
    A batch with images (``trainer_sink.vision``) also gives the model its images' pixels
    (``multi_modal_inputs`` joined in sample order, as verl's ``extract_multi_modal_inputs``
    joins them) and its M-RoPE positions ([B, 4, L], the model takes them [4, B, L]).
    """
    prompt_width = batch["prompts"].shape[1]
    position_ids = batch["position_ids"]
    images: dict[str, torch.Tensor] = {}
    if position_ids.dim() == 3:
        position_ids = position_ids.transpose(0, 1)
        images = _image_inputs(batch)
    logits: torch.Tensor = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=position_ids,
        use_cache=False,
        **images,
    ).logits
    return logits[:, prompt_width - 1 : -1].float()


def _image_inputs(batch: TensorDict) -> dict[str, torch.Tensor]:
    """The batch's pixels and patch grids, its samples' images in order."""
    per_sample = [x for x in non_tensor_values(batch, "multi_modal_inputs") if x]
    device = batch["input_ids"].device
    return {
        key: torch.cat([x[key] for x in per_sample]).to(device)
        for key in ("pixel_values", "image_grid_thw")
        if per_sample
    }


def token_sampling(batch: TensorDict, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, R] temperature and top-p of each response token: the batch's, and where it has
    none (NaN: not recorded) ``temperature`` and 1."""
    shape, device = batch["responses"].shape, batch["responses"].device
    keys = batch.keys()
    if "rollout_temperature" not in keys or "rollout_top_p" not in keys:
        return (
            torch.full(shape, float(temperature), device=device),
            torch.ones(shape, device=device),
        )
    temperatures = batch["rollout_temperature"]
    top_ps = batch["rollout_top_p"]
    return (
        torch.where(temperatures.isnan(), float(temperature), temperatures),
        torch.where(top_ps.isnan(), 1.0, top_ps),
    )


def group_advantages(
    rewards: torch.Tensor,
    groups: Sequence[str],
    sessions: SessionRows | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO over sessions: ``(R - mean(R_group)) / (std(R_group) + eps)`` with one reward R per
    session (the reward of its last row, ``sessions.last``), the unbiased std (as verl), and
    each row given its session's advantage. ``sessions`` None: each row is its own session.
    A session alone in its group has nothing to be compared with: advantage 0.

    >>> rows = SessionRows.of(["r/a"] * 6 + ["r/b", "r/c", "r/d"],
    ...                       [f"r/a/{i}" for i in range(6)] + ["r/b/0", "r/c/0", "r/d/0"])
    >>> rewards = torch.tensor([1.0] * 6 + [0.0] * 3)
    >>> [round(a, 4) for a in group_advantages(rewards, ["g"] * 9, rows).tolist()]
    [1.5, 1.5, 1.5, 1.5, 1.5, 1.5, -0.5, -0.5, -0.5]
    >>> round(float(group_advantages(rewards, ["g"] * 9)[0]), 2)  # rows, not sessions
    0.67
    """
    if sessions is None:
        return _advantages_per_group(rewards, groups, eps)
    last = sessions.last.tolist()
    session_groups = [groups[row] for row in last]
    for row, session in enumerate(sessions.session.tolist()):
        if groups[row] != session_groups[session]:
            raise BatchError(
                f"session {sessions.uids[session]} has rows in two groups, "
                f"{session_groups[session]!r} and {groups[row]!r}: a session belongs to one "
                f"GRPO group; batch its trajectories with the sink's batcher (one uid per session)"
            )
    per_session = _advantages_per_group(rewards[last], session_groups, eps)
    return sessions.broadcast(per_session)


def _advantages_per_group(rewards: torch.Tensor, groups: Sequence[str], eps: float) -> torch.Tensor:
    members: dict[str, list[int]] = defaultdict(list)
    for i, group in enumerate(groups):
        members[group].append(i)
    advantages = torch.zeros_like(rewards)
    for index in members.values():
        if len(index) > 1:
            r = rewards[index]
            advantages[index] = (r - r.mean()) / (r.std() + eps)
    return advantages


def batch_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """PPO without a critic: the batch is the baseline."""
    if rewards.numel() < 2:
        return torch.zeros_like(rewards)
    return (rewards - rewards.mean()) / (rewards.std() + eps)


def clipped_objective(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate as a loss, averaged over the masked tokens (verl's
    "token-mean"), and the fraction of those tokens whose ratio was clipped.

    ``advantages`` is [B] (one per sample, spread over its tokens); the rest are [B, R].
    """
    # Masked tokens (padding, tool output) must not reach exp: their old log-prob is a 0
    # placeholder. The clamp (verl's) keeps a far off-policy token from overflowing to inf.
    log_ratio = torch.where(mask > 0, log_probs - old_log_probs, 0.0).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    advantage = advantages.unsqueeze(-1)
    unclipped = ratio * advantage
    clipped = ratio.clamp(1 - clip, 1 + clip) * advantage
    per_token = -torch.minimum(unclipped, clipped)
    tokens = mask.sum().clamp(min=1)
    loss = (per_token * mask).sum() / tokens
    clip_fraction = ((clipped < unclipped).float() * mask).sum() / tokens
    return loss, clip_fraction


def _effective(temperature: float | None) -> float:
    # Greedy decoding records the raw logits' log-probs: temperature 1 for the computation.
    return 1.0 if temperature is None or is_greedy(temperature) else float(temperature)


def check_temperature(trajectories: Sequence[TrajectoryReady], temperature: float) -> None:
    """Refuse samples drawn at another temperature than the trainer computes log-probs at:
    the ratio against ``rollout_log_probs`` would be wrong by a factor nobody would notice.
    Only rows that do not record each turn's sampling (folded before fold v7) are computed at
    the trainer's ``temperature``; the others at their own, so they need no check."""
    want = _effective(temperature)
    for trajectory in trajectories:
        if "sampling" in trajectory.metadata:
            continue
        for recorded in trajectory.metadata.get("temperatures", []):
            if abs(_effective(recorded) - want) > 1e-6:
                raise BatchError(
                    f"trajectory {trajectory.trajectory_id} was sampled at temperature "
                    f"{recorded} but the trainer computes log-probs at {temperature}: set "
                    f"ReferenceTrainerSettings.temperature to the agents' sampling temperature"
                )


def check_sampling(trajectories: Sequence[TrajectoryReady]) -> None:
    """Refuse samples drawn with a setting whose distribution the trainer does not recompute
    (top_k, min_p: the gateway sets neither, a record from elsewhere might), naming it: their
    importance ratios would be wrong."""
    for trajectory in trajectories:
        entries = trajectory.metadata.get("sampling")
        for turn, entry in enumerate(entries if isinstance(entries, list) else []):
            setting = TurnSampling.of(entry).unsupported() if isinstance(entry, dict) else None
            if setting is not None:
                raise BatchError(
                    f"trajectory {trajectory.trajectory_id} (its turn {turn}) was sampled with "
                    f"{setting}, which the reference trainer does not apply when it recomputes "
                    f"log-probs (it applies temperature and top_p): leave these samples out of "
                    f"its batches, or sample without {setting.partition('=')[0]}"
                )


def check_sampled_logprobs(batch: TensorDict) -> None:
    """Refuse a batch holding samples flagged ``raw_logprobs``: their ``rollout_log_probs``
    are the model's raw distribution's, not the one the tokens were drawn from, and every
    importance ratio against them would be off by the temperature and top-p nobody sees."""
    if "raw_logprobs" not in batch.keys():  # noqa: SIM118  # older tensordict: no `in`
        return
    flagged = batch["raw_logprobs"].nonzero().flatten().tolist()
    if not flagged:
        return
    ids = non_tensor_values(batch, "trajectory_id")
    named = ", ".join(ids[i] for i in flagged[:5])
    more = f" and {len(flagged) - 5} more" if len(flagged) > 5 else ""
    which = f"trajectory {named}" if len(flagged) == 1 else f"trajectories {named}{more}"
    raise BatchError(
        f"{which}: recorded with raw log-probs (logprobs_kind 'raw': a vLLM replica in its "
        f"default --logprobs-mode, let through by the gateway's --allow-raw-logprobs; or "
        f"'imported': `turnstream import-atif`'s, of a policy not this run's), "
        f"not those of the distribution the tokens were sampled from: importance ratios against "
        f"them would be wrong. Serve vLLM with --logprobs-mode processed_logprobs and drop "
        f"--allow-raw-logprobs, or leave these samples out of the trainer's batches"
    )


def max_logprob_delta(
    log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor
) -> float | None:
    """max |log_probs - rollout_log_probs| where ``mask``; None where nothing is masked in."""
    if not bool(mask.any()):
        return None
    return float((log_probs - rollout_log_probs).abs()[mask].max())
