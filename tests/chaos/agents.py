"""Agents for the chaos soak: the real ``openai`` SDK, sessions of 1-4 turns, retries on faults.

Each agent runs sessions one after another: open it (``POST /v1/sessions`` with its own id, so a
retried open is the same session), take its turns with ``logprobs=True`` so it sees the tokens
it was given (4-24 tokens; one turn in ten asks for 64-192, long enough that a weight update
lands in it), then close it, or, about one session in ten, walk away and leave it to the
reaper.
A request that meets a fault (connection refused or cut, a timeout, a 5xx such as the 503 of a
log that is down) is retried with a short backoff; every 200 answer is recorded as the client
saw it, for the auditor.

Behind the soak's round-robin proxy (two gateways) every request goes on a fresh connection
(``FRESH_CONNECTIONS``): the proxy balances connections, so this makes it balance requests, and
a session's turns land on either gateway as the proxy's turn falls.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx
import httpx2
import openai

log = logging.getLogger("soak.agents")

T = TypeVar("T")

LEAVE_OPEN = 0.1  # share of sessions the agent abandons: the reaper must close them
# Share of turns that ask for a long completion: long enough to be running when the soak's
# trainer aborts the generations for a weight update (issue 37), so that turns are continued.
LONG_TURNS = 0.1
SHORT_TOKENS, LONG_TOKENS = (4, 24), (64, 192)
GIVE_UP_S = 120.0  # one request retried this long: the agent abandons its session
REQUEST_TIMEOUT_S = 30.0
# No connection kept alive: each request is a new connection, so a per-connection balancer
# spreads requests, not clients. The session API's client is httpx's; the openai SDK's, httpx2's.
FRESH_CONNECTIONS = httpx.Limits(max_keepalive_connections=0)
SDK_FRESH_CONNECTIONS = httpx2.Limits(max_keepalive_connections=0)


@dataclass
class Completion:
    """One 200 answer as the client received it."""

    reply: str  # from the completion id, chatcmpl-<session>-<reply> (TurnCompleted.reply)
    text: str
    tokens: list[str]
    logprobs: list[float]


@dataclass
class AgentSession:
    session: str
    agent: int
    planned_turns: int
    created: bool = False
    completions: list[Completion] = field(default_factory=list)
    # closed (200), closed_elsewhere (409: the reaper was first), close_unknown (409 after a
    # try whose answer was lost), left_open, gave_up, cancelled, refused (an unexpected 4xx)
    outcome: str = "in_progress"
    retries: int = 0
    errors: list[str] = field(default_factory=list)


class GaveUp(Exception):
    """A request kept failing for GIVE_UP_S."""


class Refused(Exception):
    """The gateway answered a 4xx that is not part of the soak's story."""


async def retrying(record: AgentSession, what: str, call: Callable[[], Awaitable[T]]) -> T:
    """``call()`` until it gets an answer that is not a fault (transport error, timeout, 5xx)."""
    started = time.monotonic()
    delay = 0.2
    while True:
        try:
            return await call()
        except (
            openai.APIConnectionError,  # refused, reset, timeout
            openai.InternalServerError,  # 5xx, the log's 503 included
            httpx.TransportError,
            _ServerError,
        ) as exc:
            record.retries += 1
            if time.monotonic() - started > GIVE_UP_S:
                raise GaveUp(f"{what}: {type(exc).__name__}: {exc}") from exc
        await asyncio.sleep(delay * random.uniform(0.5, 1.5))
        delay = min(delay * 2, 2.0)


class _ServerError(Exception):
    """A 5xx from the session API (httpx does not raise on a status)."""


async def _post(http: httpx.AsyncClient, url: str, body: dict[str, Any]) -> httpx.Response:
    response = await http.post(url, json=body, timeout=REQUEST_TIMEOUT_S)
    if response.status_code >= 500:
        raise _ServerError(f"{response.status_code} {response.text[:200]}")
    return response


class Agent:
    def __init__(
        self,
        index: int,
        gateway_url: str,
        seed: int,
        http: httpx.AsyncClient,
        fresh_connections: bool = False,
    ) -> None:
        """``http``: for the session API; ``fresh_connections``: the SDK's requests too go on a
        new connection each (``http`` must then be made with ``FRESH_CONNECTIONS``)."""
        self.index = index
        self.gateway_url = gateway_url
        self.rng = random.Random(f"{seed}-agent-{index}")
        self.http = http
        self.openai = openai.AsyncOpenAI(
            base_url=f"{gateway_url}/v1",
            api_key="unused",
            max_retries=0,  # ours, so every fault and every answer is seen here
            timeout=REQUEST_TIMEOUT_S,
            http_client=(
                openai.DefaultAsyncHttpxClient(limits=SDK_FRESH_CONNECTIONS)
                if fresh_connections
                else None
            ),
        )
        self.sessions: list[AgentSession] = []

    async def run(self, stopping: asyncio.Event) -> None:
        """Sessions one after another until ``stopping``; the one under way is finished."""
        async with self.openai:
            await self._sessions(stopping)

    async def _sessions(self, stopping: asyncio.Event) -> None:
        number = 0
        while not stopping.is_set():
            record = AgentSession(
                f"a{self.index:02d}s{number:05d}", self.index, self.rng.randint(1, 4)
            )
            number += 1
            self.sessions.append(record)
            try:
                await self.session(record)
            except GaveUp as exc:
                record.outcome = "gave_up"
                record.errors.append(str(exc))
            except Refused as exc:
                record.outcome = "refused"
                record.errors.append(str(exc))
            except asyncio.CancelledError:
                record.outcome = "cancelled"
                raise
            await asyncio.sleep(self.rng.uniform(0.1, 0.5))

    async def session(self, record: AgentSession) -> None:
        sid = record.session
        opened = await retrying(
            record,
            f"open {sid}",
            lambda: _post(
                self.http,
                f"{self.gateway_url}/v1/sessions",
                {"session_id": sid, "group": f"agent-{self.index}"},
            ),
        )
        if opened.status_code != 200:
            raise Refused(f"open {sid}: {opened.status_code} {opened.text[:300]}")
        record.created = True
        # The agent's connection pool, the session's base URL (README: /sessions/{sid}/v1).
        client = self.openai.with_options(base_url=f"{self.gateway_url}/sessions/{sid}/v1")
        messages: list[dict[str, Any]] = [
            {"role": "user", "content": f"Task {sid}: plan step 0 of {record.planned_turns}."}
        ]
        for step in range(record.planned_turns):
            ask = functools.partial(
                client.chat.completions.create,
                model="tiny",
                messages=list(messages),
                max_tokens=self.rng.randint(
                    *(LONG_TOKENS if self.rng.random() < LONG_TURNS else SHORT_TOKENS)
                ),
                logprobs=True,
                temperature=1.0,
            )
            try:
                reply = await retrying(record, f"turn {step} of {sid}", ask)
            except openai.ConflictError:
                record.outcome = "closed_elsewhere"  # the reaper closed it while we waited
                return
            except openai.APIStatusError as exc:
                raise Refused(f"turn {step} of {sid}: {exc.status_code} {exc.message}") from exc
            record.completions.append(_completion(reply, len(record.completions)))
            text = reply.choices[0].message.content or ""
            messages += [
                {"role": "assistant", "content": text},
                {"role": "user", "content": f"Go on with step {step + 1}."},
            ]
            # The agent's tool runs. Long enough that 32 agents leave the 2-core machine some
            # room: the gateway's tiny model would otherwise take a whole core.
            await asyncio.sleep(self.rng.uniform(0.2, 1.0))
        if self.rng.random() < LEAVE_OPEN:
            record.outcome = "left_open"
            return
        await self.close(record)

    async def close(self, record: AgentSession) -> None:
        sid = record.session
        retries_before = record.retries
        body = {"status": "completed", "reward": round(self.rng.random(), 3)}
        closed = await retrying(
            record,
            f"close {sid}",
            lambda: _post(self.http, f"{self.gateway_url}/v1/sessions/{sid}/close", body),
        )
        if closed.status_code == 200:
            record.outcome = "closed"
        elif closed.status_code == 409:
            record.outcome = (
                "close_unknown" if record.retries > retries_before else "closed_elsewhere"
            )
        else:
            raise Refused(f"close {sid}: {closed.status_code} {closed.text[:300]}")


def _completion(reply: Any, fallback_turn: int) -> Completion:
    choice = reply.choices[0]
    entries = choice.logprobs.content if choice.logprobs is not None else []
    _, dash, named = str(reply.id).rpartition("-")
    return Completion(
        reply=named if dash else str(fallback_turn),
        text=choice.message.content or "",
        tokens=[e.token for e in entries or []],
        logprobs=[float(e.logprob) for e in entries or []],
    )
