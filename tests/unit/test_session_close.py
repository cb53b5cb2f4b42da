"""Closing a session the reaper closed first (issue 10 soak): the client learns it, never a 200.

The log is an in-memory list of events here (the aggregate and the service are pure around the
Publisher port); the race it stands for was seen against a real nats-server in the chaos soak:
a client's close retried through an outage while the reaper stored its own close first, both
with the Msg-Id ``<run>.<session>.close``.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from eventlog import PublishReceipt
from gateway.core.session_store import SessionStore
from gateway.errors import SessionClosed as ClosedAlready
from gateway.protocol.session_api import CloseSessionRequest, CreateSessionRequest
from gateway.serving.session_service import SessionService
from schemas import Event, SessionClosed, SessionEvent, route


class ReaperFirstLog:
    """Stores events by Msg-Id; the reaper's close is stored before the client's arrives."""

    def __init__(self) -> None:
        self.events: dict[str, Event] = {}
        self.reaper_closes = True

    async def publish(self, event: Event) -> PublishReceipt:
        msg_id = route(event).msg_id
        if isinstance(event, SessionClosed) and self.reaper_closes:
            reaped = SessionClosed(
                run=event.run, session=event.session, status="timeout", num_turns=0
            )
            self.events.setdefault(msg_id, reaped)
        duplicate = msg_id in self.events
        self.events.setdefault(msg_id, event)
        return PublishReceipt(msg_id, "EVENTS", len(self.events), duplicate=duplicate)

    async def publish_many(self, events: Sequence[Event]) -> list[PublishReceipt]:
        return [await self.publish(e) for e in events]

    async def publish_raw(self, subject: str, payload: bytes, msg_id: str) -> PublishReceipt:
        raise AssertionError("the session service publishes events only")

    async def recover(self, run: str, session: str) -> Sequence[SessionEvent]:
        return [e for e in self.events.values() if isinstance(e, SessionEvent)]


@pytest.mark.parametrize("reaper_first", [True, False])
async def test_a_close_after_the_reapers_is_a_409_naming_it(reaper_first: bool) -> None:
    log = ReaperFirstLog()
    service = SessionService(
        store=SessionStore(recover=log.recover),
        publisher=log,
        model_name="tiny",
        recover=log.recover,
    )
    session = await service.create("r", CreateSessionRequest(session_id="s"))
    log.reaper_closes = reaper_first
    close = CloseSessionRequest(status="completed", reward=1.0)
    if reaper_first:
        with pytest.raises(ClosedAlready, match=r"closed as 'timeout' \(by the reaper"):
            await service.close(session, close)
    else:
        info = await service.close(session, close)
        assert info.status == "completed"
