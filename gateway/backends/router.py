"""Replicas of one model behind the Backend interface: session-sticky and load-aware.

Each request goes to:

1. the replica that served the session's previous turn: its prefix cache (vLLM's automatic
   prefix caching, SGLang's radix cache) holds the conversation so far, so only the new messages
   are prefilled; unless that replica is down or saturated (``max_inflight_per_replica``
   generations in flight);
2. otherwise the least-loaded replica that is up and has room (ties rotate, so new sessions
   spread out), which becomes the session's replica: it now caches the longest prefix;
3. when every replica that is up is saturated, the request waits for a slot, rather than pile
   onto a server past its limit or fail an agent's turn.

A replica that raises ``BackendUnavailable`` (connection refused, 503) is marked down for
``cooldown_s`` and the request moves on to the next replica, provided nothing was streamed yet;
after the cool-down, live traffic tries it again. With no replica up, ``BackendUnavailable``.
A failure after the first chunk is raised to the caller: those tokens already reached the agent.
Any other error before the first chunk (a ``BackendError``, or the ``InvalidRequest`` of a
replica refusing a sampling it would record wrongly: ``gateway.backends.probe``) is raised as it
is: no other replica is tried and none is marked down.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.backends.interface import (
    Backend,
    GenerationChunk,
    Prompt,
    SamplingParams,
    needs_processed_logprobs,
)
from gateway.errors import BackendError, BackendUnavailable
from gateway.frozen import evolved

__all__ = ["ReplicaRouter", "ReplicaStatus", "RoutedStream"]


@dataclass(frozen=True)
class ReplicaStatus:
    id: str
    inflight: int
    up: bool
    down_for_s: float  # seconds of cool-down left; 0 when up
    last_error: str | None  # the BackendUnavailable that last marked it down


@dataclass
class _Replica:
    backend: Backend
    index: int
    inflight: int = 0
    down_until: float = -math.inf
    last_error: str | None = None


class ReplicaRouter:
    def __init__(
        self,
        replicas: Sequence[Backend],
        *,
        max_inflight_per_replica: int,
        cooldown_s: float = 5.0,
        max_sessions: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        ids = [replica.id for replica in replicas]
        if not ids:
            raise ValueError("ReplicaRouter needs at least one replica")
        if len(set(ids)) != len(ids):
            raise ValueError(f"replica ids must be unique (they are recorded per turn): {ids}")
        if max_inflight_per_replica < 1:
            raise ValueError(f"max_inflight_per_replica must be >= 1: {max_inflight_per_replica}")
        self._replicas = [_Replica(backend, index) for index, backend in enumerate(replicas)]
        self._max_inflight = max_inflight_per_replica
        self._cooldown_s = cooldown_s
        self._max_sessions = max_sessions  # least recently used sessions are forgotten first
        self._clock = clock
        self._sessions: OrderedDict[str, int] = OrderedDict()  # session -> replica index
        self._rotation = 0
        # Replaced on every change; waiters hold the old one, which is set to wake them.
        self._changed = asyncio.Event()

    @property
    def id(self) -> str:
        return "router(" + ",".join(replica.backend.id for replica in self._replicas) + ")"

    @property
    def max_context(self) -> int:
        return min(replica.backend.max_context for replica in self._replicas)

    @property
    def backends(self) -> tuple[Backend, ...]:
        return tuple(replica.backend for replica in self._replicas)

    async def admit(self, params: SamplingParams) -> str | None:
        """Refuse a sampling that a replica up would record wrongly (``InvalidRequest``), before
        a turn starts streaming: the route is chosen later, so every replica up must serve it (a
        fleet mixing log-prob modes is refused, naming a replica to restart). A replica that
        cannot be reached is marked down, as a generation would."""
        if not needs_processed_logprobs(params):
            return None
        now = self._clock()
        for replica in self._replicas:
            backend = replica.backend
            if replica.down_until > now:
                continue
            try:
                await backend.admit(params)
            except BackendUnavailable as exc:
                self._mark_down(replica, exc)
        return None  # each replica marks its own chunks

    def status(self) -> list[ReplicaStatus]:
        now = self._clock()
        return [
            ReplicaStatus(
                id=replica.backend.id,
                inflight=replica.inflight,
                up=replica.down_until <= now,
                down_for_s=max(0.0, replica.down_until - now),
                last_error=replica.last_error,
            )
            for replica in self._replicas
        ]

    def replica_of(self, session_id: str) -> str | None:
        """The replica a session sticks to, if any."""
        index = self._sessions.get(session_id)
        return None if index is None else self._replicas[index].backend.id

    async def generate_for(
        self, session_id: str | None, prompt: Prompt, params: SamplingParams
    ) -> tuple[str, RoutedStream]:
        """Start a generation on a replica and return that replica's id with the chunks.

        Returns once the first chunk has arrived, so that a replica which cannot be reached is
        replaced by another before anything is streamed. Iterate the stream to its end or
        ``aclose`` it: that gives the replica's slot back.
        """
        stream = RoutedStream(self, session_id, prompt, params)
        await stream.begin()
        return stream.replica_id, stream

    def generate(
        self, prompt: Prompt, params: SamplingParams, *, session: str | None = None
    ) -> RoutedStream:
        """The Backend port: ``session`` makes the route sticky; the route is chosen when the
        first chunk is asked for, and that chunk names the replica (``GenerationChunk.replica``)."""
        return RoutedStream(self, session, prompt, params)

    async def _route(
        self, session_id: str | None, prompt: Prompt, params: SamplingParams
    ) -> tuple[_Replica, GenerationChunk, AsyncIterator[GenerationChunk]]:
        tried: set[int] = set()
        last_error: BackendUnavailable | None = None
        while True:
            replica = await self._acquire(session_id, tried, last_error)
            chunks = replica.backend.generate(prompt, params)
            try:
                first = await anext(chunks)
            except BackendUnavailable as exc:
                self._release(replica)
                self._mark_down(replica, exc)
                tried.add(replica.index)
                last_error = exc
                continue
            except StopAsyncIteration:
                self._release(replica)
                raise BackendError(
                    f"replica {replica.backend.id} ended a generation without any chunk"
                ) from None
            except BaseException:
                self._release(replica)
                raise
            if session_id is not None:
                self._stick(session_id, replica)
            return replica, first, chunks

    async def close(self) -> None:
        for replica in self._replicas:
            await replica.backend.close()

    async def _acquire(
        self, session_id: str | None, tried: set[int], last_error: BackendUnavailable | None
    ) -> _Replica:
        while True:
            now = self._clock()
            up = [r for r in self._replicas if r.index not in tried and r.down_until <= now]
            if not up:
                raise BackendUnavailable(self._none_up_message(session_id, now)) from last_error
            replica = self._choose(session_id, up)
            if replica is not None:
                replica.inflight += 1
                return replica
            await self._changed.wait()

    def _choose(self, session_id: str | None, up: list[_Replica]) -> _Replica | None:
        sticky = None if session_id is None else self._sessions.get(session_id)
        for replica in up:
            if replica.index == sticky and replica.inflight < self._max_inflight:
                return replica
        free = [replica for replica in up if replica.inflight < self._max_inflight]
        if not free:
            return None
        count = len(self._replicas)
        rotation = self._rotation
        self._rotation += 1
        return min(free, key=lambda r: (r.inflight, (r.index - rotation) % count))

    def _stick(self, session_id: str, replica: _Replica) -> None:
        self._sessions[session_id] = replica.index
        self._sessions.move_to_end(session_id)
        while len(self._sessions) > self._max_sessions:
            self._sessions.popitem(last=False)

    def _release(self, replica: _Replica) -> None:
        replica.inflight -= 1
        self._notify()

    def _mark_down(self, replica: _Replica, error: BackendUnavailable) -> None:
        replica.down_until = self._clock() + self._cooldown_s
        replica.last_error = str(error)
        self._notify()  # waiters may now have no replica left: let them fail fast

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _none_up_message(self, session_id: str | None, now: float) -> str:
        states = "; ".join(
            f"{r.backend.id}: down for {max(0.0, r.down_until - now):.1f}s more ({r.last_error})"
            for r in self._replicas
        )
        who = f" for session {session_id}" if session_id else ""
        return (
            f"no inference replica can take the request{who}: {states}. "
            "Check that the servers are running; the request can be retried."
        )


class RoutedStream:
    """The chunks of one routed generation, routed when the first chunk is asked for (or on
    ``begin``). Gives the replica's slot back as soon as the last chunk is out, on an error, on
    ``aclose``, or at the latest when garbage-collected."""

    def __init__(
        self,
        router: ReplicaRouter,
        session_id: str | None,
        prompt: Prompt,
        params: SamplingParams,
    ) -> None:
        self._router = router
        self._request: tuple[str | None, Prompt, SamplingParams] | None = (
            session_id,
            prompt,
            params,
        )
        self._replica: _Replica | None = None
        self._pending: GenerationChunk | None = None
        self._rest: AsyncIterator[GenerationChunk] | None = None
        self._released = False
        self.replica_id = ""

    async def begin(self) -> None:
        """Choose the replica and wait for its first chunk (a replica that cannot be reached
        is replaced by another before anything is streamed)."""
        if self._request is None:
            return
        request, self._request = self._request, None
        self._replica, first, self._rest = await self._router._route(*request)
        self.replica_id = self._replica.backend.id
        self._pending = evolved(first, replica=self.replica_id)

    def __aiter__(self) -> RoutedStream:
        return self

    async def __anext__(self) -> GenerationChunk:
        if self._request is not None:
            await self.begin()
        if self._pending is not None:
            chunk, self._pending = self._pending, None
        elif self._released or self._rest is None:
            raise StopAsyncIteration
        else:
            try:
                chunk = await anext(self._rest)
            except BackendUnavailable as exc:
                if self._replica is not None:
                    self._router._mark_down(self._replica, exc)
                self._release()
                raise
            except BaseException:  # StopAsyncIteration included
                self._release()
                raise
        if chunk.finish_reason is not None:
            await self.aclose()
        return chunk

    async def aclose(self) -> None:
        self._request = None  # never started: nothing to route any more
        if self._released:
            return
        self._release()
        aclose: Any = getattr(self._rest, "aclose", None)
        if aclose is not None:
            await aclose()  # closes the HTTP stream, which aborts the request on the server

    def _release(self) -> None:
        if not self._released:
            self._released = True
            if self._replica is not None:
                self._router._release(self._replica)

    def __del__(self) -> None:
        # A stream dropped without being read to the end must not hold its slot forever.
        self._release()
