"""Which stored events the fold and the gateway believe (schemas.trust), without a broker."""

from __future__ import annotations

import msgspec
import pytest

from schemas import Codec, SessionEvent, TurnCompleted, route
from schemas.trust import PoisonEvent, StoredMessage, vet_session
from tests.helpers.sessions import append_only, session_events
from tests.helpers.trajectories import folded

CODEC = Codec()
SESSION = session_events(append_only(2), session="s")
TURN0 = next(e for e in SESSION if isinstance(e, TurnCompleted) and e.turn == 0)
OTHER_TURN0 = msgspec.structs.replace(
    TURN0, completion_ids=TURN0.completion_ids[::-1].copy() + 1, created_at=1.0
)


def stored(events: list[SessionEvent]) -> list[StoredMessage]:
    return [
        StoredMessage(seq, route(e).subject, CODEC.encode(e), route(e).msg_id)
        for seq, e in enumerate(events, 1)
    ]


def encoded(events: list[SessionEvent]) -> list[bytes]:
    return [CODEC.encode(e) for e in events]


def reasons(messages: list[StoredMessage]) -> list[tuple[int, str]]:
    return [(m.seq, error.reason) for m, error in vet_session(messages, CODEC).rejected]


def test_a_session_as_published_is_trusted_whole() -> None:
    vetted = vet_session(stored(SESSION), CODEC)
    assert encoded(vetted.events) == encoded(SESSION) and vetted.rejected == []


@pytest.mark.parametrize(
    ("subject", "why"),
    [
        ("ts.ev.run-1.other.turn", "another session"),
        ("ts.ev.other-run.s.turn", "another run"),
        ("ts.ev.run-1.s.close", "another kind"),
        ("ts.ev.run-1.s", "too short"),
        ("elsewhere.run-1.s.x.turn", "another prefix"),
    ],
)
def test_an_event_stored_under_a_subject_that_is_not_its_own_is_rejected(
    subject: str, why: str
) -> None:
    messages = stored(SESSION)
    messages[1] = messages[1]._replace(subject=subject)
    assert reasons(messages) == [(2, "subject_mismatch")], why


def test_an_event_without_a_msg_id_is_rejected() -> None:
    messages = stored(SESSION)
    messages[1] = messages[1]._replace(msg_id=None)
    assert reasons(messages) == [(2, "no_msg_id")]


def test_of_two_different_turns_the_one_stored_first_wins_whatever_their_clocks() -> None:
    forged = StoredMessage(99, route(OTHER_TURN0).subject, CODEC.encode(OTHER_TURN0), "x")
    messages = [*stored(SESSION), forged]
    vetted = vet_session(messages, CODEC)
    assert reasons(messages) == [(99, "conflicting_turn")]
    assert vetted.conflicting_turns == 1
    assert encoded(vetted.events) == encoded(SESSION)  # turn 0 is the one stored first


def test_a_byte_identical_repeat_is_dropped_without_a_word() -> None:
    messages = stored(SESSION)
    repeat = messages[1]._replace(seq=50)
    vetted = vet_session([*messages, repeat], CODEC)
    assert vetted.rejected == [] and encoded(vetted.events) == encoded(SESSION)


def test_a_trajectory_stored_among_session_events_is_a_subject_mismatch() -> None:
    traj = folded("run-1", "s")
    messages = [*stored(SESSION), StoredMessage(9, "ts.ev.run-1.s.turn", CODEC.encode(traj), "t")]
    assert reasons(messages) == [(9, "subject_mismatch")]


def test_bytes_that_are_no_event_poison_the_session() -> None:
    messages = [*stored(SESSION), StoredMessage(7, "ts.ev.run-1.s.turn", b"\xc1", "junk")]
    with pytest.raises(PoisonEvent) as raised:
        vet_session(messages, CODEC)
    assert raised.value.stored.seq == 7 and raised.value.reason == "undecodable"
