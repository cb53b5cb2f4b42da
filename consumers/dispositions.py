"""What to do with a message whose handling failed: one pure function of the error.

    bad input (undecodable, newer schema, oversized, a fold error) -> dead-letter now
    turns missing (maybe still in flight)                           -> retry, dead-letter at the end
    the log unavailable, or a bug of ours                           -> retry, dead-letter at the end

"At the end" is the consumer's last delivery: a message JetStream gives up on after max_deliver
would vanish without a trace, so the last try dead-letters instead of naking.

>>> settings = ConsumerSettings(durable="fold", max_deliver=3, backoff_s=(1.0, 5.0))
>>> disposition(EventLogUnavailable("down"), delivery=1, settings=settings)
Retry(delay_s=1.0)
>>> disposition(EventLogUnavailable("down"), delivery=3, settings=settings)
DeadLetterIt(reason='log_unavailable')
>>> from schemas.errors import UndecodableEvent
>>> disposition(UndecodableEvent("junk"), delivery=1, settings=settings)
DeadLetterIt(reason='undecodable')
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from nats.aio.msg import Msg

from consumers.config import ConsumerSettings
from consumers.errors import FoldError, MissingTurns
from schemas.dead_letter import DeadLetter, schema_reason
from schemas.errors import (
    EventLogError,
    EventLogUnavailable,
)

__all__ = ["DeadLetterIt", "Disposition", "Retry", "dead_letter_for", "disposition", "reason_of"]


@dataclass(frozen=True)
class Retry:
    """Nak with this delay: JetStream redelivers the message later."""

    delay_s: float


@dataclass(frozen=True)
class DeadLetterIt:
    """Publish a dead letter with this reason, then ack the original."""

    reason: str


Disposition = Retry | DeadLetterIt


def reason_of(error: BaseException) -> str:
    """The dead-letter reason code of ``error``."""
    bad_input = schema_reason(error)
    if bad_input is not None:
        return bad_input
    if isinstance(error, MissingTurns):
        return "missing_turns"
    if isinstance(error, FoldError):
        return "fold_error"
    if isinstance(error, EventLogUnavailable):
        return "log_unavailable"
    if isinstance(error, EventLogError):
        return "log_refused"
    return "worker_error"


def disposition(error: BaseException, *, delivery: int, settings: ConsumerSettings) -> Disposition:
    """Dead-letter bad input at once; retry the rest until the consumer's last delivery."""
    reason = reason_of(error)
    permanent = reason in ("undecodable", "unsupported_version", "payload_too_large", "fold_error")
    if permanent or delivery >= settings.max_deliver:
        return DeadLetterIt(reason)
    return Retry(settings.retry_delay_s(delivery))


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
