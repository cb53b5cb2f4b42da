"""Storing dead letters: the one place a ``DeadLetter`` is published (DESIGN §8). The pull loop
builds it (``PullLoop.letter``); the record itself is ``schemas.dead_letter``."""

from __future__ import annotations

import logging

from eventlog.publisher import Publisher
from schemas.dead_letter import DeadLetter, encode_dead_letter

__all__ = ["publish_dead_letter"]

log = logging.getLogger(__name__)


async def publish_dead_letter(publisher: Publisher, letter: DeadLetter, max_payload: int) -> None:
    """Store ``letter`` in the DLQ (its original bytes cut to fit ``max_payload``).

    Returns once JetStream acknowledged it; only then may the original be acked.
    """
    letter = letter.fitted(max_payload)
    await publisher.publish_raw(letter.subject_out, encode_dead_letter(letter), letter.msg_id)
    where = f"run={letter.run} session={letter.session} " if letter.session else ""
    log.warning(
        "dead-lettered %s seq %d (%s) to %s: %s%s",
        letter.stream,
        letter.seq,
        letter.subject,
        letter.subject_out,
        where,
        letter.error,
    )
