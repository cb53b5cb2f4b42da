"""Many gateways, one log (issue 36): two real gateway processes on one real nats-server, the real
openai SDK and the tiny tool-calling model, requests routed between them with no affinity.

The log decides, not a gateway's memory: every append states the session's last sequence as
the gateway knows it, and a gateway whose copy is stale catches up on the log first. So a
conversation whose requests alternate between the gateways is one chain of turns, each extending
its parent token for token (the issue's reproduction: turn 2 recorded against turn 0, turn 1's
reply re-tokenized, two trajectories); a session closed on one gateway is closed on the other; and
sub-agents served by different gateways at the same moment keep their identity and their chains.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from consumers.fold import fold
from eventlog.server import NatsServer
from schemas import SessionClosed, TurnCompleted
from tests.e2e.test_gateway import (
    FAST_PUBLISH,
    TOOLS,
    WEATHER_QUESTION,
    answered,
    events_of,
    turns_of,
)
from tests.helpers.gateway_process import GatewayProcess

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def fleet(
    nats_server: NatsServer, tool_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[GatewayProcess, GatewayProcess]]:
    a = GatewayProcess(nats_server.url, tool_model_dir, tmp_path_factory.mktemp("a"), *FAST_PUBLISH)
    try:
        b = GatewayProcess(
            nats_server.url, tool_model_dir, tmp_path_factory.mktemp("b"), *FAST_PUBLISH
        )
    except BaseException:
        a.stop()
        raise
    yield a, b
    a.stop()
    b.stop()


def client(gateway: GatewayProcess, session: str, agent: dict[str, str] | None = None) -> Any:
    return openai.OpenAI(
        base_url=f"{gateway.url}/v1",
        api_key="unused",
        max_retries=0,
        default_headers={"X-Session-Id": session, **(agent or {})},
    )


def ask(
    gateway: GatewayProcess, session: str, messages: list[Any], tokens: int = 48, **agent: str
) -> Any:
    headers = {f"X-Turnstream-{k.replace('_', '-').title()}": v for k, v in agent.items()}
    reply = client(gateway, session, headers).chat.completions.create(
        model="tiny", messages=messages, tools=TOOLS, temperature=1.0, max_tokens=tokens
    )
    answered(messages, reply.choices[0].message, "And tomorrow?")
    return reply


def contexts(turns: list[TurnCompleted]) -> dict[int, list[int]]:
    """Each turn's whole context (prompt + completion), rebuilt from the deltas."""
    by_turn: dict[int, list[int]] = {}
    for turn in turns:
        parent = by_turn.get(turn.parent_turn, [])
        prompt = parent[: turn.prefix_len] + turn.prompt_ids.tolist()
        by_turn[turn.turn] = prompt + turn.completion_ids.tolist()
    return by_turn


def exact(turns: list[TurnCompleted]) -> None:
    """Every turn that continues another (its messages extend that turn's whole conversation,
    reply included) holds that turn's whole context: none re-tokenized. A sub-agent's fresh first
    turn is delta-encoded against the turn it shares most with, which it does not continue."""
    whole = contexts(turns)
    said: dict[int, int] = {}  # each turn's conversation length: its messages + its reply
    for turn in turns:
        said[turn.turn] = turn.message_prefix_len + len(turn.new_messages) + 1
        if turn.parent_turn >= 0 and turn.message_prefix_len == said[turn.parent_turn]:
            assert turn.prefix_len == len(whole[turn.parent_turn]), (
                f"turn {turn.turn} re-tokenized its parent {turn.parent_turn}"
            )


def metric(gateway: GatewayProcess, name: str) -> float:
    text = httpx.get(f"{gateway.url}/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def test_a_conversation_alternating_between_gateways_is_one_exact_chain(
    fleet: tuple[GatewayProcess, GatewayProcess], nats_server: NatsServer
) -> None:
    a, b = fleet
    reads_before = metric(a, "turnstream_gateway_catch_up_reads_total") + metric(
        b, "turnstream_gateway_catch_up_reads_total"
    )
    messages: list[Any] = [*WEATHER_QUESTION]
    for t in range(4):  # round robin, what a load balancer without affinity does
        ask((a, b)[t % 2], "alternating", messages)
    turns = turns_of(events_of(nats_server, "alternating"))
    assert [(t.turn, t.parent_turn) for t in turns] == [(0, -1), (1, 0), (2, 1), (3, 2)]
    exact(turns)
    assert len(fold(events_of(nats_server, "alternating")).trajectories) == 1
    reads = metric(a, "turnstream_gateway_catch_up_reads_total") + metric(
        b, "turnstream_gateway_catch_up_reads_total"
    )
    assert reads > reads_before, "the stale gateway caught up on the log"
    assert metric(a, "turnstream_gateway_stale_prompts_total") == 0
    assert metric(b, "turnstream_gateway_stale_prompts_total") == 0


def test_a_session_closed_on_one_gateway_is_closed_on_the_other(
    fleet: tuple[GatewayProcess, GatewayProcess], nats_server: NatsServer
) -> None:
    a, b = fleet
    messages: list[Any] = [*WEATHER_QUESTION]
    ask(a, "closed-elsewhere", messages)
    ask(b, "closed-elsewhere", messages)  # b holds the session too
    closed = httpx.post(f"{a.url}/v1/sessions/closed-elsewhere/close", json={"reward": 1.0})
    assert closed.status_code == 200
    with pytest.raises(openai.ConflictError, match="closed-elsewhere"):
        ask(b, "closed-elsewhere", messages)
    reward = httpx.post(f"{b.url}/v1/sessions/closed-elsewhere/reward", json={"value": 0.5})
    assert reward.status_code == 409 and "closed-elsewhere" in reward.json()["error"]["message"]
    events = events_of(nats_server, "closed-elsewhere")
    assert isinstance(events[-1], SessionClosed), "nothing appended after the close"
    assert len(turns_of(events)) == 2


def test_sub_agents_on_different_gateways_at_once_keep_identity_and_chains(
    fleet: tuple[GatewayProcess, GatewayProcess], nats_server: NatsServer
) -> None:
    a, b = fleet
    sid = "fleet-agents"
    main: list[Any] = [*WEATHER_QUESTION]
    ask(a, sid, main)
    subs: dict[str, list[Any]] = {
        name: [{"role": "user", "content": f"Sub-task {name}: the weather in Oslo?"}]
        for name in ("scout", "critic")
    }
    with ThreadPoolExecutor(2) as pool:
        for first, second in ((a, b), (b, a)):  # each agent's turns on both gateways at once
            list(
                pool.map(
                    lambda item: ask(
                        item[0], sid, subs[item[1]], agent=item[1], parent_agent="main"
                    ),
                    [(first, "scout"), (second, "critic")],
                )
            )
    ask(b, sid, main)
    turns = turns_of(events_of(nats_server, sid))
    assert [t.turn for t in turns] == list(range(6)), "every answered turn once"
    exact(turns)
    by_agent: dict[str, list[TurnCompleted]] = {}
    for turn in turns:
        by_agent.setdefault(str(turn.agent.get("id", "main")), []).append(turn)
    assert sorted(by_agent) == ["critic", "main", "scout"]
    for name in ("scout", "critic"):
        spawned, went_on = by_agent[name]
        assert spawned.agent["parent"] == "main"
        assert went_on.parent_turn == spawned.turn, f"{name} continues its own turn"
    assert by_agent["main"][1].parent_turn == by_agent["main"][0].turn
    seeds = [t.sampling["seed"] for t in turns]
    assert len(set(seeds)) == len(seeds), "no two requests share a derived seed"
    assert len(fold(events_of(nats_server, sid)).trajectories) == 3


def test_a_burst_of_one_sessions_agents_over_both_gateways_lands_every_turn_once(
    fleet: tuple[GatewayProcess, GatewayProcess], nats_server: NatsServer
) -> None:
    """Twelve agents of one session at once, alternating gateways: the appends contend for the
    session's sequence (whether they collide is the machine's timing: not asserted), each
    refused one catches up and lands under the next index."""
    a, b = fleet
    sid = "fleet-burst"
    ask(a, sid, [*WEATHER_QUESTION])  # the main agent's turn: the sub-agents' parent

    def one(i: int) -> str:
        gateway = (a, b)[i % 2]
        messages = [{"role": "user", "content": f"part {i} of the task, in 文字 too"}]
        reply = ask(gateway, sid, messages, 8, agent=f"worker-{i}", parent_agent="main")
        return str(reply.id)

    with ThreadPoolExecutor(12) as pool:
        ids = list(pool.map(one, range(12)))
    turns = turns_of(events_of(nats_server, sid))
    assert [t.turn for t in turns] == list(range(13)), "every answered turn once, no gap"
    assert {f"chatcmpl-{sid}-{t.reply_id}" for t in turns[1:]} == set(ids)
