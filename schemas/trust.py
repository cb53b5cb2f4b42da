"""Which stored events may be believed (DESIGN §3, "Trusting the log"). Pure: no I/O.

The log stores whatever a connected client publishes. Before a session's events are folded
(by a fold worker) or replayed into memory (by a gateway recovering a session), each one is
checked against where the stream stored it:

- it decodes to a session event whose run, session and kind match its subject
  ``ts.ev.<run>.<session>.<kind>``, else ``subject_mismatch``;
- it carries a ``Nats-Msg-Id`` (publishers always set one), else ``no_msg_id``;
- of two *different* TurnCompleted for one (session, turn), the one the stream stored first
  wins (stream sequence, not the event's own clock) and the other is ``conflicting_turn``;
  byte-identical copies are repeats, dropped without a word.

Bytes that do not decode are not a trust question: ``vet_session`` raises the codec's
``SchemaError`` (with the message that held them), and the session is not folded.

>>> from schemas.codec import Codec
>>> from schemas.events import SessionOpened
>>> codec = Codec()
>>> opened = codec.encode(SessionOpened(run="r", session="s"))
>>> stored = [StoredMessage(1, "ts.ev.r.s.open", opened, "r.s.open"),
...           StoredMessage(2, "ts.ev.r.other.open", opened, "r.other.open"),
...           StoredMessage(3, "ts.ev.r.s.open", opened, None)]
>>> vetted = vet_session(stored, codec)
>>> [type(e).__name__ for e in vetted.events], [(m.seq, e.reason) for m, e in vetted.rejected]
(['SessionOpened'], [(2, 'subject_mismatch'), (3, 'no_msg_id')])
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from schemas.codec import Codec
from schemas.errors import SchemaError, UntrustedEvent
from schemas.events import (
    CompactTrajectory,
    Event,
    RewardAssigned,
    SessionClosed,
    SessionEvent,
    SessionOpened,
    TrajectoryReady,
    TurnCompleted,
)
from schemas.ids import EVENT_SUBJECT_PREFIX

__all__ = ["PoisonEvent", "StoredMessage", "VettedSession", "check_stored", "vet_session"]

_KIND: dict[type[Event], str] = {
    SessionOpened: "open",
    TurnCompleted: "turn",
    RewardAssigned: "reward",
    SessionClosed: "close",
}


class StoredMessage(NamedTuple):
    """One message as the stream holds it."""

    seq: int
    subject: str
    data: bytes
    msg_id: str | None = None


class PoisonEvent(SchemaError):
    """A session holds bytes that are not an event: the session cannot be folded."""

    def __init__(self, stored: StoredMessage, error: SchemaError) -> None:
        self.stored = stored
        self.error = error
        self.reason = error.reason
        super().__init__(f"{stored.subject} seq {stored.seq}: {type(error).__name__}: {error}")


@dataclass
class VettedSession:
    """A session's events that may be folded (stream order), and those that may not."""

    events: list[SessionEvent] = field(default_factory=list)
    rejected: list[tuple[StoredMessage, UntrustedEvent]] = field(default_factory=list)
    seqs: list[int] = field(default_factory=list)  # each event's stream sequence

    @property
    def conflicting_turns(self) -> int:
        return sum(1 for _, error in self.rejected if error.reason == "conflicting_turn")


def check_stored(stored: StoredMessage, event: Event) -> SessionEvent:
    """``event`` (decoded from ``stored``) if it matches its subject and has a Msg-Id."""
    where = f"{stored.subject} seq {stored.seq}"
    parts = stored.subject.split(".")
    kind = _KIND.get(type(event))
    if (
        isinstance(event, TrajectoryReady | CompactTrajectory)
        or kind is None
        or len(parts) != 5
        or ".".join(parts[:2]) != EVENT_SUBJECT_PREFIX
        or (parts[2], parts[3], parts[4]) != (event.run, event.session, kind)
    ):
        said = (
            f"a {type(event).__name__}"
            if isinstance(event, TrajectoryReady | CompactTrajectory) or kind is None
            else f"run={event.run} session={event.session} kind={kind}"
        )
        raise UntrustedEvent(
            "subject_mismatch",
            f"{where} holds {said}, which is not what its subject says; it was not published "
            f"by turnstream (or by one with a different subject scheme) and is not folded",
        )
    if not stored.msg_id:
        raise UntrustedEvent(
            "no_msg_id",
            f"{where} has no Nats-Msg-Id; turnstream's publishers always set one, so this "
            f"event came from elsewhere and is not folded",
        )
    assert not isinstance(event, TrajectoryReady | CompactTrajectory)
    return event


def vet_session(stored: Sequence[StoredMessage], codec: Codec) -> VettedSession:
    """Split one session's stored messages (stream order) into trusted events and rejects."""
    vetted = VettedSession()
    turns: dict[int, StoredMessage] = {}
    for message in stored:
        try:
            decoded = codec.decode(message.data)
        except SchemaError as exc:
            raise PoisonEvent(message, exc) from exc
        try:
            event = check_stored(message, decoded)
        except UntrustedEvent as exc:
            vetted.rejected.append((message, exc))
            continue
        if isinstance(event, TurnCompleted):
            first = turns.get(event.turn)
            if first is not None:
                if first.data != message.data:
                    vetted.rejected.append((message, _conflict(message, first, event.turn)))
                continue
            turns[event.turn] = message
        vetted.events.append(event)
        vetted.seqs.append(message.seq)
    return vetted


def _conflict(message: StoredMessage, first: StoredMessage, turn: int) -> UntrustedEvent:
    return UntrustedEvent(
        "conflicting_turn",
        f"{message.subject} seq {message.seq} is a second, different turn {turn} of its "
        f"session; the one stored first (seq {first.seq}) is folded, this one is not",
    )
