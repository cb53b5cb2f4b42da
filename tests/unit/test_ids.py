"""Identifiers, subjects and the deterministic Msg-Id of every event (DESIGN §3)."""

from __future__ import annotations

import msgspec
import pytest

from schemas.errors import InvalidIdentifier
from schemas.events import (
    Event,
    RewardAssigned,
    SessionClosed,
    SessionOpened,
    TrajectoryReady,
    TurnCompleted,
)
from schemas.ids import (
    ID_PATTERN,
    dlq_subject,
    new_session_id,
    session_subjects,
    traj_subject,
    validate_id,
)
from schemas.routing import Route, route


@pytest.mark.parametrize(
    "value",
    [
        pytest.param("a", id="one-char"),
        pytest.param("x" * 64, id="64-chars"),
        pytest.param("Run_01-b", id="all-classes"),
        pytest.param("-_-", id="punctuation-only"),
        pytest.param("0", id="digit"),
        pytest.param("Hf3Qz8w_L2-9aXk1bYp0cA", id="base64url"),
    ],
)
def test_validate_id_accepts(value: str) -> None:
    assert validate_id(value, "run") == value


@pytest.mark.parametrize(
    "value",
    [
        pytest.param("", id="empty"),
        pytest.param("x" * 65, id="65-chars"),
        pytest.param("a.b", id="dot"),
        pytest.param("a*", id="star"),
        pytest.param(">", id="gt"),
        pytest.param("a b", id="space"),
        pytest.param("a\tb", id="tab"),
        pytest.param("ab\n", id="trailing-newline"),
        pytest.param("a/b", id="slash"),
        pytest.param("a:b", id="colon"),
        pytest.param("café", id="non-ascii"),
        pytest.param("ａｂ", id="fullwidth"),
        pytest.param(None, id="none"),
        pytest.param(12, id="int"),
        pytest.param(b"ab", id="bytes"),
    ],
)
def test_validate_id_rejects_naming_the_field_and_pattern(value: object) -> None:
    with pytest.raises(InvalidIdentifier) as caught:
        validate_id(value, "session")

    assert caught.value.field == "session" and caught.value.value == value
    assert f"session={value!r}" in str(caught.value)
    assert ID_PATTERN in str(caught.value)


def test_validate_id_names_a_default_field() -> None:
    with pytest.raises(InvalidIdentifier, match=r"^id='a\.b'"):
        validate_id("a.b")


def test_new_session_ids_are_valid_distinct_and_carry_128_bits() -> None:
    ids = [new_session_id() for _ in range(1_000)]

    assert len(set(ids)) == len(ids)
    for session in ids:
        assert validate_id(session, "session") == session
        assert len(session) >= 22  # 22 base64url chars = 132 bits >= 128


TURN = TurnCompleted(
    run="r", session="s", turn=3, prompt_ids=[1], completion_ids=[2], logprobs=[-0.5]
)
TRAJ = TrajectoryReady(
    run="r",
    session="s",
    trajectory_id="s-seg-1",
    group="g",
    segment=1,
    status="completed",
    input_ids=[1, 2],
    loss_mask=[0, 1],
    logprobs=[0.0, -0.5],
    versions=[-1, 0],
    prompt_len=1,
    turn_ends=[2],
    turn_rewards=[None],
    reward=None,
    num_turns=1,
    finish_reason="stop",
    messages=[],
    metadata={},
    fold_version=1,
)


@pytest.mark.parametrize(
    ("event", "subject", "msg_id"),
    [
        pytest.param(SessionOpened(run="r", session="s"), "ts.ev.r.s.open", "r.s.open", id="open"),
        pytest.param(TURN, "ts.ev.r.s.turn", "r.s.turn.3", id="turn-3"),
        pytest.param(
            TurnCompleted(
                run="run-1", session="S_9", turn=0, prompt_ids=[], completion_ids=[], logprobs=[]
            ),
            "ts.ev.run-1.S_9.turn",
            "run-1.S_9.turn.0",
            id="turn-0",
        ),
        pytest.param(
            RewardAssigned(run="r", session="s", value=1.0),
            "ts.ev.r.s.reward",
            "r.s.reward.default.episode",
            id="reward-episode-default-key",
        ),
        pytest.param(
            RewardAssigned(run="r", session="s", value=1.0, key="fmt"),
            "ts.ev.r.s.reward",
            "r.s.reward.fmt.episode",
            id="reward-episode",
        ),
        pytest.param(
            RewardAssigned(run="r", session="s", value=1.0, key="fmt", turn=2),
            "ts.ev.r.s.reward",
            "r.s.reward.fmt.2",
            id="reward-turn",
        ),
        pytest.param(
            RewardAssigned(run="r", session="s", value=1.0, key="fmt", turn=0),
            "ts.ev.r.s.reward",
            "r.s.reward.fmt.0",
            id="reward-turn-0-is-not-episode",
        ),
        pytest.param(
            SessionClosed(run="r", session="s"), "ts.ev.r.s.close", "r.s.close", id="close"
        ),
        pytest.param(TRAJ, "ts.traj.r", "s-seg-1", id="trajectory"),
    ],
)
def test_route_gives_the_exact_subject_and_msg_id(event: Event, subject: str, msg_id: str) -> None:
    assert route(event) == Route(subject, msg_id)


def test_route_ignores_fields_outside_the_event_identity() -> None:
    first = RewardAssigned(run="r", session="s", value=1.0, key="k", turn=1, source="a")
    retry = RewardAssigned(run="r", session="s", value=2.0, key="k", turn=1, created_at=9.0)

    assert route(first) == route(retry)


def test_route_rejects_an_unknown_event_type() -> None:
    class TurnStarted(msgspec.Struct):
        run: str = "r"
        session: str = "s"

    with pytest.raises(TypeError, match="no route for TurnStarted"):
        route(TurnStarted())  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("subject", "want"),
    [
        pytest.param(session_subjects("r", "s"), "ts.ev.r.s.*", id="session-filter"),
        pytest.param(traj_subject("run-1"), "ts.traj.run-1", id="traj"),
        pytest.param(dlq_subject("fold"), "ts.dlq.fold", id="dlq"),
    ],
)
def test_subject_helpers(subject: str, want: str) -> None:
    assert subject == want
