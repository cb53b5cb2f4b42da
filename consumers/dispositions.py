"""What to do with a message whose handling failed: one pure function of the error.

    bad input (undecodable, newer schema, oversized, a fold error) -> dead-letter now
    turns missing (maybe still in flight)                           -> retry, dead-letter at the end
    the log unavailable, or a bug of ours                           -> retry, dead-letter at the end

"At the end" is delivery ``max_deliver``: a message JetStream gives up on would vanish without a
trace, so that try dead-letters instead of naking. The DLQ is in the same log, so the dead letter
itself can fail to be stored (``when_dead_letter_fails``): before that delivery the message is
naked and comes back whole; from it on the worker keeps the message and retries the letter. The
consumer allows one delivery more than the worker (``consumer_max_deliver``), so a worker stopped
or killed while dead-lettering leaves the message to that spare delivery rather than to nothing.

>>> settings = ConsumerSettings(durable="fold", max_deliver=3, backoff_s=(1.0, 5.0))
>>> disposition(EventLogUnavailable("down"), delivery=1, settings=settings)
Retry(delay_s=1.0)
>>> disposition(EventLogUnavailable("down"), delivery=3, settings=settings)
DeadLetterIt(reason='log_unavailable')
>>> from schemas.errors import UndecodableEvent
>>> disposition(UndecodableEvent("junk"), delivery=1, settings=settings)
DeadLetterIt(reason='undecodable')
>>> when_dead_letter_fails(delivery=3, attempt=1, stopping=False, settings=settings)
RetryDeadLetter(delay_s=1.0)
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

__all__ = [
    "DeadLetterIt",
    "Disposition",
    "Retry",
    "RetryDeadLetter",
    "consumer_max_deliver",
    "dead_letter_for",
    "disposition",
    "reason_of",
    "when_dead_letter_fails",
]


@dataclass(frozen=True)
class Retry:
    """Nak with this delay: JetStream redelivers the message later."""

    delay_s: float


@dataclass(frozen=True)
class DeadLetterIt:
    """Publish a dead letter with this reason, then ack the original."""

    reason: str


@dataclass(frozen=True)
class RetryDeadLetter:
    """Keep the message (in progress, unacked); publish its dead letter again after this delay."""

    delay_s: float


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


def consumer_max_deliver(settings: ConsumerSettings) -> int:
    """The durable consumer's own max_deliver: one spare delivery past the worker's last try.

    Deliveries ``max_deliver`` and later dead-letter on failure; the spare one only happens when
    the worker holding delivery ``max_deliver`` stopped or died before it acked (mid-fold, or
    while the log refused the dead letter), and it is the backstop against a close that kills
    every worker that folds it.
    """
    return settings.max_deliver + 1


def when_dead_letter_fails(
    *, delivery: int, attempt: int, stopping: bool, settings: ConsumerSettings
) -> Retry | RetryDeadLetter:
    """The dead letter of a message on its ``delivery`` could not be stored (``attempt`` tries).

    Before delivery ``max_deliver``: nak, the whole message comes back. From then on never nak:
    keep the message and retry the letter in process. A stopping worker hands the message back
    only while JetStream still owes it a delivery (``consumer_max_deliver``); on the consumer's
    last delivery nothing would ever record the close again, so the stop waits for the log.
    The hand-back waits out ``fetch_timeout_s``: the stopping worker's last fetch may still be
    open, and the close must go to another worker, not back to this one.
    """
    if delivery < settings.max_deliver:
        return Retry(settings.retry_delay_s(delivery))
    if stopping and delivery < consumer_max_deliver(settings):
        return Retry(max(settings.retry_delay_s(delivery), settings.fetch_timeout_s + 1.0))
    return RetryDeadLetter(settings.retry_delay_s(attempt))


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
