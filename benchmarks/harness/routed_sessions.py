"""Agent-shaped sessions whose every request the client sends to the gateway a routing picks
(``benchmarks/fleet.py``: round robin over several gateways, or by the session's hash), and the
check that every conversation's turns continued one another token for token in EVENTS.

A session: Chat Completions, 4,000 characters of Claude Code's system text and four of its
tools, each request the whole history; every answer is a tool call (the fixed-latency backend's
one answer), answered by a tool result; 6 turns; every 4th session also runs a sub-agent (its
own task, ``X-Turnstream-Agent: sub-1``) whose 3 turns are each in flight together with one of
its main agent's (a background agent: two appends to one session at once).
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from typing import Any

import httpx

from harness.continuation import session_turns, turn_of, whole_context
from harness.load import LoadPath, PhaseCounts
from harness.reporting import say
from harness.surfaces import CALL_NAME, claude_code_shape, function, tool_output
from schemas.ids import session_owner

JSON = dict[str, Any]
SYSTEM_CHARS = 4_000
TOOLS = ("Bash", "Edit", "Read", "Write")
TURNS, SUB_TURNS, SUB_EVERY = 6, 3, 4
BY_SESSION = ("affinity", "owner", "any")
"""Routings that send a session's every request to one URL (``owner`` and ``any``: the one
port of a ``--workers`` gateway, which routes inside)."""


@dataclass
class AgentSession:
    """One session's conversations (``main``, and ``sub-1`` for a session with a sub-agent):
    their messages, their answers' ids, and the order its requests are sent in."""

    sid: str
    steps: list[tuple[str, ...]]  # the agents whose next requests are sent together
    messages: dict[str, list[JSON]]
    answers: dict[str, list[str]] = field(default_factory=dict)
    sent_to: list[str] = field(default_factory=list)  # the URL of each request, in order

    @property
    def done(self) -> bool:
        return not self.steps


class AgentSessions:
    """What every request carries (system text, tools) and each session's opening."""

    def __init__(self, model: str) -> None:
        shape = claude_code_shape()
        self.model = model
        self.system = {"role": "system", "content": "\n".join(shape.system)[:SYSTEM_CHARS]}
        self.tools = [
            {"type": "function", "function": function(t)} for t in shape.tools if t["name"] in TOOLS
        ]
        self.task = "\n".join(shape.user)

    def open(self, sid: str, number: int) -> AgentSession:
        """Session ``sid``, the ``number``-th its load opens (every SUB_EVERY-th with a
        sub-agent)."""
        steps: list[tuple[str, ...]] = [("main",)] * TURNS
        messages = {"main": [self.system, {"role": "user", "content": f"[{sid}] {self.task}"}]}
        if number % SUB_EVERY == SUB_EVERY - 1:
            # After main's second turn the sub-agent runs in the background: its turns and
            # main's in flight together (Claude Code's background agents), then main's rest.
            steps = [("main",)] * 2 + [("main", "sub-1")] * SUB_TURNS
            steps += [("main",)] * (TURNS - 2 - SUB_TURNS)
            task = f"[{sid} sub-agent] Explore the sources and report what the tests cover."
            messages["sub-1"] = [self.system, {"role": "user", "content": task}]
        return AgentSession(sid, steps, messages)

    def body(self, session: AgentSession, agent: str) -> JSON:
        return {
            "model": self.model,
            "messages": session.messages[agent],
            "tools": self.tools,
            "max_tokens": 64,
        }


class RoutedLoad(LoadPath):
    """Closed-loop workers, each running sessions one after the other, every request sent to
    the gateway the routing picks."""

    def __init__(
        self,
        name: str,
        client: httpx.AsyncClient,
        urls: list[str],
        routing: str,
        load: AgentSessions,
    ) -> None:
        self.name, self.client, self.urls, self.routing, self.load = (
            name,
            client,
            urls,
            routing,
            load,
        )
        self.sent = 0
        self.retried = 0  # requests sent again after their connection closed under them
        self.sessions: list[AgentSession] = []
        self.counts = PhaseCounts()

    def url(self, sid: str) -> str:
        if self.routing in BY_SESSION:
            return self.urls[session_owner(sid, len(self.urls))]
        self.sent += 1
        return self.urls[self.sent % len(self.urls)]

    def landings(self) -> tuple[int, int]:
        """(requests sent to another gateway than their session's previous one, gateways that
        got a session's request for the first time after its first): what the routing made
        the fleet read from the log, as the client sees it."""
        moved = sum(sum(a != b for a, b in itertools.pairwise(s.sent_to)) for s in self.sessions)
        new = sum(len(set(s.sent_to)) - 1 for s in self.sessions if s.sent_to)
        return moved, new

    def worker(self, wid: int, tag: str) -> Any:
        session: AgentSession | None = None
        number = 0

        async def step() -> None:
            nonlocal session, number
            if session is None or session.done:
                # Every SUB_EVERY-th session the path opens has a sub-agent (counted over the
                # path, not the worker: a short phase runs only one or two sessions a worker).
                sid = f"{tag}-w{wid}-s{number}"
                session = self.load.open(sid, len(self.sessions))
                self.sessions.append(session)
                self.counts.sessions += 1
                number += 1
            agents = session.steps.pop(0)
            await asyncio.gather(*(self.turn(session, agent) for agent in agents))
            self.counts.requests += len(agents)

        return step

    async def turn(self, session: AgentSession, agent: str) -> None:
        headers = {"X-Session-Id": session.sid}
        if agent != "main":
            headers["X-Turnstream-Agent"] = agent
        gateway = self.url(session.sid)
        session.sent_to.append(gateway)
        url = f"{gateway}/v1/chat/completions"
        body = self.load.body(session, agent)
        for attempt in (1, 2):
            try:
                response = await self.client.post(url, json=body, headers=headers)
                break
            except (httpx.ReadError, httpx.RemoteProtocolError) as exc:
                # A connection closed under a request: sent again once, as an SDK would (a
                # gateway answers a request it has recorded with the recorded turn); counted.
                if attempt == 2:
                    raise RuntimeError(f"{url}: {exc!r} twice for {session.sid} {agent}") from exc
                self.retried += 1
        if response.status_code != 200:
            raise RuntimeError(
                f"{url}: HTTP {response.status_code} for {session.sid} {agent}: "
                f"{response.text[:300]}"
            )
        answer = response.json()
        message = answer["choices"][0]["message"]
        calls = message.get("tool_calls") or []
        if len(calls) != 1 or calls[0]["function"]["name"] != CALL_NAME:
            raise RuntimeError(f"{session.sid}: expected the {CALL_NAME} call, got {answer}")
        history = session.messages[agent]
        turn = len(session.answers.get(agent, ()))
        session.messages[agent] = [
            *history,
            {"role": "assistant", "content": message.get("content"), "tool_calls": calls},
            {"role": "tool", "tool_call_id": calls[0]["id"], "content": tool_output(turn)},
        ]
        session.answers.setdefault(agent, []).append(answer["id"])
        self.counts.tokens += int(answer["usage"]["completion_tokens"])


async def check_continued(js: Any, paths: list[RoutedLoad]) -> tuple[int, list[JSON]]:
    """Over every conversation's answered turns after its first, each of which must continue
    the conversation's previous turn (its ``parent_turn``, its whole context as
    ``prefix_len``): how many do, and what each that does not was recorded as (with where its
    session's requests went). An answer without a turn in EVENTS raises."""
    limit = asyncio.Semaphore(8)

    async def one(session: AgentSession) -> tuple[int, list[JSON]]:
        async with limit:
            turns = await session_turns(js, session.sid)
        exact, forked = 0, []
        for agent, answers in session.answers.items():
            events = [turn_of(turns, answer) for answer in answers]
            for previous, event in itertools.pairwise(events):
                whole = whole_context(previous)
                if event.parent_turn == previous.turn and event.prefix_len == whole:
                    exact += 1
                    continue
                forked.append(
                    {
                        "session": session.sid,
                        "agent": agent,
                        "turn": event.turn,
                        "parent_turn": event.parent_turn,
                        "prefix_len": event.prefix_len,
                        "expected_parent": previous.turn,
                        "expected_prefix_len": whole,
                        "sent_to": session.sent_to,
                        # (turn, parent, agent, prefix_len, whole context) as recorded
                        "recorded": [
                            (
                                t.turn,
                                t.parent_turn,
                                t.agent.get("id"),
                                t.prefix_len,
                                whole_context(t),
                            )
                            for t in sorted(turns.values(), key=lambda t: t.turn)
                        ],
                    }
                )
        return exact, forked

    found = await asyncio.gather(*(one(s) for path in paths for s in path.sessions))
    exact, forked = sum(e for e, _ in found), [f for _, fs in found for f in fs]
    say(
        f"checked: {exact:,} later turns continue their conversation token for token, "
        f"{len(forked):,} do not (re-tokenized or forked)"
    )
    for turn in forked[:5]:
        say(f"  not continued: {turn}")
    return exact, forked
