"""What consumers ask about streams and consumers themselves, nats errors translated here."""

from __future__ import annotations

from typing import NamedTuple

from nats.js import JetStreamContext
from nats.js import errors as js_errors

from eventlog.connection import UNAVAILABLE
from schemas.errors import EventLogUnavailable

__all__ = ["Newest", "StreamFacts", "consumer_ack_floor", "newest_message", "stream_facts"]

_MSG_ID = "Nats-Msg-Id"


class StreamFacts(NamedTuple):
    created: str  # ISO time the stream was made (a stream made again restarts at seq 1)
    duplicate_window_s: float


class Newest(NamedTuple):
    """The newest message on a subject, without its payload's meaning."""

    seq: int
    subject: str
    stored_at: float
    msg_id: str | None


async def stream_facts(js: JetStreamContext, stream: str) -> StreamFacts:
    try:
        info = await js.stream_info(stream)
    except UNAVAILABLE as exc:
        raise EventLogUnavailable(f"reading the config of stream {stream}: {exc}") from exc
    created = info.created.isoformat() if info.created else ""
    return StreamFacts(created, float(info.config.duplicate_window or 0.0))


async def consumer_ack_floor(js: JetStreamContext, stream: str, durable: str) -> int:
    """The stream sequence at and below which the consumer has acked everything."""
    try:
        info = await js.consumer_info(stream, durable)
    except UNAVAILABLE as exc:
        raise EventLogUnavailable(f"reading consumer {durable} of {stream}: {exc}") from exc
    return int(info.ack_floor.stream_seq) if info.ack_floor else 0


async def newest_message(js: JetStreamContext, stream: str, subject: str) -> Newest | None:
    """The newest message on ``subject`` (wildcards allowed), or None."""
    try:
        msg = await js.get_last_msg(stream, subject)
    except js_errors.NotFoundError:
        return None
    except UNAVAILABLE as exc:
        raise EventLogUnavailable(f"reading the newest message on {subject}: {exc}") from exc
    at = msg.time.timestamp() if msg.time is not None else 0.0
    return Newest(msg.seq or 0, msg.subject or "", at, (msg.headers or {}).get(_MSG_ID))
