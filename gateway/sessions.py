"""Sessions as the gateway keeps them between turns (what the next turn's prompt extends).

A session's state is small: its ids, the previous turn's full context (prompt + completion
ids), the conversation as the client saw it (messages + the assistant reply returned), the
tools, the next turn index, and whether it is closed. Turns of one session are serialized by
its lock: an agent's turn t+1 depends on turn t's reply.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gateway.errors import SessionClosed, SessionNotFound
from schemas.delta import replay_context
from schemas.events import SessionClosed as SchemaSessionClosed
from schemas.events import SessionEvent, SessionOpened, TurnCompleted

__all__ = ["Session", "SessionStore"]

JSON = dict[str, Any]


@dataclass
class Session:
    run: str
    id: str
    group: str | None = None
    metadata: JSON = field(default_factory=dict)
    created_at: float = field(default_factory=time.time)
    next_turn: int = 0
    context_ids: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int32))
    conversation: list[JSON] = field(default_factory=list)  # messages + reply, as returned
    tools: list[JSON] | None = None
    last_completion_ids: list[int] = field(default_factory=list)
    last_prompt_len: int = 0
    closed: bool = False
    status: str = "open"
    replica: str | None = None
    last_activity: float = field(default_factory=time.monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)

    def ensure_open(self) -> None:
        if self.closed:
            raise SessionClosed(
                f"session {self.id} (run {self.run}) is closed ({self.status}); "
                f"open a new session for a new episode"
            )

    @classmethod
    def from_events(cls, events: Sequence[SessionEvent]) -> Session | None:
        """The state after ``events`` (one session's, from the log), or None if there are none.

        A gateway that restarted, or a second gateway, continues such a session where it
        stopped: the next turn gets the next index and extends the recorded tokens."""
        if not events:
            return None
        opened = next((e for e in events if isinstance(e, SessionOpened)), None)
        turns = sorted(
            {e.turn: e for e in events if isinstance(e, TurnCompleted)}.values(),
            key=lambda e: e.turn,
        )
        closed = next((e for e in events if isinstance(e, SchemaSessionClosed)), None)
        first = events[0]
        session = cls(
            run=first.run,
            id=first.session,
            group=opened.group if opened else None,
            metadata=dict(opened.metadata) if opened else {},
            created_at=(opened or first).created_at,
            next_turn=len(turns),
        )
        if turns:
            session.context_ids, session.conversation = replay_context(turns)
            session.last_completion_ids = turns[-1].completion_ids.tolist()
            latest = next((t.tools for t in reversed(turns) if t.tools is not None), None)
            session.tools = latest or None  # [] recorded a removal

        if closed is not None:
            session.closed, session.status = True, closed.status
        return session

    def catch_up(self, logged: Session) -> None:
        """Take the turns of ``logged`` (this session as the log has it) as the latest ones."""
        self.next_turn = logged.next_turn
        self.context_ids = logged.context_ids
        self.conversation = logged.conversation
        self.last_completion_ids = logged.last_completion_ids
        self.tools = logged.tools

    def describe(self) -> JSON:
        return {
            "session_id": self.id,
            "run": self.run,
            "group": self.group,
            "metadata": self.metadata,
            "turns": self.next_turn,
            "status": self.status,
            "closed": self.closed,
            "created_at": self.created_at,
        }


class SessionStore:
    """The sessions this gateway process serves (sticky: one gateway per session)."""

    def __init__(self) -> None:
        self._sessions: dict[str, Session] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def add(self, session: Session) -> Session:
        self._sessions[session.id] = session
        return session

    def find(self, session_id: str) -> Session | None:
        return self._sessions.get(session_id)

    def get(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise SessionNotFound(
                f"no session {session_id!r} on this gateway; create one with POST /v1/sessions "
                f"or send an X-Session-Id header to /v1/chat/completions"
            )
        return session

    def forget_closed(self, older_than_s: float) -> int:
        """Drop closed sessions idle longer than ``older_than_s`` (their events are in the log)."""
        cutoff = time.monotonic() - older_than_s
        gone = [k for k, s in self._sessions.items() if s.closed and s.last_activity < cutoff]
        for key in gone:
            del self._sessions[key]
        return len(gone)
