"""Realistic TrajectoryReady events for the shard writer and the sink: folded test sessions."""

from __future__ import annotations

from consumers import fold
from schemas.events import TrajectoryReady
from tests.helpers.sessions import append_only, reward, session_events


def folded(
    run: str,
    session: str,
    *,
    turns: int = 3,
    final_reward: float | None = 1.0,
    turn_reward: float | None = None,
    group: str | None = None,
    created_at: float = 1_700_000_000.25,
) -> TrajectoryReady:
    """The one trajectory of an append-only session of ``turns`` turns."""
    rewards = [] if turn_reward is None else [reward(turn_reward, turn=0, run=run, session=session)]
    events = session_events(
        append_only(turns),
        run=run,
        session=session,
        group=group,
        metadata={"task": f"task-{session}", "env": {"seed": len(session)}},
        rewards=rewards,
        final_reward=final_reward,
        created_at=created_at,
    )
    [trajectory] = fold(events).trajectories
    return trajectory


def many(count: int, runs: tuple[str, ...] = ("run-a", "run-b", "run-c")) -> list[TrajectoryReady]:
    """``count`` trajectories spread round-robin over ``runs``, of 1 to 4 turns."""
    return [
        folded(runs[i % len(runs)], f"s{i}", turns=1 + i % 4, final_reward=None if i % 5 else 0.5)
        for i in range(count)
    ]
