"""Reading one session's events back from the EVENTS stream, in stream order.

Uses JetStream's *batched* direct get (nats-server >= 2.11; the stream is provisioned with
allow_direct): one request ``{"seq": s, "next_by_subj": "ts.ev.<run>.<session>.*", "batch": n}``
answered by up to ``n`` messages and an end-of-batch status, served by any replica, with no
consumer state on the server. A session is usually one round trip. Fold workers rehydrate a
closed session with it; the gateway recovers a session it does not hold in memory.
``read_session_after`` reads only what follows a stream sequence (the same request, starting
there): what an append refused for a stale expectation must catch up on (issue 36).
(benchmarks/pipeline_throughput.py compares it with one direct get per event and with an
ordered consumer.)

``stored_msg_ids`` answers the other question a redelivered fold asks: which of these Msg-Ids
does a subject already hold, past the stream's duplicate window? ``msg_id_counts`` (how many
copies of each) is what a replay asks.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime
import json
from collections.abc import AsyncGenerator, AsyncIterator, Collection
from dataclasses import dataclass
from typing import Any

import nats.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js import api as js_api

from eventlog.pull import fetch, release
from schemas.codec import Codec
from schemas.errors import EventLogUnavailable
from schemas.events import SessionEvent
from schemas.ids import session_subjects
from schemas.trust import StoredMessage, vet_session

__all__ = [
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

_STATUS = "Status"
_END_OF_BATCH = "204"
_NOT_FOUND = "404"
_MSG_ID = "Nats-Msg-Id"


async def read_session_messages(
    js: JetStreamContext,
    run: str | None,
    session: str,
    *,
    stream: str = "EVENTS",
    after_seq: int = 0,
    batch: int = 1024,
    max_bytes: int = 16 * 1024 * 1024,
    timeout_s: float = 5.0,
) -> list[StoredMessage]:
    """Every message of ``run``/``session`` in ``stream`` stored after stream sequence
    ``after_seq`` (0: all), undecoded, in stream order. ``run`` None matches the session in any
    run (session ids are unique). ``timeout_s``: the longest wait for the next message of a
    batch."""
    return await read_subjects_after(
        js,
        stream,
        session_subjects(run or "*", session),
        after_seq,
        where=f"session {run or '*'}/{session} in {stream}",
        batch=batch,
        max_bytes=max_bytes,
        timeout_s=timeout_s,
    )


async def read_subjects_after(
    js: JetStreamContext,
    stream: str,
    subject: str,
    after_seq: int = 0,
    *,
    where: str = "",
    batch: int = 1024,
    max_bytes: int = 16 * 1024 * 1024,
    timeout_s: float = 5.0,
) -> list[StoredMessage]:
    """Every message on ``subject`` (a filter) in ``stream`` after ``after_seq``, undecoded, in
    stream order, by batched direct get; ``where`` names the read in errors."""
    # nats-py has no batched direct get; the request is plain core NATS on its connection. The
    # answers are taken by a callback on the subscription's own task: ``next_msg`` per message
    # made two tasks and a timer each (~75 us; 2.15 -> 1.23 ms of CPU per 11-event session).
    nc: Any = js._nc
    where = where or f"{subject} in {stream}"
    api = f"$JS.API.DIRECT.GET.{stream}"
    found: list[StoredMessage] = []
    loop = asyncio.get_running_loop()
    ended: asyncio.Future[dict[str, str]] = loop.create_future()  # a batch's closing status

    async def take(msg: Msg) -> None:
        if ended.done():
            return
        headers = msg.headers or {}
        try:
            if _STATUS in headers:
                ended.set_result(headers)
            else:
                found.append(
                    StoredMessage(
                        int(headers["Nats-Sequence"]),
                        headers["Nats-Subject"],
                        msg.data,
                        headers.get(_MSG_ID),
                    )
                )
        except (KeyError, ValueError) as exc:  # a malformed answer fails the read, named
            ended.set_exception(
                EventLogUnavailable(f"reading {where}: an answer without its headers: {exc!r}")
            )

    seq = after_seq + 1
    try:
        sub = await nc.subscribe(nc.new_inbox(), cb=take)
    except (nats.errors.Error, OSError) as exc:
        raise EventLogUnavailable(f"reading {where}: {exc}") from exc
    try:
        while True:
            # max_bytes: the batch arrives as one burst; past the server's slow-consumer limit
            # it would cut the connection.
            request = {"seq": seq, "next_by_subj": subject, "batch": batch, "max_bytes": max_bytes}
            await nc.publish(api, json.dumps(request).encode(), reply=sub.subject)
            taken = -1
            while not ended.done():
                if len(found) == taken:  # nothing came for timeout_s
                    raise TimeoutError(f"no answer within {timeout_s} s")
                taken = len(found)
                await asyncio.wait((ended,), timeout=timeout_s)
            headers = ended.result()
            status = headers[_STATUS]
            if status == _NOT_FOUND:
                return found
            if status != _END_OF_BATCH:
                raise EventLogUnavailable(
                    f"reading {where} at seq {seq}: JetStream answered {status} "
                    f"{headers.get('Description', '')}"
                )
            if not found or int(headers.get("Nats-Num-Pending", 0)) == 0:
                return found
            seq = found[-1].seq + 1
            ended = loop.create_future()
    except (TimeoutError, nats.errors.Error, OSError) as exc:
        raise EventLogUnavailable(
            f"reading {where} at seq {seq}: {type(exc).__name__}: {exc}"
        ) from exc
    finally:
        # A failed unsubscribe means the connection is gone, and the subscription with it.
        with contextlib.suppress(nats.errors.Error, OSError):
            await sub.unsubscribe()


async def read_session(
    js: JetStreamContext,
    run: str | None,
    session: str,
    *,
    stream: str = "EVENTS",
    codec: Codec | None = None,
) -> list[SessionEvent]:
    """The trusted events of ``run``/``session`` in ``stream``, decoded, in stream order
    (``schemas.trust``: events stored under another subject, without a Msg-Id, or conflicting
    with an earlier turn are left out; bytes that are no event raise ``PoisonEvent``)."""
    stored = await read_session_messages(js, run, session, stream=stream)
    return vet_session(stored, codec or Codec()).events


@dataclass(frozen=True)
class SessionTail:
    """A session's trusted events stored after ``after_seq``, each with its stream sequence,
    in stream order; ``last_seq``: the last stream sequence the read saw on the session's
    subjects, trusted or not (``after_seq`` if none). ``last_seq``, not the last event's, is
    what the next append expects: the log counts every message there, untrusted ones too."""

    after_seq: int
    events: list[tuple[int, SessionEvent]]
    last_seq: int


async def read_session_after(
    js: JetStreamContext,
    run: str | None,
    session: str,
    after_seq: int = 0,
    *,
    stream: str = "EVENTS",
    codec: Codec | None = None,
) -> SessionTail:
    """The trusted events of ``run``/``session`` stored after stream sequence ``after_seq``
    (0: the whole session), with their sequences; one batched direct get from ``after_seq + 1``
    on the session's subjects, so a catch-up costs what follows, not the session.

    The trust rules are ``read_session``'s over what is read: a message under another subject
    or without a Msg-Id is left out, undecodable bytes raise ``PoisonEvent``; a second, different
    turn is left out only against turns read here: one that conflicts with a turn at or before
    ``after_seq`` is returned, and the caller, which holds those, keeps the first."""
    stored = await read_session_messages(js, run, session, stream=stream, after_seq=after_seq)
    vetted = vet_session(stored, codec or Codec())
    return SessionTail(
        after_seq,
        list(zip(vetted.seqs, vetted.events, strict=True)),
        stored[-1].seq if stored else after_seq,
    )


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
