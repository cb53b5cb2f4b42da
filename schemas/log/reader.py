"""Reading one session's events back from the EVENTS stream, in stream order.

Uses JetStream direct get with ``next_by_subj`` (the stream is provisioned with allow_direct):
one request per event, served by any replica, no consumer state on the server. Used by fold
workers to rehydrate a closed session and by the gateway to recover a session it does not hold
in memory (after a restart).
"""

from __future__ import annotations

from nats.js import JetStreamContext
from nats.js import errors as js_errors

from schemas.codec import Codec
from schemas.errors import EventLogUnavailable
from schemas.events import SessionEvent, TrajectoryReady
from schemas.ids import session_subjects

__all__ = ["read_session"]


async def read_session(
    js: JetStreamContext,
    run: str | None,
    session: str,
    *,
    stream: str = "EVENTS",
    codec: Codec | None = None,
) -> list[SessionEvent]:
    """Every event of ``run``/``session`` in ``stream``, decoded, in stream order.
    ``run`` None matches the session in any run (session ids are unique)."""
    codec = codec or Codec()
    subject = session_subjects(run or "*", session)
    events: list[SessionEvent] = []
    seq = 1
    while True:
        try:
            msg = await js.get_msg(stream, seq=seq, subject=subject, next=True, direct=True)
        except js_errors.NotFoundError:
            return events
        except (TimeoutError, js_errors.Error) as exc:
            raise EventLogUnavailable(
                f"reading session {run or '*'}/{session} from {stream} at seq {seq}: {exc}"
            ) from exc
        assert msg.seq is not None and msg.data is not None
        event = codec.decode(msg.data)
        if not isinstance(event, TrajectoryReady):
            events.append(event)
        seq = msg.seq + 1
