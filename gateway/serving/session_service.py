"""The session API's logic: open (atomic per run and session id), use, reward, close.

Every change of a session goes through its events: opening publishes ``SessionOpened`` and the
state is that event applied; a reward publishes ``RewardAssigned``, a close ``SessionClosed``
with the number of turns the log holds. Both state the session's last sequence as this gateway
knows it (DESIGN §4: the log decides): refused, the session catches up on what another writer
stored meanwhile (a turn another gateway served, one answered 503 that was stored late, a close)
and the event is built again, or refused with 409 where the log holds the session closed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from eventlog import AppendRefused, Publisher, PublishReceipt
from gateway.core.aggregate import SessionState, apply
from gateway.core.session_store import Session, SessionKey, SessionLog, SessionStore
from gateway.errors import InvalidRequest, SessionExists, SessionNotFound
from gateway.errors import SessionClosed as ClosedAlready
from gateway.metrics import GatewayMetrics
from gateway.protocol.session_api import (
    CloseSessionRequest,
    CreateSessionRequest,
    RewardReceipt,
    RewardRequest,
    SessionInfo,
)
from schemas import Event, RewardAssigned, SessionClosed, SessionEvent, SessionOpened, route
from schemas.errors import EventLogUnavailable
from schemas.ids import new_session_id

__all__ = ["SessionService", "session_info"]

log = logging.getLogger(__name__)
_E = TypeVar("_E", bound=Event)


def _stored(events: list[SessionEvent], event: Event) -> bool:
    """Whether ``events`` (read back from the log) hold ``event`` itself: its Msg-Id and its
    moment of making (another writer's event under the same Msg-Id was made at another)."""
    msg_id = route(event).msg_id
    return any(route(e).msg_id == msg_id and e.created_at == event.created_at for e in events)


def session_info(state: SessionState) -> SessionInfo:
    return SessionInfo.build(**state.describe())


class SessionService:
    def __init__(
        self,
        *,
        store: SessionStore,
        publisher: Publisher,
        model_name: str,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self.store = store
        self.publisher = publisher
        self.model_name = model_name
        self.metrics = metrics

    async def create(self, run: str, req: CreateSessionRequest) -> Session:
        """Open a session (idempotent: the same body again gets the same session); another
        group or metadata for an existing id is a conflict."""
        sid = req.session_id or new_session_id()
        session = await self.store.load(
            (run, sid), lambda: self._open((run, sid), req.group, req.metadata)
        )
        assert session is not None  # created when missing
        state = session.state
        if (state.group, state.metadata) != (req.group, req.metadata):
            raise SessionExists(
                f"session {sid} exists in run {run} with another group or metadata; "
                "use a new session_id for a new episode",
                param="session_id",
            )
        return session

    @asynccontextmanager
    async def use(
        self, run: str, sid: str, *, open_missing: bool = False
    ) -> AsyncIterator[Session]:
        """The session (``open_missing``: opened when it does not exist), held for the block."""
        key = (run, sid)
        create = (lambda: self._open(key, None, {})) if open_missing else None
        session = await self.store.load(key, create)
        if session is None:
            raise SessionNotFound(
                f"no session {sid!r} in run {run!r}; create one with POST /v1/sessions or send "
                "an X-Session-Id header to /v1/chat/completions"
            )
        release = self.store.hold(session)
        try:
            yield session
        finally:
            release()

    async def _open(
        self, key: SessionKey, group: str | None, metadata: dict[str, Any]
    ) -> tuple[SessionState, int]:
        run, sid = key
        event = SessionOpened(
            run=run,
            session=sid,
            group=group,
            metadata=metadata,
            model=self.model_name,
            created_at=time.time(),
        )
        receipt = await self.publisher.publish(event)
        log_ = self.store.log
        if receipt.duplicate and log_ is not None:
            # Another gateway opened it first (same Msg-Id): the log's session is the session.
            logged, seq = await log_.load(key, self.store.kept)
            if logged is not None:
                return logged, seq
        state = apply(None, event, kept=self.store.kept)
        assert state is not None
        # Spooled (no sequence yet) or a duplicate: 0, and the first append catches up.
        return state, 0 if receipt.duplicate else receipt.seq or 0

    async def reward(self, session: Session, req: RewardRequest) -> RewardReceipt:
        async with session.lock:
            session.ensure_open()
            run, sid = session.key

            def event(state: SessionState) -> RewardAssigned:
                if req.turn is not None and req.turn >= state.turns:
                    raise InvalidRequest(
                        f"turn {req.turn} of session {session.name} has not happened "
                        f"(turns so far: {state.turns})",
                        param="turn",
                    )
                return RewardAssigned(
                    run=run,
                    session=sid,
                    value=req.value,
                    turn=req.turn,
                    key=req.key,
                    source=req.source,
                    info=req.info,
                    created_at=time.time(),
                )

            receipt, _ = await self._append(session, "reward", event)
        return RewardReceipt.build(session_id=sid, acknowledged=True, seq=receipt.seq or 0)

    async def close(self, session: Session, req: CloseSessionRequest) -> SessionInfo:
        async with session.lock:
            if self.store.log is not None:
                # The log may hold turns this gateway does not (another's; one answered 503
                # that was stored late): num_turns counts the log's.
                await self.store.catch_up(session, "unsure")
            if session.state.closed:
                self._closed_elsewhere(session, closing=True)

            def event(state: SessionState) -> SessionClosed:
                return SessionClosed(
                    run=state.run,
                    session=state.id,
                    status=req.status,
                    reward=req.reward,
                    num_turns=state.turns,
                    created_at=time.time(),
                )

            receipt, closing = await self._append(session, "close", event)
            if receipt.duplicate and self.store.log is None:
                # Without a log to state an expectation to: a close with this Msg-Id was
                # stored first, ours (a retry whose first ack was lost) or the reaper's.
                logged = session.state
                if logged.closed and logged.status != req.status:
                    self.store.closed(session)
                    raise ClosedAlready(
                        f"session {session.name} was closed as {logged.status!r} before this "
                        "close arrived; its status and reward stay as closed"
                    )
            session.apply(closing)
        self.store.closed(session)
        return session_info(session.state)

    async def _append(
        self, session: Session, kind: str, build: Callable[[SessionState], _E]
    ) -> tuple[PublishReceipt, _E]:
        """Publish ``build(state)`` stating the session's last sequence as known here; refused
        (another writer stored events meanwhile), catch up and build it again; a session the
        log holds closed is a 409 (``ensure_open``). The caller holds the session's lock and
        applies the event."""
        log_ = self.store.log
        for _ in range(SessionLog.max_refusals):
            event = build(session.state)
            if log_ is None:
                return await self.publisher.publish(event), event
            try:
                receipt = await self.publisher.publish(event, expect=log_.expectation(session))
            except AppendRefused as refused:
                if self.metrics is not None:
                    self.metrics.appends_refused.labels(kind).inc()
                caught = await self.store.catch_up(session, "refused", reach=refused.last_seq)
                if _stored(caught, event):  # by an earlier try of this publish, ack lost
                    return PublishReceipt(refused.msg_id, log_.stream, None, True), event
                if session.state.closed:
                    self._closed_elsewhere(session, closing=isinstance(event, SessionClosed))
                continue
            if receipt.duplicate:
                # The log holds this Msg-Id already (a replicated stream de-duplicates before
                # it checks the expectation): ours, from a try whose ack was lost, or another
                # writer's event under the same id (the reaper's close; a reward's retry).
                caught = await self.store.catch_up(session, "refused")
                if isinstance(event, SessionClosed) and not _stored(caught, event):
                    self._closed_elsewhere(session, closing=True)
                return receipt, event
            log_.appended(session, receipt)
            return receipt, event
        raise EventLogUnavailable(
            f"session {session.name}: {SessionLog.max_refusals} appends of its {kind} in a row "
            "were refused, other writers appending to it each time; send the request again"
        )

    def _closed_elsewhere(self, session: Session, *, closing: bool) -> None:
        """The log holds ``session`` closed (by the reaper, or a close sent to another
        gateway): 409, naming how it was closed where the request was a close."""
        self.store.closed(session)
        state = session.state
        if closing:
            raise ClosedAlready(
                f"session {session.name} was closed as {state.status!r} (by the reaper: idle "
                "too long, or a close sent to another gateway) before this close arrived; its "
                "status and reward stay as closed"
            )
        session.ensure_open()
