"""Following a subject from now on: every message stored on it after the call, to a callback.

An ordered consumer (no durable state on the server, nothing acknowledged) started at the
stream's end, so a follower never replays history and, started before whatever it waits for
can happen, misses nothing. nats-py restarts an ordered consumer after a gap or a reconnect on
its own. Used by the rollout integration to wait for a closed session's trajectories on TRAJ
(``turnstream.integrations.trajectories``); durable consumers of the log use ``PullLoop``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

from nats.aio.msg import Msg
from nats.js import api as js_api

from eventlog.connection import UNAVAILABLE, JetStream
from schemas.errors import EventLogUnavailable
from schemas.trust import StoredMessage

__all__ = ["Following", "follow"]

_MSG_ID = "Nats-Msg-Id"


class Following:
    """A running follow; ``stop`` ends it (bounded: the connection may be gone)."""

    def __init__(self, subscription: Any) -> None:
        self._subscription = subscription

    async def stop(self) -> None:
        if self._subscription is not None:
            with contextlib.suppress(*UNAVAILABLE):
                await self._subscription.unsubscribe()
            self._subscription = None


async def follow(
    js: JetStream,
    stream: str,
    subject: str,
    on_message: Callable[[StoredMessage], Awaitable[None]],
) -> Following:
    """Hand every message stored on ``subject`` (wildcards allowed) in ``stream`` from now on to
    ``on_message``, in stream order; raises EventLogUnavailable if the log cannot be followed."""

    async def deliver(msg: Msg) -> None:
        seq = int(msg.metadata.sequence.stream)
        await on_message(
            StoredMessage(seq, msg.subject, msg.data, (msg.headers or {}).get(_MSG_ID))
        )

    try:
        info = await js.stream_info(stream)
        start = int(info.state.last_seq) + 1
        subscription = await js.subscribe(
            subject,
            stream=stream,
            cb=deliver,
            ordered_consumer=True,
            config=js_api.ConsumerConfig(
                deliver_policy=js_api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start
            ),
        )
    except UNAVAILABLE as exc:
        raise EventLogUnavailable(
            f"cannot follow {subject} in {stream}: {exc!r}; is the log provisioned "
            f"(`turnstream up` or `turnstream provision`)?"
        ) from exc
    # nats-py restarts an ordered consumer after a gap or a reconnect from the last stream
    # sequence it delivered + 1, which is 0 + 1 before the first message: a restart then
    # would replay the subject's whole history. Tell it where this follow began.
    jsi = getattr(getattr(subscription, "_sub", None), "_jsi", None)
    if jsi is not None and getattr(jsi, "_sseq", None) == 0:
        jsi._sseq = start - 1
    return Following(subscription)
