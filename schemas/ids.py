"""Identifiers, NATS subjects and deterministic message ids (DESIGN §3).

Subjects: ``ts.ev.<run>.<session>.<kind>`` for session events, ``ts.traj.<run>`` for folded
trajectories, ``ts.dlq.<source>`` for dead letters. Message ids (``Nats-Msg-Id``) are derived from
the event's identity only, so a retry of the same event is absorbed by the stream's duplicate
window.
"""

from __future__ import annotations

import re
import secrets
import zlib
from typing import Literal

from schemas.errors import InvalidIdentifier

ID_PATTERN = r"[A-Za-z0-9_-]{1,64}"
_ID_RE = re.compile(ID_PATTERN)

EVENT_SUBJECT_PREFIX = "ts.ev"
TRAJ_SUBJECT_PREFIX = "ts.traj"
DLQ_SUBJECT_PREFIX = "ts.dlq"

EventKind = Literal["open", "turn", "reward", "close"]


def validate_id(value: object, field: str = "id") -> str:
    """Return ``value`` if it is a valid run / session / key id, else raise InvalidIdentifier."""
    if not isinstance(value, str) or _ID_RE.fullmatch(value) is None:
        raise InvalidIdentifier(field, value, ID_PATTERN)
    return value


def session_owner(session: str, workers: int) -> int:
    """Which of ``workers`` gateway processes holds ``session`` (``turnstream gateway
    --workers N``): the same in every process and across restarts (CRC-32, not Python's salted
    ``hash``). The run is left out: a key allowed one run finds its run only after the request
    is parsed, and the session alone spreads as evenly.

    >>> session_owner("s-1", 2), session_owner("a", 2), session_owner("s-1", 1)
    (0, 1, 0)
    """
    return zlib.crc32(session.encode()) % workers


_owned: tuple[int, int] = (0, 1)  # (this process's worker index, workers)


def own_new_session_ids(index: int, workers: int) -> None:
    """Make ``new_session_id`` draw ids that ``session_owner`` maps to worker ``index`` of
    ``workers`` (set once by each gateway worker process at its start)."""
    global _owned
    if not 0 <= index < workers:
        raise ValueError(f"worker {index} of {workers}")
    _owned = (index, workers)


def new_session_id() -> str:
    """A gateway-made session id: at least 128 random bits (DESIGN §3); base64url is already
    [A-Za-z0-9_-]. Never starts with ``-``, which a command line would read as an option
    (``turnstream inspect ID``). In a gateway worker, one this worker owns
    (``own_new_session_ids``): about ``workers`` draws, each taking log2(workers) bits from the
    136 drawn, so up to 256 workers leave >= 128.

    >>> all(not new_session_id().startswith("-") for _ in range(1000))
    True
    """
    index, workers = _owned
    while (session := secrets.token_urlsafe(17)).startswith("-") or (
        workers > 1 and session_owner(session, workers) != index
    ):
        pass  # 1 in 64 draws starts with "-": draw again (0.02 bits fewer)
    return session


def event_subject(run: str, session: str, kind: EventKind) -> str:
    return f"{EVENT_SUBJECT_PREFIX}.{run}.{session}.{kind}"


def session_subjects(run: str, session: str) -> str:
    """Filter subject matching every event of one session."""
    return f"{EVENT_SUBJECT_PREFIX}.{run}.{session}.*"


def traj_subject(run: str) -> str:
    return f"{TRAJ_SUBJECT_PREFIX}.{run}"


def dlq_subject(source: str) -> str:
    return f"{DLQ_SUBJECT_PREFIX}.{source}"


def open_msg_id(run: str, session: str) -> str:
    return f"{run}.{session}.open"


def turn_msg_id(run: str, session: str, turn: int) -> str:
    return f"{run}.{session}.turn.{turn}"


def reward_msg_id(run: str, session: str, key: str, turn: int | None) -> str:
    return f"{run}.{session}.reward.{key}.{'episode' if turn is None else turn}"


def close_msg_id(run: str, session: str) -> str:
    return f"{run}.{session}.close"
