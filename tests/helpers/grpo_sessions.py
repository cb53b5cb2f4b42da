"""One GRPO group of four sessions, one of them six segments long (issue 18, point 3).

Session ``won`` (reward 1) restarts its conversation at every turn (sub-agents: each turn's
prompt shares only the system prompt with the context before it), so the fold makes six
segments of it; ``lost-0..2`` (reward 0) are one turn each. Counted by rows the group is
[1]*6 + [0]*3: baseline 0.67, advantage 0.67; counted by sessions it is [1, 0, 0, 0]: baseline
0.25, advantage (1 - 0.25) / 0.5 = 1.5 for ``won`` and -0.5 for the others.
"""

from __future__ import annotations

from typing import Literal

from consumers import FoldOptions, fold
from schemas.events import TrajectoryReady
from tests.helpers.sessions import TurnSpec, append_only, session_events

RUN = "grpo"
GROUP = "g"
WON_SEGMENTS = 6
SESSION_ADVANTAGE = {"won": 1.5, "lost-0": -0.5, "lost-1": -0.5, "lost-2": -0.5}


def _sub_agents(turns: int) -> list[TurnSpec]:
    """Turns that each start a fresh conversation after a shared system prompt (1, 2, 3)."""
    return [
        TurnSpec(
            prompt=[1, 2, 3, 100 + t],
            completion=[10 * t + 1, 10 * t + 2, 10 * t + 3][: 1 + t % 3],
            messages=[{"role": "user", "content": f"task {t}"}],
            text=f"reply {t}",
        )
        for t in range(turns)
    ]


def segmented_group(
    final_reward_scope: Literal["last", "all"] = "all",
) -> list[TrajectoryReady]:
    """The group's nine trajectories, folded with ``final_reward_scope``."""
    options = FoldOptions(final_reward_scope=final_reward_scope)
    won = session_events(
        _sub_agents(WON_SEGMENTS), run=RUN, session="won", group=GROUP, final_reward=1.0
    )
    trajectories = fold(won, options).trajectories
    assert len(trajectories) == WON_SEGMENTS, [t.trajectory_id for t in trajectories]
    for i in range(3):
        lost = session_events(
            append_only(1), run=RUN, session=f"lost-{i}", group=GROUP, final_reward=0.0
        )
        trajectories += fold(lost, options).trajectories
    return trajectories
