"""Reading what a stream holds on some subjects after a stream sequence, by batched direct get,
through one inbox subscription held for the connection's life (``DirectReader``).

JetStream's *batched* direct get (nats-server >= 2.11; the stream is provisioned with
allow_direct): one request ``{"seq": s, "next_by_subj": <filter>, "batch": n, "max_bytes": b}``
to ``$JS.API.DIRECT.GET.<stream>`` is answered by up to ``n`` messages and then one status
message: ``204`` ends the batch (``Nats-Num-Pending``: how many more match), ``404`` says
nothing matches from ``s`` on, anything else is an error. Any replica serves it and the server
keeps no consumer state, so a session is usually one round trip. nats-py has no batched direct
get: the request is plain core NATS on the connection.

Why one held subscription: a read used to subscribe a fresh inbox, wait and unsubscribe (a SUB,
an UNSUB and a task for the callback each time): half the CPU of a read that finds nothing
(160-190 -> 87-100 us, benchmarks/catch_up_read.py), the common catch-up of a gateway checking
whether another wrote to a session (issue 36). A ``DirectReader`` subscribes once to
``<inbox>.*`` and gives every request its own token, as nats-py's own ``request`` muxes single
answers (``_resp_map``); a batch has several answers, so its token stays registered until the
closing status, and leaves the map when the read ends however it ends (answered, failed, timed
out, cancelled): a late answer finds no token and is dropped. nats-py re-subscribes the inbox
after a reconnect.

``read_subjects_after``, ``read_session_messages``, ``read_session_after`` and ``read_session``
in ``eventlog.reader`` are these methods on a reader of their own for the one read (the fold
worker, the tools); a process that reads often holds one ``DirectReader``.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from types import TracebackType
from typing import TypedDict, Unpack

import msgspec
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from eventlog.connection import closed_socket_as_reset
from schemas.codec import Codec
from schemas.errors import EventLogUnavailable
from schemas.events import SessionEvent
from schemas.ids import session_subjects
from schemas.trust import StoredMessage, vet_session

__all__ = ["DirectReader", "ReadLimits", "SessionTail"]

_STATUS = "Status"
_END_OF_BATCH = "204"
_NOT_FOUND = "404"
_MSG_ID = "Nats-Msg-Id"
_encode = msgspec.json.Encoder().encode


class ReadLimits(TypedDict, total=False):
    """How a read asks and waits. ``batch``: messages per request (1024); ``max_bytes``: bytes
    per batch (16 MiB: a batch arrives as one burst, and past the server's slow-consumer limit
    it would cut the connection); ``timeout_s``: the longest wait for the next message of a
    batch (5 s)."""

    batch: int
    max_bytes: int
    timeout_s: float


@dataclass(frozen=True)
class SessionTail:
    """A session's trusted events stored after ``after_seq``, each with its stream sequence,
    in stream order; ``last_seq``: the last stream sequence the read saw on the session's
    subjects, trusted or not (``after_seq`` if none). ``last_seq``, not the last event's, is
    what the next append expects: the log counts every message there, untrusted ones too."""

    after_seq: int
    events: list[tuple[int, SessionEvent]]
    last_seq: int


class _Batch:
    """One request's answers as they arrive: the messages, then the closing status (or the
    failure: a malformed answer, no answer for ``timeout_s``)."""

    __slots__ = ("ended", "found", "seen", "timeout_s", "timer", "where")

    def __init__(self, where: str, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        self.where = where
        self.found: list[StoredMessage] = []
        self.ended: asyncio.Future[dict[str, str]] = loop.create_future()
        self.timeout_s = timeout_s
        self.seen = 0
        # One timer, re-armed while messages come, not an asyncio.wait per message (a waiter
        # future, callbacks and a timer each).
        self.timer = loop.call_later(timeout_s, self._expire)

    def take(self, msg: Msg) -> None:
        if self.ended.done():
            return
        headers = msg.headers or {}
        try:
            if _STATUS in headers:
                self.ended.set_result(headers)
            else:
                self.found.append(
                    StoredMessage(
                        int(headers["Nats-Sequence"]),
                        headers["Nats-Subject"],
                        msg.data,
                        headers.get(_MSG_ID),
                    )
                )
        except (KeyError, ValueError) as exc:  # a malformed answer fails the read, named
            self.ended.set_exception(
                EventLogUnavailable(f"reading {self.where}: an answer without its headers: {exc!r}")
            )

    def _expire(self) -> None:
        """``timeout_s`` passed: fail the batch if no message came meanwhile, else wait on."""
        if self.ended.done():
            return
        if len(self.found) == self.seen:
            self.ended.set_exception(TimeoutError(f"no answer within {self.timeout_s} s"))
        else:
            self.seen = len(self.found)
            self.timer = asyncio.get_running_loop().call_later(self.timeout_s, self._expire)


class DirectReader:
    """Batched direct gets over one inbox subscription of ``nc``. ``start()`` before use (or
    ``async with``), ``close()`` after; any number of reads may run at once, each gets only its
    own answers. ``codec`` decodes the sessions' events (made once: a ``Codec`` per read was
    ~9 us of a ~90 us read that finds nothing)."""

    def __init__(self, nc: NATS, codec: Codec | None = None) -> None:
        self._nc = nc
        self.codec = codec or Codec()
        self._inbox = ""
        self._sub: Subscription | None = None
        self._batches: dict[str, _Batch] = {}
        self._next_token = 0

    async def start(self) -> DirectReader:
        inbox = self._nc.new_inbox()
        try:
            self._sub = await self._nc.subscribe(f"{inbox}.*", cb=self._on_answer)
        except (nats.errors.Error, OSError) as exc:
            raise EventLogUnavailable(f"cannot subscribe for direct-get answers: {exc}") from exc
        self._inbox = inbox
        return self

    async def close(self) -> None:
        """Unsubscribes; reads still waiting fail with ``EventLogUnavailable`` at once."""
        sub, self._sub = self._sub, None
        for batch in self._batches.values():
            if not batch.ended.done():
                batch.ended.set_exception(
                    EventLogUnavailable(f"reading {batch.where}: the reader was closed")
                )
        if sub is not None:
            # unsubscribe() flushes, which waits for a reconnect while the server is down; a
            # failed one means the connection is gone, and the subscription with it.
            with contextlib.suppress(nats.errors.Error, OSError, TimeoutError):
                async with asyncio.timeout(1.0):
                    await sub.unsubscribe()

    async def __aenter__(self) -> DirectReader:
        return await self.start()

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        await self.close()

    @property
    def in_flight(self) -> int:
        """Requests waiting for their answers now."""
        return len(self._batches)

    async def _on_answer(self, msg: Msg) -> None:
        batch = self._batches.get(msg.subject[len(self._inbox) + 1 :])
        if batch is not None:  # None: a read that has ended (a late answer)
            batch.take(msg)

    async def read_after(
        self,
        stream: str,
        subjects: str,
        after_seq: int = 0,
        *,
        where: str = "",
        **limits: Unpack[ReadLimits],
    ) -> list[StoredMessage]:
        """Every message on ``subjects`` (a filter) in ``stream`` after stream sequence
        ``after_seq`` (0: all), undecoded, in stream order; ``where`` names the read in errors.
        The log not answering (within ``timeout_s``, or with an error status) raises
        ``EventLogUnavailable``."""
        batch = limits.get("batch", 1024)
        max_bytes = limits.get("max_bytes", 16 * 1024 * 1024)
        timeout_s = limits.get("timeout_s", 5.0)
        where = where or f"{subjects} in {stream}"
        api = f"$JS.API.DIRECT.GET.{stream}"
        found: list[StoredMessage] = []
        seq = after_seq + 1
        try:
            while True:
                request = {
                    "seq": seq,
                    "next_by_subj": subjects,
                    "batch": batch,
                    "max_bytes": max_bytes,
                }
                taken, status = await self._request(api, _encode(request), where, timeout_s)
                found += taken
                code = status[_STATUS]
                if code == _NOT_FOUND:
                    return found
                if code != _END_OF_BATCH:
                    raise EventLogUnavailable(
                        f"reading {where} at seq {seq}: JetStream answered {code} "
                        f"{status.get('Description', '')}"
                    )
                if not taken or status.get("Nats-Num-Pending", "0") == "0":
                    return found
                seq = taken[-1].seq + 1
        except (TimeoutError, nats.errors.Error, OSError) as exc:
            raise EventLogUnavailable(
                f"reading {where} at seq {seq}: {type(exc).__name__}: {exc}"
            ) from exc

    async def _request(
        self, api: str, request: bytes, where: str, timeout_s: float
    ) -> tuple[list[StoredMessage], dict[str, str]]:
        """One batch: its messages and its closing status, under a token of its own."""
        if self._sub is None:
            raise EventLogUnavailable(f"reading {where}: the reader is not started (or closed)")
        self._next_token += 1
        token = str(self._next_token)
        answers = _Batch(where, timeout_s)
        self._batches[token] = answers
        try:
            with closed_socket_as_reset():
                await self._nc.publish(api, request, reply=f"{self._inbox}.{token}")
            return answers.found, await answers.ended
        finally:
            answers.timer.cancel()
            self._batches.pop(token, None)

    async def read_session_messages(
        self,
        run: str | None,
        session: str,
        *,
        stream: str = "EVENTS",
        after_seq: int = 0,
        **limits: Unpack[ReadLimits],
    ) -> list[StoredMessage]:
        """Every message of ``run``/``session`` in ``stream`` stored after stream sequence
        ``after_seq`` (0: all), undecoded, in stream order. ``run`` None matches the session in
        any run (session ids are unique)."""
        return await self.read_after(
            stream,
            session_subjects(run or "*", session),
            after_seq,
            where=f"session {run or '*'}/{session} in {stream}",
            **limits,
        )

    async def read_session(
        self,
        run: str | None,
        session: str,
        *,
        stream: str = "EVENTS",
    ) -> list[SessionEvent]:
        """The trusted events of ``run``/``session`` in ``stream``, decoded, in stream order
        (``schemas.trust``: events stored under another subject, without a Msg-Id, or
        conflicting with an earlier turn are left out; bytes that are no event raise
        ``PoisonEvent``)."""
        stored = await self.read_session_messages(run, session, stream=stream)
        return vet_session(stored, self.codec).events

    async def read_session_after(
        self,
        run: str | None,
        session: str,
        after_seq: int = 0,
        *,
        stream: str = "EVENTS",
    ) -> SessionTail:
        """The trusted events of ``run``/``session`` stored after stream sequence
        ``after_seq`` (0: the whole session), with their sequences; one batched direct get
        from ``after_seq + 1`` on the session's subjects, so a catch-up costs what follows,
        not the session.

        The trust rules are ``read_session``'s over what is read: a message under another
        subject or without a Msg-Id is left out, undecodable bytes raise ``PoisonEvent``; a
        second, different turn is left out only against turns read here: one that conflicts
        with a turn at or before ``after_seq`` is returned, and the caller, which holds those,
        keeps the first."""
        stored = await self.read_session_messages(run, session, stream=stream, after_seq=after_seq)
        vetted = vet_session(stored, self.codec)
        return SessionTail(
            after_seq,
            list(zip(vetted.seqs, vetted.events, strict=True)),
            stored[-1].seq if stored else after_seq,
        )
