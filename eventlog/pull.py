"""Durable pull consumers: create or update one, fetch from it, keep a long job's message alive.

Every process of a kind (fold workers, reapers, the shard writer, a trainer's sink) binds to one
durable consumer, so JetStream spreads the messages over them and redelivers what a dead process
left unacked. The consumers themselves run in ``eventlog.loop.PullLoop``; these are its parts
(and ``reader.stored_msg_ids`` fetches with them too).
nats-py errors are translated here: a fetch that finds nothing returns ``[]``; a log that does
not answer raises EventLogUnavailable.
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

from schemas.errors import EventLogUnavailable, ProvisioningError

__all__ = ["FetchSizer", "PullConsumer", "fetch", "release"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PullConsumer:
    """One durable pull consumer; ``bind`` creates or updates it and subscribes."""

    stream: str
    durable: str
    filter_subjects: Sequence[str]
    max_ack_pending: int
    ack_wait_s: float
    max_deliver: int = -1
    headers_only: bool = False

    def config(self) -> js_api.ConsumerConfig:
        subjects = list(self.filter_subjects)
        return js_api.ConsumerConfig(
            durable_name=self.durable,
            name=self.durable,
            deliver_policy=js_api.DeliverPolicy.ALL,
            ack_policy=js_api.AckPolicy.EXPLICIT,
            ack_wait=self.ack_wait_s,
            max_deliver=self.max_deliver,
            max_ack_pending=self.max_ack_pending,
            filter_subject=subjects[0] if len(subjects) == 1 else None,
            filter_subjects=subjects if len(subjects) > 1 else None,
            headers_only=self.headers_only or None,
        )

    async def bind(self, js: JetStreamContext) -> JetStreamContext.PullSubscription:
        """Create the consumer (or update the settings we own) and subscribe to it."""
        want = self.config()
        try:
            try:
                live = (await js.consumer_info(self.stream, self.durable)).config
            except js_errors.NotFoundError:
                await js.add_consumer(self.stream, want)
            else:
                if _differs(live, want):
                    # Same name and filter: the server updates it in place.
                    await js.add_consumer(self.stream, want)
                    log.info("consumer %s/%s updated", self.stream, self.durable)
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
