"""Folded sessions of a coding agent with sub-agents (issue 35): Claude Code's background shape.

``claude_code_session`` is main spawning a fork and a fresh sub-agent in one reply, each taking
two turns while main goes on, and (``side``) a compaction request on main's context: four
trajectories, main / fork / fresh / the side call, with the metadata the fold gives them.
"""

from __future__ import annotations

from typing import Literal

from consumers import FoldOptions, fold
from schemas.events import JSON, SessionEvent, TrajectoryReady
from tests.helpers.sessions import closed, opened
from tests.helpers.tree_sessions import TreeTurn, tree_events

SYS = [1, 2, 3]


def agent(agent_id: str, **fields: str) -> JSON:
    """``TurnCompleted.agent`` as the gateway records it."""
    return {"id": agent_id, "source": "claude_code", **fields}


MAIN = agent("main", kind="main", resolved_kind="main", request_class="main")
FORK = agent("a9e64a5ca0980ef44", parent="main", kind="fork", resolved_kind="fork", type="fork")
FRESH = agent(
    "adfda152c31bc96cc", parent="main", kind="fresh", resolved_kind="fresh", type="general-purpose"
)
COMPACTION = {**MAIN, "request_class": "compaction"}


def _turn(parent: int, prompt: list[int], completion: list[int], who: JSON) -> TreeTurn:
    return TreeTurn(
        parent,
        prompt,
        completion,
        [{"role": "user", "content": f"turn under {parent}"}],
        text="reply",
        extra={"agent": who},
    )


def claude_code_turns(*, side: bool = True) -> list[TreeTurn]:
    main0 = _turn(-1, [*SYS, 10], [40, 41, 42], MAIN)
    fork1 = _turn(0, [*SYS, 10, 41, 50], [51, 52], FORK)
    fresh2 = _turn(0, [7, 8, 20], [21], FRESH)
    main3 = _turn(0, [*main0.context, 60], [61], MAIN)
    fork4 = _turn(1, [*fork1.context, 53], [54], FORK)
    fresh5 = _turn(2, [*fresh2.context, 22], [23], FRESH)
    turns = [main0, fork1, fresh2, main3, fork4, fresh5]
    if side:
        turns.append(_turn(3, [*main3.context, 90], [91, 92], COMPACTION))
    return turns


def claude_code_session(
    run: str,
    session: str,
    reward: float,
    *,
    group: str = "g",
    side: bool = True,
    final_reward_scope: Literal["last", "all"] = "all",
) -> list[TrajectoryReady]:
    """The session's trajectories: main, the fork, the fresh agent (and the side call)."""
    turns = claude_code_turns(side=side)
    events: list[SessionEvent] = [
        opened(run=run, session=session, group=group),
        *tree_events(turns, run=run, session=session),
        closed(run=run, session=session, reward=reward, num_turns=len(turns)),
    ]
    return fold(events, FoldOptions(final_reward_scope=final_reward_scope)).trajectories
