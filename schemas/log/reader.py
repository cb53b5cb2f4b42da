"""Reading one session's events back from the EVENTS stream, in stream order.

Uses JetStream's *batched* direct get (nats-server >= 2.11; the stream is provisioned with
allow_direct): one request ``{"seq": s, "next_by_subj": "ts.ev.<run>.<session>.*", "batch": n}``
answered by up to ``n`` messages and an end-of-batch status, served by any replica, with no
consumer state on the server. A session is usually one round trip. Fold workers rehydrate a
closed session with it; the gateway recovers a session it does not hold in memory.
(benchmarks/pipeline_throughput.py compares it with one direct get per event and with an
ordered consumer.)
"""

from __future__ import annotations

import contextlib
import json
from typing import Any, NamedTuple

import nats.errors
from nats.js import JetStreamContext

from schemas.codec import Codec
from schemas.errors import EventLogUnavailable
from schemas.events import SessionEvent, TrajectoryReady
from schemas.ids import session_subjects

__all__ = ["StoredMessage", "read_session", "read_session_messages"]

_STATUS = "Status"
_END_OF_BATCH = "204"
_NOT_FOUND = "404"


class StoredMessage(NamedTuple):
    """One message as the stream holds it."""

    seq: int
    subject: str
    data: bytes


async def read_session_messages(
    js: JetStreamContext,
    run: str | None,
    session: str,
    *,
    stream: str = "EVENTS",
    batch: int = 1024,
    max_bytes: int = 16 * 1024 * 1024,
    timeout_s: float = 5.0,
) -> list[StoredMessage]:
    """Every message of ``run``/``session`` in ``stream``, undecoded, in stream order.
    ``run`` None matches the session in any run (session ids are unique)."""
    # nats-py has no batched direct get; the request is plain core NATS on its connection.
    nc: Any = js._nc
    where = f"session {run or '*'}/{session} in {stream}"
    subject = session_subjects(run or "*", session)
    api = f"$JS.API.DIRECT.GET.{stream}"
    found: list[StoredMessage] = []
    seq = 1
    try:
        sub = await nc.subscribe(nc.new_inbox())
    except (nats.errors.Error, OSError) as exc:
        raise EventLogUnavailable(f"reading {where}: {exc}") from exc
    try:
        while True:
            # max_bytes: the batch arrives as one burst; past the server's slow-consumer limit
            # it would cut the connection.
            request = {"seq": seq, "next_by_subj": subject, "batch": batch, "max_bytes": max_bytes}
            await nc.publish(api, json.dumps(request).encode(), reply=sub.subject)
            while True:
                msg = await sub.next_msg(timeout=timeout_s)
                headers = msg.headers or {}
                status = headers.get(_STATUS)
                if status == _NOT_FOUND:
                    return found
                if status == _END_OF_BATCH:
                    break
                if status is not None:
                    raise EventLogUnavailable(
                        f"reading {where} at seq {seq}: JetStream answered {status} "
                        f"{headers.get('Description', '')}"
                    )
                found.append(
                    StoredMessage(int(headers["Nats-Sequence"]), headers["Nats-Subject"], msg.data)
                )
            if not found or int(headers.get("Nats-Num-Pending", 0)) == 0:
                return found
            seq = found[-1].seq + 1
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
    """Every event of ``run``/``session`` in ``stream``, decoded, in stream order."""
    codec = codec or Codec()
    events: list[SessionEvent] = []
    for stored in await read_session_messages(js, run, session, stream=stream):
        event = codec.decode(stored.data)
        if not isinstance(event, TrajectoryReady):
            events.append(event)
    return events
