"""Storing dead letters: the one place a ``DeadLetter`` is built from a delivered message and
published (DESIGN §8). The record itself is ``schemas.dead_letter``."""

from __future__ import annotations

import logging
import time

from nats.aio.msg import Msg

from eventlog.publisher import Publisher
from schemas.dead_letter import DeadLetter, encode_dead_letter

__all__ = ["dead_letter_for", "publish_dead_letter"]

log = logging.getLogger(__name__)


def dead_letter_for(
    msg: Msg,
    *,
    source: str,
    reason: str,
    error: BaseException | str,
    run: str | None = None,
    session: str | None = None,
) -> DeadLetter:
    """The dead letter of a JetStream message ``msg``."""
    meta = msg.metadata
    return DeadLetter(
        source=source,
        reason=reason,
        error=error if isinstance(error, str) else f"{type(error).__name__}: {error}",
        stream=meta.stream,
        subject=msg.subject,
        seq=int(meta.sequence.stream),
        deliveries=int(meta.num_delivered),
        run=run,
        session=session,
        payload=bytes(msg.data),
        created_at=time.time(),
    )


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
