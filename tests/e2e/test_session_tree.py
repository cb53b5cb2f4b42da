"""Sessions are trees (issue 18), through a real gateway process, the real ``openai`` SDK and a
real nats-server: a main agent and its sub-agents take turns on one session, and each turn
continues, token for token, its own conversation's previous turn.

The model is tiny and random, with a byte-level BPE tokenizer trained in the test
(``tests.helpers.bpe_model``): re-tokenizing a reply's text gives other ids than the ones the
model sampled, so a prompt holds a completion's sampled ids only where the gateway continued
that turn's tokens instead of rendering its conversation again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from consumers.fold import fold
from eventlog import connect, read_session
from eventlog.server import NatsServer
from schemas import SessionEvent, TurnCompleted
from schemas.delta import common_prefix_len
from tests.helpers.bpe_model import bpe_model_dir
from tests.helpers.gateway_process import GatewayProcess

pytestmark = pytest.mark.integration

JSON = dict[str, Any]
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
ASK: JSON = {"model": "tiny", "max_tokens": 8, "temperature": 1.0}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return bpe_model_dir(tmp_path_factory.mktemp("bpe-model"))


@pytest.fixture(scope="module")
def gateway(
    nats_server: NatsServer, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    process = GatewayProcess(nats_server.url, model_dir, tmp_path_factory.mktemp("gateway"))
    yield process
    process.stop()


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(model_dir)


def events_of(server: NatsServer, session: str) -> list[SessionEvent]:
    async def read() -> list[SessionEvent]:
        nc = await connect(server.url)
        try:
            return await read_session(nc.jetstream(), "e2e", session)
        finally:
            await nc.close()

    return asyncio.run(read())


def turns_of(events: Sequence[SessionEvent]) -> list[TurnCompleted]:
    return sorted((e for e in events if isinstance(e, TurnCompleted)), key=lambda e: e.turn)


def contexts_of(turns: Sequence[TurnCompleted]) -> list[list[int]]:
    """Every turn's full context (prompt + completion), rebuilt from the log by its parents."""
    contexts: list[list[int]] = []
    for turn in turns:
        base = contexts[turn.parent][: turn.prefix_len] if turn.parent >= 0 else []
        assert len(base) == turn.prefix_len, f"turn {turn.turn}: prefix beyond its parent"
        contexts.append(base + turn.prompt_ids.tolist() + turn.completion_ids.tolist())
    return contexts


def prompt_of(contexts: list[list[int]], turn: TurnCompleted) -> list[int]:
    context = contexts[turn.turn]
    return context[: len(context) - len(turn.completion_ids)]


def extends(contexts: list[list[int]], turn: TurnCompleted) -> bool:
    parent = contexts[turn.parent] if turn.parent >= 0 else None
    return parent is not None and turn.prefix_len == len(parent)


def best_prefix_parent(contexts: list[list[int]], turn: TurnCompleted) -> tuple[int, int]:
    """(turn, shared tokens) of the earlier turn sharing the longest prefix, the latest on ties."""
    prompt = prompt_of(contexts, turn)
    shared = [(common_prefix_len(contexts[t], prompt), t) for t in range(turn.turn)]
    most, parent = max(shared, default=(0, -1))
    return (parent, most) if most else (-1, 0)


class Agent:
    """One conversation on the session, sent back whole each turn like an agent loop does."""

    def __init__(self, client: openai.OpenAI, task: str) -> None:
        self.client = client
        self.messages: list[JSON] = [SYSTEM, {"role": "user", "content": task}]
        self.ids: list[str] = []

    def step(self, then: str = "Go on.") -> str:
        reply = self.client.chat.completions.create(messages=self.messages, **ASK)
        self.ids.append(reply.id)
        self.messages.append(reply.choices[0].message.model_dump(exclude_none=True))
        self.messages.append({"role": "user", "content": then})
        return reply.id


def session_client(gateway: GatewayProcess) -> tuple[openai.OpenAI, str]:
    session = gateway.session()
    client = openai.OpenAI(base_url=str(session["base_url"]), api_key="x", max_retries=0)
    return client, str(session["session_id"])


def test_interleaved_agents_are_two_trajectories_each_token_for_token(
    gateway: GatewayProcess, nats_server: NatsServer, tokenizer: Any
) -> None:
    client, sid = session_client(gateway)
    main, sub = Agent(client, "Plan a trip to the sea."), Agent(client, "Find a hotel there.")
    for _ in range(3):
        main.step()
        sub.step()
    events = events_of(nats_server, sid)
    turns = turns_of(events)
    contexts = contexts_of(turns)
    # The sub-agent's first turn shares the system prompt's tokens only: delta-encoded
    # against the main agent's turn, not extending it. Then each continues its own.
    assert [t.parent for t in turns] == [-1, 0, 0, 1, 2, 3]
    assert not extends(contexts, turns[1])
    assert all(extends(contexts, t) for t in turns[2:])

    re_tokenized = {}  # agent -> how many of its replies re-tokenize to other ids
    for agent, own in ((main, turns[0::2]), (sub, turns[1::2])):
        last = prompt_of(contexts, own[-1])
        re_tokenized[agent] = 0
        for earlier in own[:-1]:  # every earlier completion, as sampled, inside the last prompt
            sampled = earlier.completion_ids.tolist()
            start = len(prompt_of(contexts, earlier))
            assert last[start : start + len(sampled)] == sampled, f"turn {earlier.turn}"
            re_tokenized[agent] += tokenizer.encode(earlier.text, add_special_tokens=False) != [
                i for i in sampled if i not in tokenizer.all_special_ids
            ]
    # The control: a reply's text re-tokenizes to other ids, so rendering that agent's
    # conversation would not give its recorded prompt. (Which agent's replies do is chance: the
    # replies are sampled.)
    assert sum(re_tokenized.values()) >= 1
    agent, last_turn = (main, turns[4]) if re_tokenized[main] else (sub, turns[5])
    text = tokenizer.apply_chat_template(
        agent.messages[:6], tokenize=False, add_generation_prompt=True
    )
    assert prompt_of(contexts, last_turn) != tokenizer.encode(text, add_special_tokens=False)

    folded = fold(events)
    assert folded.forks == 0 and folded.turn_segments == (0, 1, 0, 1, 0, 1)
    assert [t.num_turns for t in folded.trajectories] == [3, 3]
    for trajectory, own in zip(folded.trajectories, (turns[0::2], turns[1::2]), strict=True):
        assert int(trajectory.loss_mask.sum()) == sum(len(t.completion_ids) for t in own)
        assert trajectory.input_ids.tolist() == contexts[own[-1].turn]


def test_nested_sub_agents_return_to_their_callers(
    gateway: GatewayProcess, nats_server: NatsServer
) -> None:
    client, sid = session_client(gateway)
    a = Agent(client, "Write the report.")
    a.step(then="The researcher says: done.")
    b = Agent(client, "Research the topic.")
    b.step(then="The reader says: done.")
    c = Agent(client, "Read the sources.")
    c.step()
    c.step()
    b.step()
    a.step()
    turns = turns_of(events_of(nats_server, sid))
    contexts = contexts_of(turns)
    assert [t.parent for t in turns[3:]] == [2, 1, 0]  # c, b, a continue their own
    assert all(extends(contexts, t) for t in turns[3:])
    for new in turns[:3]:  # new conversations: delta against the best shared prefix
        assert (new.parent, new.prefix_len) == best_prefix_parent(contexts, new)
        assert new.parent < 0 or not extends(contexts, new)
    folded = fold(events_of(nats_server, sid))
    assert folded.forks == 0 and folded.turn_segments == (0, 1, 2, 2, 1, 0)


def test_a_resent_tip_a_retry_and_edited_histories(
    gateway: GatewayProcess, nats_server: NatsServer
) -> None:
    client, sid = session_client(gateway)
    a = Agent(client, "Plan a trip to the sea.")
    for _ in range(3):
        a.step()
    Agent(client, "Find a hotel there.").step()  # turn 3: another conversation's turn
    # A's client lost turn 2's reply and sends its request again: the recorded turn.
    again = client.chat.completions.create(messages=a.messages[:-2], **ASK)
    assert again.id == a.ids[2]
    # Turn 1's request again: turn 1 was continued, so this is a retry: a sibling of turn 1.
    client.chat.completions.create(messages=a.messages[:4], **ASK)
    # An edited history: turn 1's reply rewritten; token for token from turn 0 still.
    edited_late = [*a.messages[:4], {"role": "assistant", "content": "Sure."}, a.messages[5]]
    client.chat.completions.create(messages=edited_late, **ASK)
    # Turn 0's reply rewritten: no kept conversation is a prefix; rendered again.
    edited_early = [*a.messages[:2], {"role": "assistant", "content": "Sure."}, a.messages[3]]
    client.chat.completions.create(messages=edited_early, **ASK)

    events = events_of(nats_server, sid)
    turns = turns_of(events)
    contexts = contexts_of(turns)
    assert len(turns) == 7, "the resent request added no turn"
    retry, late, early = turns[4:]
    assert [retry.parent, late.parent] == [0, 0] == [turns[1].parent] * 2
    assert extends(contexts, retry) and extends(contexts, late)
    assert (early.parent, early.prefix_len) == best_prefix_parent(contexts, early)
    assert not extends(contexts, early)
    # The retry and the late edit extend turn 0, whose segment turn 1 carries on: branches, new
    # segments but no forks. The early edit diverges: a fork when its shared prefix reaches into
    # turn 0's reply (generated history), else a new conversation.
    folded = fold(events)
    segments = folded.turn_segments
    assert len({segments[0], segments[4], segments[5]}) == 3 and segments[1] == segments[0]
    reaches = early.prefix_len > len(prompt_of(contexts, turns[0]))
    assert folded.fork_turns == ((6,) if reaches else ())
    metrics = httpx.get(f"{gateway.url}/metrics").text
    assert 'turnstream_gateway_turn_attachments_total{how="branched"}' in metrics


@pytest.fixture(scope="module")
def small_gateway(
    nats_server: NatsServer, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    """A gateway that keeps 3 turns of a session continuable: conversations get forgotten."""
    data = tmp_path_factory.mktemp("small-gateway")
    process = GatewayProcess(nats_server.url, model_dir, data, "--session-turns-kept", "3")
    yield process
    process.stop()


def test_more_conversations_than_kept_turns_concurrent_and_hostile(
    small_gateway: GatewayProcess, nats_server: NatsServer
) -> None:
    """Six conversations sent concurrently on one session whose gateway keeps 3 turns, unicode
    in every message, retries of a continued turn, and previous_response_id naming a forgotten
    turn and one that never was: every answer a 200 or a 4xx naming the problem, every turn in
    the log, and the session still folds (forgotten conversations are rendered again)."""
    client, sid = session_client(small_gateway)
    agents = [Agent(client, f"Sub-agent {i}: 🦜 «résumé» \u202e {i}") for i in range(6)]

    def run(agent: Agent) -> None:
        for _ in range(3):
            agent.step("Weiter, bitte 🙂")

    with ThreadPoolExecutor(6) as pool:
        list(pool.map(run, agents))
    asked = agents[0].messages[:4]  # turn 1 of agent 0, continued since: each ask a branch
    for temperature in (0.5, 0.7, 0.9):
        client.chat.completions.create(messages=asked, **{**ASK, "temperature": temperature})
    responses = openai.OpenAI(base_url=f"{small_gateway.url}/v1", api_key="x", max_retries=0)
    headers = {"X-Session-Id": sid}
    forgotten = turns_of(events_of(nats_server, sid))[0].reply_id  # no longer kept
    for reply, why in ((forgotten, "resend the full conversation"), ("0123456789ab", "no such")):
        with pytest.raises(openai.BadRequestError) as refused:
            responses.responses.create(
                model="tiny",
                input="and then?",
                previous_response_id=f"resp_{sid}_{reply}",
                max_output_tokens=8,
                extra_headers=headers,
            )
        assert why in str(refused.value) and refused.value.status_code == 400

    turns = turns_of(events_of(nats_server, sid))
    assert [t.turn for t in turns] == list(range(6 * 3 + 3))
    contexts_of(turns)  # every delta fits its parent
    folded = fold(events_of(nats_server, sid))
    generated = sum(int(t.loss_mask.sum()) for t in folded.trajectories)
    assert generated == sum(len(t.completion_ids) for t in turns)  # each sampled token once
