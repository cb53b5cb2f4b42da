"""The fleet benchmark's load (``benchmarks/harness/routed_sessions.py``): affinity sends a
session's every request to the gateway its id hashes to, round robin to the fleet's next one
whatever the session; every 4th session opened runs a sub-agent whose turns are sent together
with its main agent's; the moves and first landings counted from where requests went."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from harness.routed_sessions import (
    SUB_EVERY,
    SUB_TURNS,
    TURNS,
    AgentSessions,
    RoutedLoad,
)

from schemas.ids import session_owner

URLS = ["http://gw-0", "http://gw-1", "http://gw-2"]


def load(routing: str) -> RoutedLoad:
    return RoutedLoad("test", None, URLS, routing, AgentSessions("tiny"))  # type: ignore[arg-type]


def test_affinity_keeps_a_session_on_its_gateway_and_round_robin_does_not() -> None:
    sticky = load("affinity")
    for sid in (f"s-{i}" for i in range(12)):
        assert {sticky.url(sid) for _ in range(5)} == {URLS[session_owner(sid, len(URLS))]}
    spread = load("round_robin")
    assert [spread.url("one-session") for _ in range(6)] == [*URLS[1:], URLS[0]] * 2


def test_every_fourth_session_runs_a_sub_agent_alongside_its_main_agent() -> None:
    sessions = AgentSessions("tiny")
    opened = [sessions.open(f"s-{n}", n) for n in range(2 * SUB_EVERY)]
    with_sub = [n for n, s in enumerate(opened) if "sub-1" in s.messages]
    assert with_sub == [SUB_EVERY - 1, 2 * SUB_EVERY - 1]
    for n, session in enumerate(opened):
        agents = [agent for step in session.steps for agent in step]
        assert agents.count("main") == TURNS
        assert agents.count("sub-1") == (SUB_TURNS if n in with_sub else 0)
        # The sub-agent's turns are each in flight with one of main's: two appends at once.
        assert all(step == ("main", "sub-1") for step in session.steps if "sub-1" in step)
        body = sessions.body(session, "main")
        assert body["messages"][0]["role"] == "system" and len(body["tools"]) == 4


def test_moves_and_first_landings_are_counted_from_where_requests_went() -> None:
    path = load("round_robin")
    first, second = (path.load.open(f"s-{n}", n) for n in range(2))
    first.sent_to = [URLS[0], URLS[0], URLS[1], URLS[0], URLS[2]]  # 3 moves, 2 new gateways
    second.sent_to = [URLS[1]] * 4
    path.sessions = [first, second]
    assert path.landings() == (3, 2)
