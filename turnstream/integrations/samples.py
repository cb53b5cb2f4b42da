"""The training sample an episode becomes, in the fields RL frameworks' agent loops return.

``rollout_sample`` turns an episode into one training sample (prompt ids, response ids, response
mask, rollout log-probs, reward, turns, extra fields), by these rules:

- **Forks.** A session may fold into several segments (a turn that does not continue the
  conversation before it: history dropped, rewritten, summarized). A framework takes ONE sample
  per prompt rollout, so the sample is the *final* segment, the one holding the episode's last
  turn and its reward; the others are named in ``turnstream_dropped_segments`` and counted in
  ``turnstream_forks``. They stay in the shards for offline use. A side request's segment (a
  coding agent's compaction call: metadata ``side``) is never the sample: the final segment is
  the last one that is not, as the fold's ``final_reward_scope="last"`` rewards it.
- **Failures.** An agent that raised, timed out, returned no finite reward or never called the
  model gives a sample that trains nothing: its response mask is all 0 and its reward
  ``failure_reward`` (0.0), with the error in ``turnstream_error``. Its tokens are what the log
  holds of the aborted session (``failed_sample`` makes one from the prompt when the agent made
  no turn). A framework may prefer to raise instead (``TurnstreamAgentLoop``'s
  ``on_agent_error``).
- **Lengths.** A framework pads to fixed prompt and response lengths and fails on longer ones, so
  a longer sample is cut as verl's own agent loops cut theirs: the prompt keeps its last
  ``prompt_length`` tokens, the response its first ``response_length``, with a warning and
  ``turnstream_truncated`` set. The shards keep the whole trajectory.

Extra fields, the same keys on every sample (a framework stacks them into batch columns):
``min_global_steps`` / ``max_global_steps`` (the oldest and newest weight version that generated
a token; verl's names for them, -1 when none), ``turnstream_trajectory_id``,
``turnstream_session_id``, ``turnstream_forks``, ``turnstream_dropped_segments``,
``turnstream_status`` (the session's close status), ``turnstream_error`` (None: the agent
finished), ``turnstream_truncated``.

``num_turns`` is turnstream's count: the model calls in the returned segment (verl's own loops
count chat messages, user and tool ones included).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from schemas.agents import is_side_call
from turnstream.integrations.errors import AgentFailed
from turnstream.integrations.rollouts import Episode

__all__ = ["EXTRA_FIELDS", "RolloutSample", "failed_sample", "rollout_sample"]

log = logging.getLogger(__name__)

EXTRA_FIELDS = (
    "min_global_steps",
    "max_global_steps",
    "turnstream_trajectory_id",
    "turnstream_session_id",
    "turnstream_forks",
    "turnstream_dropped_segments",
    "turnstream_status",
    "turnstream_error",
    "turnstream_truncated",
)


@dataclass(frozen=True)
class RolloutSample:
    """One training sample, in the fields verl's ``AgentLoopOutput`` has."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: list[float]
    reward: float | None
    num_turns: int
    extra_fields: dict[str, Any]


def rollout_sample(
    episode: Episode,
    *,
    prompt_length: int | None = None,
    response_length: int | None = None,
    failure_reward: float = 0.0,
) -> RolloutSample | None:
    """The episode's training sample (module docstring); None when it has no trajectory (the
    agent made no turn: use ``failed_sample``)."""
    if not episode.trajectories:
        return None
    final = next(
        (t for t in reversed(episode.trajectories) if not is_side_call(t.metadata)),
        episode.trajectories[-1],
    )
    error = episode.error
    if error is None and final.reward is None:
        error = AgentFailed(f"trajectory {final.trajectory_id} carries no reward")
    p = final.prompt_len
    prompt = final.input_ids[:p].tolist()
    response = final.input_ids[p:].tolist()
    mask = final.loss_mask[p:].tolist()
    logprobs = final.logprobs[p:].tolist()
    truncated = False
    if prompt_length is not None and len(prompt) > prompt_length:
        prompt, truncated = prompt[len(prompt) - prompt_length :], True
    if response_length is not None and len(response) > response_length:
        response, mask, logprobs = (x[:response_length] for x in (response, mask, logprobs))
        truncated = True
    if truncated:
        log.warning(
            "trajectory %s (%d prompt + %d response tokens) is cut to the framework's %s prompt "
            "and %s response tokens; the shards keep it whole",
            final.trajectory_id,
            p,
            final.response_len,
            prompt_length,
            response_length,
        )
    if error is not None:
        mask = [0] * len(mask)
    forks = final.metadata.get("forks")
    return RolloutSample(
        prompt_ids=prompt,
        response_ids=response,
        response_mask=mask,
        response_logprobs=logprobs,
        reward=failure_reward if error is not None else final.reward,
        num_turns=final.num_turns,
        extra_fields={
            "min_global_steps": final.min_weight_version,
            "max_global_steps": final.max_weight_version,
            "turnstream_trajectory_id": final.trajectory_id,
            "turnstream_session_id": episode.session.session_id,
            "turnstream_forks": forks if isinstance(forks, int) else 0,
            "turnstream_dropped_segments": [
                t.trajectory_id for t in episode.trajectories if t is not final
            ],
            "turnstream_status": final.status,
            "turnstream_error": str(error) if error is not None else None,
            "turnstream_truncated": truncated,
        },
    )


def failed_sample(
    episode: Episode,
    prompt_ids: Sequence[int],
    *,
    pad_token_id: int,
    prompt_length: int | None = None,
    failure_reward: float = 0.0,
) -> RolloutSample:
    """A sample that trains nothing for an episode without a trajectory: the prompt as the
    framework renders it (``prompt_ids``), one padding token of response, masked."""
    prompt = list(prompt_ids)
    if prompt_length is not None and len(prompt) > prompt_length:
        prompt = prompt[len(prompt) - prompt_length :]
    error = episode.error or AgentFailed(f"session {episode.session.session_id} has no trajectory")
    return RolloutSample(
        prompt_ids=prompt,
        response_ids=[pad_token_id],
        response_mask=[0],
        response_logprobs=[0.0],
        reward=failure_reward,
        num_turns=0,
        extra_fields={
            "min_global_steps": -1,
            "max_global_steps": -1,
            "turnstream_trajectory_id": None,
            "turnstream_session_id": episode.session.session_id,
            "turnstream_forks": 0,
            "turnstream_dropped_segments": [],
            "turnstream_status": episode.status,
            "turnstream_error": str(error),
            "turnstream_truncated": False,
        },
    )
