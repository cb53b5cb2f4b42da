"""What to do with a message whose handling failed: one pure function of the error.

    bad input (``error.permanent``: undecodable, newer schema, untrusted, a fold error)
                                              -> dead-letter now, filed under ``error.reason``
    anything else (turns maybe still in flight, the log unavailable, a bug of ours)
                                              -> retry, dead-letter at the end

"At the end" is delivery ``max_deliver`` (never, for a consumer with ``max_deliver=-1``): a
message JetStream gives up on would vanish without a trace, so that try dead-letters instead of
naking. The DLQ is in the same log, so the dead letter
itself can fail to be stored (``when_dead_letter_fails``): before that delivery the message is
naked and comes back whole; from it on the worker keeps the message and retries the letter. The
consumer allows one delivery more than the worker (``ConsumerSpec.server_max_deliver``), so a
worker stopped or killed while dead-lettering leaves the message to that spare delivery rather
than to nothing.

>>> from schemas.errors import EventLogUnavailable, UndecodableEvent
>>> spec = ConsumerSpec("EVENTS", "fold", ("ts.ev.*.*.close",), max_ack_pending=64,
...                     ack_wait_s=30.0, max_deliver=3, backoff_s=(1.0, 5.0))
>>> disposition(EventLogUnavailable("down"), delivery=1, spec=spec)
Retry(delay_s=1.0)
>>> disposition(EventLogUnavailable("down"), delivery=3, spec=spec)
DeadLetterIt(reason='log_unavailable')
>>> disposition(UndecodableEvent("junk"), delivery=1, spec=spec)
DeadLetterIt(reason='undecodable')
>>> when_dead_letter_fails(delivery=3, attempt=1, stopping=False, spec=spec)
RetryDeadLetter(delay_s=1.0)
"""

from __future__ import annotations

from dataclasses import dataclass

from eventlog.pull import ConsumerSpec
from schemas.errors import TurnstreamError

__all__ = [
    "DeadLetterIt",
    "Disposition",
    "Retry",
    "RetryDeadLetter",
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
    """The dead-letter reason code of ``error``: its own, or ``worker_error`` (a bug of ours)."""
    return error.reason if isinstance(error, TurnstreamError) else "worker_error"


def _last_try(delivery: int, spec: ConsumerSpec) -> bool:
    return spec.max_deliver != -1 and delivery >= spec.max_deliver


def disposition(error: BaseException, *, delivery: int, spec: ConsumerSpec) -> Disposition:
    """Dead-letter bad input at once; retry the rest until the consumer's last delivery."""
    permanent = isinstance(error, TurnstreamError) and error.permanent
    if permanent or _last_try(delivery, spec):
        return DeadLetterIt(reason_of(error))
    return Retry(spec.retry_delay_s(delivery))


def when_dead_letter_fails(
    *, delivery: int, attempt: int, stopping: bool, spec: ConsumerSpec
) -> Retry | RetryDeadLetter:
    """The dead letter of a message on its ``delivery`` could not be stored (``attempt`` tries).

    Before delivery ``max_deliver``: nak, the whole message comes back. From then on never nak:
    keep the message and retry the letter in process. A stopping worker hands the message back
    only while JetStream still owes it a delivery (``spec.server_max_deliver``); on the consumer's
    last delivery nothing would ever record the close again, so the stop waits for the log.
    The hand-back waits out ``fetch_timeout_s``: the stopping worker's last fetch may still be
    open, and the close must go to another worker, not back to this one.
    """
    if not _last_try(delivery, spec):
        return Retry(spec.retry_delay_s(delivery))
    if stopping and delivery < spec.server_max_deliver:
        return Retry(max(spec.retry_delay_s(delivery), spec.fetch_timeout_s + 1.0))
    return RetryDeadLetter(spec.retry_delay_s(attempt))
