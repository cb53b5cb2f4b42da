"""Reading back what the streams hold: one session's events in stream order, and scans.

A session (or what follows a stream sequence on it) is read by batched direct get,
``eventlog.direct.DirectReader``: the functions here (``read_session``,
``read_session_messages``, ``read_session_after``, ``read_subjects_after``) are its methods on
a reader of their own for the one read. Fold workers rehydrate a closed session with them and
the tools read one; a process that reads often (the gateway's catch-up reads, issue 36) holds
one ``DirectReader`` instead. (benchmarks/pipeline_throughput.py compares the read with one
direct get per event and with an ordered consumer; benchmarks/catch_up_read.py a held reader
with one per read.)

``stored_msg_ids`` answers the other question a redelivered fold asks: which of these Msg-Ids
does a subject already hold, past the stream's duplicate window? ``msg_id_counts`` (how many
copies of each) is what a replay asks. ``read_range`` and ``read_subject`` read with an ordered
consumer.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
from collections.abc import AsyncGenerator, AsyncIterator, Collection
from typing import Any, Unpack

import nats.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js import api as js_api

from eventlog.direct import DirectReader, ReadLimits, SessionTail
from eventlog.pull import fetch, release
from schemas.codec import Codec
from schemas.errors import EventLogUnavailable
from schemas.events import SessionEvent
from schemas.trust import StoredMessage

__all__ = [
    "DirectReader",
    "ReadLimits",
    "SessionTail",
    "StoredMessage",
    "msg_id_counts",
    "read_range",
    "read_session",
    "read_session_after",
    "read_session_messages",
    "read_subject",
    "read_subjects_after",
    "stored_msg_ids",
]

_MSG_ID = "Nats-Msg-Id"


def _reader(js: JetStreamContext, codec: Codec | None = None) -> DirectReader:
    """A reader of its own for one read on ``js``'s connection: a subscription per read, what
    a process that reads rarely may pay (one that reads often holds a ``DirectReader``)."""
    nc: Any = js._nc
    return DirectReader(nc, codec)


async def read_session_messages(
    js: JetStreamContext,
    run: str | None,
    session: str,
    *,
    stream: str = "EVENTS",
    after_seq: int = 0,
    **limits: Unpack[ReadLimits],
) -> list[StoredMessage]:
    """``DirectReader.read_session_messages`` for one read."""
    async with _reader(js) as reader:
        return await reader.read_session_messages(
            run, session, stream=stream, after_seq=after_seq, **limits
        )


async def read_subjects_after(
    js: JetStreamContext,
    stream: str,
    subject: str,
    after_seq: int = 0,
    *,
    where: str = "",
    **limits: Unpack[ReadLimits],
) -> list[StoredMessage]:
    """``DirectReader.read_after`` for one read."""
    async with _reader(js) as reader:
        return await reader.read_after(stream, subject, after_seq, where=where, **limits)


async def read_session(
    js: JetStreamContext,
    run: str | None,
    session: str,
    *,
    stream: str = "EVENTS",
    codec: Codec | None = None,
) -> list[SessionEvent]:
    """``DirectReader.read_session`` for one read."""
    async with _reader(js, codec) as reader:
        return await reader.read_session(run, session, stream=stream)


async def read_session_after(
    js: JetStreamContext,
    run: str | None,
    session: str,
    after_seq: int = 0,
    *,
    stream: str = "EVENTS",
    codec: Codec | None = None,
) -> SessionTail:
    """``DirectReader.read_session_after`` for one read."""
    async with _reader(js, codec) as reader:
        return await reader.read_session_after(run, session, after_seq, stream=stream)


async def stored_msg_ids(
    js: JetStreamContext,
    stream: str,
    subject: str,
    wanted: Collection[str],
    *,
    since: datetime.datetime,
    batch: int = 512,
    timeout_s: float = 5.0,
) -> set[str]:
    """Which of ``wanted`` are Msg-Ids of messages on ``subject`` in ``stream`` since ``since``.

    Reads headers only, through an ephemeral no-ack consumer that starts at ``since``; it reads
    the messages that matched when it was made (never chasing newer ones) and stops early once
    every wanted id is found. The stream's duplicate window only answers this for the last
    minutes; this answers it for any age, at the cost of a scan of the subject since ``since``.
    """
    want = set(wanted)
    found: set[str] = set()
    if not want:
        return found
    async with contextlib.aclosing(
        _scan_msg_ids(js, stream, subject, since, batch, timeout_s)
    ) as scan:
        async for ids in scan:
            found.update(ids)
            found &= want
            if found == want:
                break
    return found


async def msg_id_counts(
    js: JetStreamContext,
    stream: str,
    subject: str,
    *,
    since: datetime.datetime | None = None,
    batch: int = 512,
    timeout_s: float = 5.0,
) -> collections.Counter[str]:
    """How many messages on ``subject`` in ``stream`` (since ``since``; None: all) carry each
    Msg-Id; the same headers-only scan as ``stored_msg_ids``, read to the end. (A Msg-Id is
    held more than once when a copy came after the stream's duplicate window.)"""
    counts: collections.Counter[str] = collections.Counter()
    async with contextlib.aclosing(
        _scan_msg_ids(js, stream, subject, since, batch, timeout_s)
    ) as scan:
        async for ids in scan:
            counts.update(ids)
    return counts


async def _scan_msg_ids(
    js: JetStreamContext,
    stream: str,
    subject: str,
    since: datetime.datetime | None,
    batch: int,
    timeout_s: float,
) -> AsyncGenerator[list[str], None]:
    """The Msg-Ids of the messages on ``subject`` (headers only), a fetch at a time."""
    where = f"{subject} in {stream}" + (f" since {since.isoformat()}" if since else "")
    config = js_api.ConsumerConfig(
        deliver_policy=js_api.DeliverPolicy.BY_START_TIME
        if since is not None
        else js_api.DeliverPolicy.ALL,
        opt_start_time=since,
        ack_policy=js_api.AckPolicy.NONE,
        filter_subject=subject,
        headers_only=True,
        mem_storage=True,
        num_replicas=1,
        inactive_threshold=max(timeout_s * 2, 10.0),  # the server drops it if we die mid-scan
    )
    try:
        info = await js.add_consumer(stream, config)
        left = info.num_pending or 0
        sub = await js.pull_subscribe_bind(info.name, stream=stream)
        try:
            while left > 0:
                msgs = await fetch(sub, min(batch, left), timeout_s)
                if not msgs:
                    raise EventLogUnavailable(
                        f"scanning {where}: {left} message(s) not delivered within {timeout_s}s"
                    )
                left -= len(msgs)
                yield [m.headers.get(_MSG_ID, "") for m in msgs if m.headers]
        finally:
            await release(sub)
            with contextlib.suppress(nats.errors.Error, OSError, TimeoutError):
                await js.delete_consumer(stream, info.name)
    except (TimeoutError, nats.errors.Error, OSError) as exc:
        raise EventLogUnavailable(f"scanning {where}: {type(exc).__name__}: {exc}") from exc


async def read_range(
    js: JetStreamContext,
    stream: str,
    subject: str,
    first: int,
    last: int,
    *,
    timeout_s: float = 5.0,
) -> AsyncIterator[StoredMessage]:
    """Messages on ``subject`` with stream sequences ``first``..``last``, in order, read with an
    ordered consumer (nothing in the stream changes). Ends early at the stream's end."""
    where = f"{stream} seq {first}..{last}"
    try:
        sub = await js.subscribe(
            subject,
            stream=stream,
            ordered_consumer=True,
            config=js_api.ConsumerConfig(
                deliver_policy=js_api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=first
            ),
        )
    except (TimeoutError, nats.errors.Error, OSError) as exc:
        raise EventLogUnavailable(f"reading {where}: {exc}") from exc
    try:
        # None: the range ends past the stream's last message
        while (msg := await _next_msg(sub, where, timeout_s)) is not None:
            seq = int(msg.metadata.sequence.stream)
            if seq > last:
                return
            yield StoredMessage(seq, msg.subject, msg.data, (msg.headers or {}).get(_MSG_ID))
            if seq == last or msg.metadata.num_pending == 0:
                return
    finally:
        with contextlib.suppress(nats.errors.Error, OSError):
            await sub.unsubscribe()


async def read_subject(
    js: JetStreamContext,
    stream: str,
    subject: str,
    *,
    since: datetime.datetime | None = None,
    until: datetime.datetime | None = None,
    timeout_s: float = 5.0,
) -> AsyncIterator[tuple[StoredMessage, float, int]]:
    """Every message on ``subject`` stored in [``since``, ``until``], in stream order, with its
    stored time (epoch seconds) and how many remain after it (for progress); read with an
    ordered consumer up to what the stream held when the read began."""
    where = f"{subject} in {stream}"
    policy = (
        js_api.ConsumerConfig(
            deliver_policy=js_api.DeliverPolicy.BY_START_TIME, opt_start_time=since
        )
        if since is not None
        else js_api.ConsumerConfig(deliver_policy=js_api.DeliverPolicy.ALL)
    )
    try:
        sub = await js.subscribe(subject, stream=stream, ordered_consumer=True, config=policy)
    except (TimeoutError, nats.errors.Error, OSError) as exc:
        raise EventLogUnavailable(f"reading {where}: {exc}") from exc
    try:
        # None: nothing (more) on the subject
        while (msg := await _next_msg(sub, where, timeout_s)) is not None:
            meta = msg.metadata
            at = meta.timestamp.timestamp()
            if until is not None and at > until.timestamp():
                return
            stored = StoredMessage(
                int(meta.sequence.stream), msg.subject, msg.data, (msg.headers or {}).get(_MSG_ID)
            )
            yield stored, at, int(meta.num_pending or 0)
            if not meta.num_pending:
                return
    finally:
        with contextlib.suppress(nats.errors.Error, OSError):
            await sub.unsubscribe()


async def _next_msg(sub: Any, where: str, timeout_s: float) -> Msg | None:
    """The ordered consumer's next message; None when none comes within ``timeout_s``."""
    try:
        msg: Msg = await sub.next_msg(timeout=timeout_s)
    except (TimeoutError, nats.errors.TimeoutError):
        return None
    except (nats.errors.Error, OSError) as exc:
        raise EventLogUnavailable(f"reading {where}: {exc}") from exc
    return msg
