"""A seeded mix of agent sessions for pipeline tests, with the trajectories each must become.

Sessions have 1-20 turns; some fork (a later prompt keeps only part of the history), some ask
for per-turn samples, some carry per-turn rewards, and some are never closed (the reaper must
close them as ``timeout``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from consumers.fold import FoldOptions, fold
from schemas.events import JSON, SessionEvent, TrajectoryReady
from tests.helpers.sessions import RUN, TurnSpec, closed, reward, session_events


@dataclass(frozen=True)
class PlannedSession:
    session: str
    events: list[SessionEvent]  # what the agent's gateway publishes (no close if reaped)
    reaped: bool
    per_turn: bool
    forks: int

    def expected(self) -> list[TrajectoryReady]:
        """What the pipeline must produce (a reaped session folds as if closed with timeout)."""
        events = self.events
        if self.reaped:
            turns = sum(1 for e in events if e.__class__.__name__ == "TurnCompleted")
            events = [*events, closed(session=self.session, status="timeout", num_turns=turns)]
        return fold(events, FoldOptions(per_turn=self.per_turn)).trajectories


def _specs(rng: random.Random, turns: int, fork_at: set[int]) -> list[TurnSpec]:
    specs: list[TurnSpec] = []
    context: list[int] = []
    history: list[JSON] = []
    for t in range(turns):
        new = [rng.randrange(300) for _ in range(rng.randint(1, 12))]
        if t in fork_at and context:
            prompt = [*context[: len(context) // 2], 299, *new]  # history summarized: a fork
            messages = [*history[:1], {"role": "user", "content": f"summary {t}"}]
        else:
            prompt = [*context, *new]
            messages = [*history, {"role": "tool" if t else "user", "content": f"obs {t}"}]
        completion = [rng.randrange(300) for _ in range(rng.randint(1, 10))]
        spec = TurnSpec(
            prompt=prompt,
            completion=completion,
            logprobs=[-rng.random() for _ in completion],
            messages=messages,
            text=f"reply {t}",
            weight_version=rng.randint(0, 3),
            finish_reason="tool_calls" if t < turns - 1 else "stop",
            created_at=float(t),
        )
        specs.append(spec)
        context = spec.context
        history = [*messages, spec.assistant_message]
    return specs


def plan_sessions(n: int, *, seed: int = 1, prefix: str = "p") -> list[PlannedSession]:
    rng = random.Random(seed)
    planned = []
    for i in range(n):
        session = f"{prefix}{i:04d}"
        turns = rng.randint(1, 20)
        fork_at = {t for t in range(1, turns) if rng.random() < 0.08}
        per_turn = rng.random() < 0.1
        reaped = rng.random() < 0.08
        specs = _specs(rng, turns, fork_at)
        rewards = [
            reward(float(rng.randint(-1, 1)), turn=t, key="step", session=session)
            for t in range(turns)
            if rng.random() < 0.2
        ]
        events = session_events(
            specs,
            run=RUN,
            session=session,
            group=f"g{i // 4}",
            metadata={"fold": {"per_turn": True}} if per_turn else None,
            rewards=rewards,
            close=not reaped,
            final_reward=float(i % 3) if not reaped else None,
        )
        planned.append(PlannedSession(session, events, reaped, per_turn, len(fork_at)))
    return planned
