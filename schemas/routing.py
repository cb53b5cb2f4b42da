"""Where each event goes: its subject and its deterministic Nats-Msg-Id (DESIGN §3)."""

from __future__ import annotations

from typing import NamedTuple

from schemas.events import (
    CompactTrajectory,
    Event,
    RewardAssigned,
    SessionClosed,
    SessionOpened,
    TrajectoryReady,
    TurnCompleted,
)
from schemas.ids import (
    close_msg_id,
    event_subject,
    open_msg_id,
    reward_msg_id,
    traj_subject,
    turn_msg_id,
)

__all__ = ["Route", "route"]


class Route(NamedTuple):
    subject: str
    msg_id: str


def route(event: Event) -> Route:
    run, session = event.run, event.session
    if isinstance(event, TurnCompleted):
        return Route(event_subject(run, session, "turn"), turn_msg_id(run, session, event.turn))
    if isinstance(event, SessionOpened):
        return Route(event_subject(run, session, "open"), open_msg_id(run, session))
    if isinstance(event, RewardAssigned):
        return Route(
            event_subject(run, session, "reward"),
            reward_msg_id(run, session, event.key, event.turn),
        )
    if isinstance(event, SessionClosed):
        return Route(event_subject(run, session, "close"), close_msg_id(run, session))
    if isinstance(event, TrajectoryReady | CompactTrajectory):
        return Route(traj_subject(run), event.trajectory_id)
    raise TypeError(f"no route for {type(event).__name__}")
