"""Sessions sampled by the local backend on the real tiny model and folded: rollout log-probs a
trainer recomputing them must reproduce (issue 38: each turn at its own temperature and top-p).

Each turn is recorded as the gateway records it (``TurnCompleted.sampling`` with the turn's
temperature and top_p), the session folded by today's fold; no NATS, no gateway process.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from consumers import fold
from gateway.backends.interface import Prompt, SamplingParams
from gateway.backends.local import LocalBackend
from schemas.events import (
    SessionClosed,
    SessionEvent,
    SessionOpened,
    TrajectoryReady,
    TurnCompleted,
)

__all__ = ["Sampling", "sampled_sessions"]

Sampling = tuple[float, float]  # (temperature, top_p) of one turn


def _user_turn(session: int, turn: int) -> list[int]:
    """The tiny model's chat template around a short user message (byte-level ids)."""
    text = f"user\nhello {session}.{turn}{'!' * 3 * session}".encode()
    return [257, *text, 258, 10, 257, *b"assistant\n"]


async def sampled_sessions(
    model_dir: Path, sessions: Sequence[Sequence[Sampling]], *, run: str = "r", group: str = "g"
) -> list[TrajectoryReady]:
    """One session per entry of ``sessions``, one turn per (temperature, top_p) in it, all in
    ``group``: each turn's prompt is the session's context so far and a new user message, its
    completion drawn by the local backend (weight version 0, a seed per turn). Rewards 0, 1, 0,
    ... by session. The trajectories the fold makes of them, in order."""
    backend = LocalBackend.load(model_dir)
    trajectories: list[TrajectoryReady] = []
    try:
        for index, turns in enumerate(sessions):
            session = f"s{index}"
            events: list[SessionEvent] = [SessionOpened(run=run, session=session, group=group)]
            context: list[int] = []
            for turn, (temperature, top_p) in enumerate(turns):
                new = _user_turn(index, turn)
                params = SamplingParams(
                    max_tokens=6 + 3 * index,
                    temperature=temperature,
                    top_p=top_p,
                    seed=100 * index + turn,
                )
                completion: list[int] = []
                logprobs: list[float] = []
                async for chunk in backend.generate(Prompt(context + new), params):
                    completion += chunk.token_ids
                    logprobs += chunk.logprobs
                events.append(
                    TurnCompleted(
                        run=run,
                        session=session,
                        turn=turn,
                        prefix_len=len(context),
                        prompt_ids=np.asarray(new, np.int32),
                        completion_ids=np.asarray(completion, np.int32),
                        logprobs=np.asarray(logprobs, np.float32),
                        sampling={"temperature": temperature, "top_p": top_p, "max_tokens": 16},
                    )
                )
                context = context + new + completion
            reward = float(index % 2)
            events.append(
                SessionClosed(run=run, session=session, reward=reward, num_turns=len(turns))
            )
            trajectories += fold(events).trajectories
    finally:
        await backend.close()
    return trajectories
