"""The session API's logic: open (atomic per run and session id), use, reward, close.

Every change of a session goes through its events: opening publishes ``SessionOpened`` and the
state is that event applied; a close publishes ``SessionClosed`` with the number of turns the
log holds (the log is read back first: it may hold a turn this process does not, e.g. one
answered 503 that was stored late).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

from eventlog import Publisher
from gateway.core.aggregate import SessionState, apply, fold
from gateway.core.session_store import Session, SessionKey, SessionStore
from gateway.errors import InvalidRequest, SessionExists, SessionNotFound
from gateway.errors import SessionClosed as ClosedAlready
from gateway.protocol.session_api import (
    CloseSessionRequest,
    CreateSessionRequest,
    RewardReceipt,
    RewardRequest,
    SessionInfo,
)
from schemas import RewardAssigned, SessionClosed, SessionEvent, SessionOpened
from schemas.errors import EventLogUnavailable
from schemas.ids import new_session_id

__all__ = ["SessionService", "session_info"]

log = logging.getLogger(__name__)
Recover = Callable[[str, str], Awaitable[Sequence[SessionEvent]]]


def session_info(state: SessionState) -> SessionInfo:
    return SessionInfo.build(**state.describe())


class SessionService:
    def __init__(
        self,
        *,
        store: SessionStore,
        publisher: Publisher,
        model_name: str,
        recover: Recover | None = None,
    ) -> None:
        self.store = store
        self.publisher = publisher
        self.model_name = model_name
        self._recover = recover

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
    ) -> SessionState:
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
        if receipt.duplicate and self._recover is not None:
            # Another gateway opened it first (same Msg-Id): the log's session is the session.
            logged = fold(await self._recover(run, sid), kept=self.store.kept)
            if logged is not None:
                return logged
        state = apply(None, event, kept=self.store.kept)
        assert state is not None
        return state

    async def reward(self, session: Session, req: RewardRequest) -> RewardReceipt:
        async with session.lock:
            session.ensure_open()
            state = session.state
            if req.turn is not None and req.turn >= state.turns:
                raise InvalidRequest(
                    f"turn {req.turn} of session {session.name} has not happened "
                    f"(turns so far: {state.turns})",
                    param="turn",
                )
            receipt = await self.publisher.publish(
                RewardAssigned(
                    run=state.run,
                    session=state.id,
                    value=req.value,
                    turn=req.turn,
                    key=req.key,
                    source=req.source,
                    info=req.info,
                    created_at=time.time(),
                )
            )
        return RewardReceipt.build(session_id=state.id, acknowledged=True, seq=receipt.seq or 0)

    async def close(self, session: Session, req: CloseSessionRequest) -> SessionInfo:
        async with session.lock:
            await self._catch_up(session)
            session.ensure_open()
            state = session.state
            event = SessionClosed(
                run=state.run,
                session=state.id,
                status=req.status,
                reward=req.reward,
                num_turns=state.turns,
                created_at=time.time(),
            )
            receipt = await self.publisher.publish(event)
            if receipt.duplicate:
                # A close with this Msg-Id was stored first: ours (a retry whose first ack was
                # lost) or the reaper's, if it found the session idle meanwhile.
                await self._catch_up(session)
                logged = session.state
                if logged.closed and logged.status != req.status:
                    self.store.closed(session)
                    raise ClosedAlready(
                        f"session {session.name} was closed as {logged.status!r} (by the reaper: "
                        f"idle too long) before this close arrived; its status and reward stay "
                        f"as closed"
                    )
            session.apply(event)
        self.store.closed(session)
        return session_info(session.state)

    async def _catch_up(self, session: Session) -> None:
        """Take the log's state where it is ahead of ours (more turns, or closed)."""
        if self._recover is None:
            return
        try:
            logged = fold(await self._recover(*session.key), kept=session.state.kept)
        except EventLogUnavailable as exc:
            # The outbox may hold what the log does not yet: our state is the better one.
            log.warning("closing %s without reading the log back: %s", session.name, exc)
            return
        if logged is not None and (
            logged.turns > session.state.turns or (logged.closed and not session.state.closed)
        ):
            session.recovered(logged)
