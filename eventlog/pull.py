"""Durable pull consumers: one ``ConsumerSpec`` each, created or updated, fetched from.

Every process of a kind (fold workers, reapers, the shard writer, a trainer's sink) binds to one
durable consumer, so JetStream spreads the messages over them and redelivers what a dead process
left unacked. The consumers themselves run in ``eventlog.loop.PullLoop``; these are its parts
(and ``reader.stored_msg_ids`` fetches with them too).

A consumer is described once, by a ``ConsumerSpec``: what the server keeps (stream, durable name,
filter, ack wait, deliveries, pending) and how the loop pulls and retries (batch, fetch wait,
backoff, bytes per fetch). ``ConsumerSpec.config`` is the one place it becomes nats'
``ConsumerConfig``.
nats-py errors are translated here: a fetch that finds nothing returns ``[]``; a log that does
not answer raises EventLogUnavailable.

>>> spec = ConsumerSpec("EVENTS", "fold", ("ts.ev.*.*.close",), max_ack_pending=64,
...                     ack_wait_s=30.0, batch=500, max_deliver=3, backoff_s=(1.0, 5.0))
>>> spec.fetch_batch, spec.server_max_deliver, [spec.retry_delay_s(d) for d in (1, 2, 3)]
(64, 4, [1.0, 5.0, 5.0])
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import nats.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js import errors as js_errors

from eventlog.config import ConsumerSettings
from eventlog.connection import answered
from schemas.errors import EventLogUnavailable, ProvisioningError

__all__ = ["ConsumerSpec", "FetchSizer", "fetch", "release"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConsumerSpec:
    """One durable pull consumer, whole; ``bind`` creates or updates it and subscribes."""

    stream: str
    durable: str
    filter_subjects: tuple[str, ...]
    max_ack_pending: int  # delivered, not yet acked
    ack_wait_s: float  # redelivery after this without ack or progress
    batch: int = 32  # messages per fetch (never above max_ack_pending)
    max_deliver: int = -1  # the handler's tries before a dead letter; -1: never give up
    backoff_s: tuple[float, ...] = (1.0, 5.0, 30.0, 60.0)  # nak delays, one per delivery
    fetch_timeout_s: float = 1.0  # longest wait of one fetch
    fetch_max_bytes: int | None = None  # fetches sized to stay under this (``FetchSizer``)
    headers_only: bool = False  # deliver headers, not payloads (the reaper's tracking)

    def __post_init__(self) -> None:
        if self.max_deliver in (0, 1) or self.max_deliver < -1:
            raise ValueError("max_deliver must be -1 (never give up) or at least 2")

    @classmethod
    def of(
        cls, settings: ConsumerSettings, *, stream: str, filter_subjects: Sequence[str]
    ) -> ConsumerSpec:
        """The consumer ``settings`` describe (a service's flags), on ``stream``."""
        return cls(
            stream=stream,
            durable=settings.durable,
            filter_subjects=tuple(filter_subjects),
            max_ack_pending=settings.max_ack_pending,
            ack_wait_s=settings.ack_wait_s,
            batch=settings.batch,
            max_deliver=settings.max_deliver,
            backoff_s=settings.backoff_s,
            fetch_timeout_s=settings.fetch_timeout_s,
        )

    @property
    def fetch_batch(self) -> int:
        # A pull request for more than max_ack_pending can never be filled: the server holds it
        # until it expires, and every fetch would take the full timeout.
        return min(self.batch, self.max_ack_pending)

    def retry_delay_s(self, delivery: int) -> float:
        """Delay before the next try of a message delivered ``delivery`` times (1 = first)."""
        if not self.backoff_s:
            return 0.0
        return self.backoff_s[min(delivery, len(self.backoff_s)) - 1]

    @property
    def server_max_deliver(self) -> int:
        """The durable consumer's own max_deliver: one spare delivery past the handler's last try.

        Deliveries ``max_deliver`` and later dead-letter on failure; the spare one only happens
        when the worker holding delivery ``max_deliver`` stopped or died before it acked
        (mid-fold, or while the log refused the dead letter), and it is the backstop against a
        close that kills every worker that folds it.
        """
        return -1 if self.max_deliver == -1 else self.max_deliver + 1

    def config(self) -> js_api.ConsumerConfig:
        subjects = list(self.filter_subjects)
        return js_api.ConsumerConfig(
            durable_name=self.durable,
            name=self.durable,
            deliver_policy=js_api.DeliverPolicy.ALL,
            ack_policy=js_api.AckPolicy.EXPLICIT,
            ack_wait=self.ack_wait_s,
            max_deliver=self.server_max_deliver,
            max_ack_pending=self.max_ack_pending,
            filter_subject=subjects[0] if len(subjects) == 1 else None,
            filter_subjects=subjects if len(subjects) > 1 else None,
            headers_only=self.headers_only or None,
        )

    async def bind(self, js: JetStreamContext) -> JetStreamContext.PullSubscription:
        """Create the consumer (or update the settings we own) and subscribe to it. Asked again
        when an answer is lost (``answered``: every step is idempotent): a service binds as it
        starts, and a nats-server restart in that window made it exit (the chaos soak's shard
        writer, issue 37's soak)."""
        want = self.config()
        try:
            await answered(
                lambda: self._create_or_update(js, want),
                f"binding consumer {self.durable} on {self.stream}",
            )
            return await js.pull_subscribe_bind(self.durable, stream=self.stream)
        except js_errors.APIError as exc:
            raise ProvisioningError(
                f"consumer {self.durable} on stream {self.stream}: JetStream refused the "
                f"configuration ({exc}); is the stream provisioned (`turnstream provision`)? "
                f"A changed filter needs the old consumer deleted"
            ) from exc
        except (TimeoutError, nats.errors.Error, OSError) as exc:
            raise EventLogUnavailable(
                f"cannot bind consumer {self.durable} on {self.stream}: {exc}"
            ) from exc

    async def _create_or_update(self, js: JetStreamContext, want: js_api.ConsumerConfig) -> None:
        try:
            live = (await js.consumer_info(self.stream, self.durable)).config
        except js_errors.NotFoundError:
            await js.add_consumer(self.stream, want)
        else:
            if _differs(live, want):
                # Same name and filter: the server updates it in place.
                await js.add_consumer(self.stream, want)
                log.info("consumer %s/%s updated", self.stream, self.durable)


def _subjects(config: js_api.ConsumerConfig) -> list[str]:
    return sorted(
        config.filter_subjects or ([config.filter_subject] if config.filter_subject else [])
    )


def _differs(live: js_api.ConsumerConfig, want: js_api.ConsumerConfig) -> bool:
    fields = ("ack_wait", "max_deliver", "max_ack_pending", "headers_only")
    changed = any((getattr(live, f) or None) != (getattr(want, f) or None) for f in fields)
    return changed or _subjects(live) != _subjects(want)


async def fetch(sub: JetStreamContext.PullSubscription, batch: int, wait_s: float) -> list[Msg]:
    """Up to ``batch`` messages; ``[]`` when none came within ``wait_s``."""
    try:
        return await sub.fetch(batch, timeout=wait_s)
    except (TimeoutError, nats.errors.TimeoutError):
        return []
    except (nats.errors.Error, OSError) as exc:
        raise EventLogUnavailable(f"fetch failed: {type(exc).__name__}: {exc}") from exc


async def release(sub: JetStreamContext.PullSubscription) -> None:
    """Unsubscribe a pull subscription (bounded: the log may be gone).

    Needed before the connection drains: a pull subscription holds the replies of fetches that
    timed out in a queue nobody reads, and ``drain()`` would wait for that queue forever.
    """
    with contextlib.suppress(nats.errors.Error, OSError, TimeoutError):
        async with asyncio.timeout(1.0):
            await sub.unsubscribe()


@dataclass
class FetchSizer:
    """Sizes fetches so one fetch's messages stay under ``max_bytes``.

    The server sends a fetch's messages in one burst, and it disconnects a client whose
    unsent data passes its slow-consumer limit (64 MiB by default): 256 trajectories of 20k
    tokens are ~100 MB. nats-py's fetch has no ``max_bytes``, so the batch is sized from the
    largest message seen lately (decaying, so one outlier does not shrink fetches for good).
    """

    max_bytes: int
    initial_batch: int = 8
    typical: float = 0.0

    def batch(self, limit: int) -> int:
        if not self.typical:
            return max(1, min(limit, self.initial_batch))
        return max(1, min(limit, int(self.max_bytes // self.typical)))

    def observe(self, msgs: Sequence[Msg]) -> None:
        if msgs:
            largest = max(len(m.data) for m in msgs)
            self.typical = max(float(largest), self.typical * 0.9)
