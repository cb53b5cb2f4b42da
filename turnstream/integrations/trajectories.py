"""Waiting for a closed session's folded trajectories on the TRAJ stream.

One ``TrajectoryFeed`` per (log, run) serves every waiter in the process: an ordered consumer on
``ts.traj.<run>`` (no durable state on the server, nothing acknowledged: the shard writer and
trainers keep their own consumers), started at the stream's end *before* any session it waits
for is closed, so no trajectory can pass unseen. Each message is routed by its Msg-Id (the
trajectory id ``<run>/<session>/<segment>``) to the session's waiter, and decoded only when a
waiter wants it: a process waiting for a few sessions does not decode the whole run's feed.

A session may fold into several segments (forks: a turn that does not continue the conversation
before it). Every segment carries the count in its metadata
(``TrajectoryReady.expected_segments``), so a waiter is done when it holds that many distinct
segments. Waiting is bounded: ``TrajectoryTimeout`` names
the session, what arrived, and what to check (a fold worker must run on the log; the shard
writer plays no part in this).

``SessionRouter`` is the routing alone (pure, no I/O); ``TrajectoryFeed`` adds the subscription.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator

from eventlog import Connection, Following, LogSettings, connect, follow
from eventlog.connection import close_connection
from schemas.codec import Codec
from schemas.errors import SchemaError
from schemas.events import TrajectoryReady
from schemas.ids import traj_subject
from schemas.trust import StoredMessage
from turnstream.integrations.errors import TrajectoryTimeout

__all__ = ["SessionRouter", "SessionTrajectories", "TrajectoryFeed"]

log = logging.getLogger(__name__)


class SessionTrajectories:
    """The trajectories of one session as they arrive; done when every segment is here."""

    def __init__(self, run: str, session: str) -> None:
        self.run = run
        self.session = session
        self._segments: dict[int, TrajectoryReady] = {}
        self._expected: int | None = None
        self._done = asyncio.Event()

    @property
    def received(self) -> list[TrajectoryReady]:
        """What arrived so far, by segment."""
        return [self._segments[s] for s in sorted(self._segments)]

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def add(self, trajectory: TrajectoryReady) -> None:
        """Take one of the session's trajectories; a repeat (the feed is at least once) is
        dropped."""
        self._segments.setdefault(trajectory.segment, trajectory)
        self._expected = max(self._expected or 1, trajectory.expected_segments)
        if len(self._segments) >= self._expected:
            self._done.set()

    async def wait(self, timeout_s: float, *, where: str = "") -> list[TrajectoryReady]:
        """Every segment, by segment index; ``TrajectoryTimeout`` after ``timeout_s``."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._done.wait()
        except TimeoutError:
            raise TrajectoryTimeout(self._timeout_message(timeout_s, where)) from None
        return self.received

    def _timeout_message(self, timeout_s: float, where: str) -> str:
        got = (
            f"{len(self._segments)} of {self._expected} segments arrived"
            if self._segments
            else "none arrived"
        )
        return (
            f"the trajectories of session {self.run}/{self.session} did not reach "
            f"{traj_subject(self.run)}{where} within {timeout_s:g} s of its close ({got}): is a "
            f"fold worker running on this log (`turnstream up` runs one; else `turnstream worker "
            f"--log.url ...`)? A close it could not fold is dead-lettered: see `turnstream "
            f"status`. (The shard writer plays no part in this.)"
        )


class SessionRouter:
    """Which sessions are waited for, and the routing of trajectories to them (pure)."""

    def __init__(self, run: str) -> None:
        self.run = run
        self._waiting: dict[str, SessionTrajectories] = {}

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def wants(self, session: str) -> bool:
        return session in self._waiting

    @contextlib.contextmanager
    def expecting(self, session: str) -> Iterator[SessionTrajectories]:
        """Wait for ``session``'s trajectories while the block runs. Enter it before the
        session can be closed: what arrives before that is not kept."""
        if session in self._waiting:
            raise ValueError(f"session {self.run}/{session} is waited for already")
        waiter = SessionTrajectories(self.run, session)
        self._waiting[session] = waiter
        try:
            yield waiter
        finally:
            del self._waiting[session]

    def deliver(self, trajectory: TrajectoryReady) -> bool:
        """Hand ``trajectory`` to its session's waiter; False when nobody waits for it."""
        waiter = self._waiting.get(trajectory.session)
        if waiter is None or trajectory.run != self.run:
            return False
        waiter.add(trajectory)
        return True


def session_of_msg_id(msg_id: str | None) -> str | None:
    """The session named by a TRAJ Msg-Id (``<run>/<session>/<segment>``), if it is one."""
    parts = (msg_id or "").split("/")
    return parts[1] if len(parts) == 3 else None


class TrajectoryFeed:
    """An ordered consumer on ``ts.traj.<run>`` routing each trajectory to its session's waiter.

    ``open`` connects and subscribes; ``expecting(session)`` waits for one session (see
    ``SessionRouter``); ``close`` unsubscribes and, if it made it, closes the connection.
    """

    def __init__(
        self,
        nc: Connection,
        run: str,
        *,
        stream: str = "TRAJ",
        codec: Codec | None = None,
        log_url: str = "",
    ) -> None:
        self.run = run
        self.stream = stream
        self.log_url = log_url
        self.router = SessionRouter(run)
        self._nc = nc
        self._codec = codec or Codec()
        self._following: Following | None = None
        self._owns_connection = False
        self.undecodable = 0

    @classmethod
    async def open(
        cls, log_url: str, run: str, settings: LogSettings | None = None
    ) -> TrajectoryFeed:
        """A started feed on a connection of its own to ``log_url``."""
        settings = settings or LogSettings()
        nc = await connect(log_url, settings, name=f"turnstream-trajectories-{run}")
        feed = cls(
            nc,
            run,
            stream=settings.names.trajectories,
            codec=Codec(max_payload=settings.max_payload),
            log_url=log_url,
        )
        feed._owns_connection = True
        try:
            await feed.start()
        except BaseException:
            await close_connection(nc)
            raise
        return feed

    @property
    def where(self) -> str:
        """Where the feed reads, for messages: `` (TRAJ at nats://...)``."""
        return f" ({self.stream} at {self.log_url})" if self.log_url else f" ({self.stream})"

    def expecting(self, session: str) -> contextlib.AbstractContextManager[SessionTrajectories]:
        return self.router.expecting(session)

    async def start(self) -> None:
        """Subscribe from the stream's end: only trajectories stored from now on arrive."""
        subject = traj_subject(self.run)
        self._following = await follow(self._nc.jetstream(), self.stream, subject, self._on_message)

    async def close(self) -> None:
        if self._following is not None:
            await self._following.stop()
            self._following = None
        if self._owns_connection:
            await close_connection(self._nc)

    async def _on_message(self, msg: StoredMessage) -> None:
        session = session_of_msg_id(msg.msg_id)
        if session is not None and not self.router.wants(session):
            return  # another process's (or nobody's) session: not worth decoding
        try:
            trajectory = self._codec.decode_trajectory(msg.data, msg.subject)
        except SchemaError as exc:  # the shard writer dead-letters it; we only skip it
            self.undecodable += 1
            log.warning("skipping an undecodable message on %s: %s", msg.subject, exc)
            return
        self.router.deliver(trajectory)
