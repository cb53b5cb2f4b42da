"""Appends that state what they expect of the log (optimistic concurrency, issue 36).

An append may carry an ``Expectation``: the stream sequence of the last message on a subject
filter (a session's ``ts.ev.<run>.<session>.*``) as the caller knows it, 0 for none. JetStream
checks it itself (``Nats-Expected-Last-Subject-Sequence`` scoped by
``Nats-Expected-Last-Subject-Sequence-Subject``, nats-server >= 2.11) and stores the event only
if it still holds; otherwise it answers err_code 10071, ``wrong last sequence: N``, N the
actual last sequence there, which ``refusal`` turns into ``AppendRefused``.

Measured on nats-server 2.15.1: the expectation is checked *before* Msg-Id de-duplication, so
re-publishing an already-stored event with a now-stale expectation is refused too, not acked as
a duplicate. Pure: no I/O.

>>> expect = Expectation.session("run", "s", 3)
>>> expect.headers()
{'Nats-Expected-Last-Subject-Sequence': '3', 'Nats-Expected-Last-Subject-Sequence-Subject': \
'ts.ev.run.s.*'}
>>> error = {"code": 400, "err_code": 10071, "description": "wrong last sequence: 5"}
>>> refusal(error, "run.s.turn.1", expect).last_seq
5
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from eventlog.errors import AppendRefused
from schemas.ids import session_subjects

__all__ = ["WRONG_LAST_SEQUENCE", "Expectation", "refusal"]

WRONG_LAST_SEQUENCE = 10071
"""JetStream's err_code for a stale ``Nats-Expected-Last-*-Sequence``."""

_LAST_SEQ = re.compile(r"wrong last sequence:\s*(\d+)")


@dataclass(frozen=True)
class Expectation:
    """``last_seq``: the stream sequence of the last message on ``subjects`` (a subject filter,
    wildcards allowed) as the caller knows it; 0: the caller knows of none there. ``stream``
    holds those subjects (where the publisher looks, after a lost ack, whether its own try
    landed)."""

    subjects: str
    last_seq: int
    stream: str = "EVENTS"

    @classmethod
    def session(cls, run: str, session: str, last_seq: int, stream: str = "EVENTS") -> Expectation:
        """The expectation over every event of ``run``/``session``."""
        return cls(session_subjects(run, session), last_seq, stream)

    def headers(self) -> dict[str, str]:
        return {
            "Nats-Expected-Last-Subject-Sequence": str(self.last_seq),
            "Nats-Expected-Last-Subject-Sequence-Subject": self.subjects,
        }


def refusal(
    error: dict[str, object], msg_id: str, expect: Expectation, *, after_retry: bool = False
) -> AppendRefused | None:
    """The ``AppendRefused`` a publish ack's ``error`` means, or None if it means another
    refusal. ``last_seq`` is None when the description does not carry it."""
    if error.get("err_code") != WRONG_LAST_SEQUENCE:
        return None
    match = _LAST_SEQ.search(str(error.get("description", "")))
    last_seq = int(match.group(1)) if match else None
    return AppendRefused(msg_id, expect.subjects, expect.last_seq, last_seq, after_retry)
