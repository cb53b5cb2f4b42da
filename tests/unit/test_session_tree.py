"""A session is a tree (issue 18): the gateway's aggregate continues, token for token, the kept
turn a request's conversation extends furthest, whichever turn of the session that is.

``ToyGateway`` takes turns the way ``gateway.serving.engine`` does (continue the matched turn,
else render, delta-encode against the parent), with a toy template whose rendering of a reply
gives other ids than the ones sampled: a prompt holds a turn's sampled ids only when it
continued that turn.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core.aggregate import (
    Kept,
    SessionState,
    TurnDraft,
    apply,
    fold,
    prefix_parent,
    turn_event,
)
from gateway.core.branches import attachment, continued_turn, resent_turn
from schemas.codec import Codec
from schemas.delta import common_prefix_len
from schemas.events import SessionEvent, SessionOpened, TurnCompleted

JSON = dict[str, Any]
ROLES = {"system": 1, "user": 2, "assistant": 3, "tool": 4}
END = 9


def rendered(message: JSON) -> list[int]:
    """A message as the template renders it: role, characters, end."""
    return [ROLES[message["role"]], *(ord(c) for c in message["content"] or ""), END]


def sampled(text: str) -> list[int]:
    """What the model sampled for ``text``: other ids than its rendering (byte-level BPE vs
    merges), so re-rendering a reply loses the sampled ids."""
    return [1000 + ord(c) for c in text]


def user(text: str) -> JSON:
    return {"role": "user", "content": text}


@dataclass
class ToyGateway:
    kept: Kept = field(default_factory=Kept)
    state: SessionState = field(init=False)
    events: list[SessionEvent] = field(default_factory=list)
    attached: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        opened = SessionOpened(run="r", session="s")
        self.state = apply(None, opened, kept=self.kept)  # type: ignore[assignment]
        self.events.append(opened)

    def prompt(self, messages: Sequence[JSON], tools: list[JSON] | None) -> tuple[list[int], int]:
        node = continued_turn(self.state, messages, tools)
        if node is not None:  # the matched turn's tokens, then only the new messages
            new = messages[len(node.conversation) :]
            suffix = [END, *(i for m in new for i in rendered(m)), ROLES["assistant"]]
            return [*node.context_ids.tolist(), *suffix], node.turn
        prompt = [*(i for m in messages for i in rendered(m)), ROLES["assistant"]]
        parent = prefix_parent(self.state, prompt)
        # what prefix_parent finds, one array comparison per array owner, is the plain answer
        shared = max(
            ((common_prefix_len(n.context_ids, prompt), n.turn) for n in self.state.nodes.values()),
            default=(0, -1),
        )
        assert parent == (shared[1] if shared[0] else -1)
        return prompt, parent

    def turn(
        self, messages: Sequence[JSON], reply: str, tools: list[JSON] | None = None, **asked: Any
    ) -> TurnCompleted:
        record = {"api": "chat.completions", **asked}
        resent = resent_turn(self.state, messages, tools, record)
        if resent is not None:
            return resent
        prompt, parent = self.prompt(messages, tools)
        draft = TurnDraft(
            prompt_ids=prompt,
            messages=list(messages),
            tools=tools,
            completion_ids=sampled(reply),
            logprobs=[-0.25] * len(reply),
            text=reply,
            request=record,
            parent_turn=parent,
        )
        event = Codec().decode(Codec().encode(turn_event(self.state, draft)))
        assert isinstance(event, TurnCompleted)
        self.attached.append(attachment(self.state, event))
        self.state = apply(self.state, event)  # type: ignore[assignment]
        self.events.append(event)
        return event

    def reply_of(self, event: TurnCompleted) -> JSON:
        return event.assistant_message


def full_contexts(events: Sequence[SessionEvent]) -> dict[int, list[int]]:
    """Every turn's full context, rebuilt from the events alone by following the parents."""
    contexts: dict[int, list[int]] = {}
    for event in events:
        if isinstance(event, TurnCompleted):
            base = contexts[event.parent][: event.prefix_len] if event.parent >= 0 else []
            assert len(base) == event.prefix_len
            contexts[event.turn] = base + event.prompt_ids.tolist() + event.completion_ids.tolist()
    return contexts


def full_prompt(contexts: dict[int, list[int]], event: TurnCompleted) -> list[int]:
    return contexts[event.turn][: len(contexts[event.turn]) - len(event.completion_ids)]


def extends(contexts: dict[int, list[int]], event: TurnCompleted) -> bool:
    parent = contexts.get(event.parent, [])
    return event.parent >= 0 and full_prompt(contexts, event)[: len(parent)] == parent


SYSTEM = {"role": "system", "content": "be brief"}


class Agent:
    """One conversation on the session: its messages grow with each reply."""

    def __init__(self, gateway: ToyGateway, task: str) -> None:
        self.gateway = gateway
        self.messages: list[JSON] = [SYSTEM, user(task)]
        self.turns: list[TurnCompleted] = []

    def step(self, reply: str, then: str | None = None) -> TurnCompleted:
        event = self.gateway.turn(self.messages, reply)
        self.turns.append(event)
        self.messages += [event.assistant_message, user(then or f"go on after {reply}")]
        return event


def test_interleaved_conversations_each_continue_their_own_previous_turn() -> None:
    gateway = ToyGateway()
    a, b = Agent(gateway, "main task"), Agent(gateway, "sub task")
    for i in range(3):
        a.step(f"a{i}")
        b.step(f"b{i}")
    contexts = full_contexts(gateway.events)
    for agent in (a, b):
        for previous, turn in zip(agent.turns, agent.turns[1:], strict=False):
            assert turn.parent == previous.turn and extends(contexts, turn)
            assert turn.message_prefix_len == len(previous.new_messages) + 1 + (
                previous.message_prefix_len
            )
        # every earlier completion sits in the latest prompt as the ids sampled
        last = full_prompt(contexts, agent.turns[-1])
        for earlier in agent.turns[:-1]:
            ids = earlier.completion_ids.tolist()
            start = len(full_prompt(contexts, earlier))
            assert last[start : start + len(ids)] == ids
    # the sub-agent's first turn shares only the system prompt: delta against it, not extending
    first_b = b.turns[0]
    assert first_b.parent == a.turns[0].turn and not extends(contexts, first_b)
    assert first_b.prefix_len == len(rendered(SYSTEM)) + 1  # and the user role
    assert gateway.attached == ["new", "branched", *["continued"] * 4]


def test_nested_agents_return_to_their_callers() -> None:
    gateway = ToyGateway()
    a = Agent(gateway, "plan")
    a0 = a.step("call b", then="b says: done")
    b = Agent(gateway, "b's job")
    b0 = b.step("call c", then="c says: done")
    c = Agent(gateway, "c's job")
    c0 = c.step("working")
    c1 = c.step("done")
    b1 = b.step("done")
    a1 = a.step("all done")
    assert [(t.turn, t.parent) for t in (a0, b0, c0, c1, b1, a1)] == [
        (0, -1),
        (1, 0),  # shares the system prompt with a0
        (2, 1),
        (3, 2),
        (4, 1),
        (5, 0),
    ]
    contexts = full_contexts(gateway.events)
    assert all(extends(contexts, t) for t in (c1, b1, a1))
    assert state_tips(gateway.state) == {3, 4, 5}


def state_tips(state: SessionState) -> set[int]:
    return {n.turn for n in state.nodes.values() if not n.continued}


def test_an_edited_history_attaches_where_it_shares_the_most_tokens() -> None:
    gateway = ToyGateway()
    a = Agent(gateway, "task")
    for i in range(3):
        a.step(f"r{i}")
    # The client rewrites its first reply: no kept conversation is a prefix of this one.
    edited = [*a.messages[:2], {"role": "assistant", "content": "r0 edited"}, user("next")]
    assert continued_turn(gateway.state, edited, None) is None
    fork = gateway.turn(edited, "f")
    contexts = full_contexts(gateway.events)
    prompt = full_prompt(contexts, fork)
    shared = {t: common_prefix_len(contexts[t], prompt) for t in range(3)}
    assert shared[fork.parent] == max(shared.values()) == fork.prefix_len
    assert fork.parent == 2  # ties go to the most recent
    assert not extends(contexts, fork)
    assert gateway.attached[-1] == "branched"


def test_an_edited_last_message_continues_the_turn_before_it_as_a_branch() -> None:
    gateway = ToyGateway()
    a = Agent(gateway, "task")
    r0, r1 = a.step("r0"), a.step("r1")
    edited = [*a.messages[:3], user("another question")]  # a.messages[3] was the question
    other = gateway.turn(edited, "x")
    contexts = full_contexts(gateway.events)
    assert other.parent == r0.turn == r1.parent and extends(contexts, other)
    assert gateway.attached[-1] == "branched"  # r0 was continued by r1 already


def test_a_retry_of_an_earlier_turn_is_its_sibling() -> None:
    gateway = ToyGateway()
    a = Agent(gateway, "task")
    turns = [a.step(f"r{i}") for i in range(3)]
    asked = a.messages[: len(a.messages) - 4]  # the request of turn 1
    # The same request again: turn 1 was continued (by turn 2), so it is a retry, a new turn.
    retry = gateway.turn(asked, "r1 again")
    assert retry.turn == 3 and retry.parent == turns[1].parent == turns[0].turn
    hotter = gateway.turn(asked, "r1 hot", temperature=2.0)
    assert hotter.turn == 4 and hotter.parent == turns[0].turn
    contexts = full_contexts(gateway.events)
    assert extends(contexts, retry) and extends(contexts, hotter)


def test_a_conversation_tip_is_resent_even_after_another_conversations_turn() -> None:
    gateway = ToyGateway()
    a, b = Agent(gateway, "main"), Agent(gateway, "sub")
    a0 = gateway.turn(a.messages, "a0")
    b.step("b0")
    again = gateway.turn(a.messages, "something else")  # A's client retries its lost reply
    assert again is a0 and gateway.state.turns == 2
    a.messages += [a0.assistant_message, user("more")]
    gateway.turn(a.messages, "a1")
    assert resent_turn(gateway.state, a.messages[:2], None, a0.request) is None  # continued


def test_a_chain_holds_one_array_and_a_branch_its_own() -> None:
    gateway = ToyGateway()
    a = Agent(gateway, "task")
    turns = [a.step(f"reply {i}") for i in range(6)]
    nodes = gateway.state.nodes
    tip = nodes[turns[-1].turn].context_ids
    assert tip.base is None  # only the tip owns its array
    for t in turns[:-1]:
        ids = nodes[t.turn].context_ids
        assert ids.base is tip and np.shares_memory(ids, tip)
    contexts = full_contexts(gateway.events)
    assert all(nodes[t].context_ids.tolist() == contexts[t] for t in nodes)
    branch = gateway.turn(a.messages[:4], "other")  # continues turn 0 again: a second child
    branch_ids = gateway.state.nodes[branch.turn].context_ids
    assert branch_ids.base is None and not np.shares_memory(branch_ids, tip)
    assert gateway.state.nodes[0].context_ids.base is tip  # still a view into the first chain


def test_the_least_recently_touched_turn_is_forgotten_and_can_no_longer_be_continued() -> None:
    gateway = ToyGateway(kept=Kept(turns=2))
    a, b = Agent(gateway, "main"), Agent(gateway, "sub")
    a.step("a0")  # kept: [a0]
    b.step("b0")  # its parent a0 touched: [a0, b0]
    b.step("b1")  # [a0, b0, b1] -> a0 forgotten: [b0, b1]
    assert sorted(gateway.state.nodes) == [1, 2]
    a1 = a.step("a1")  # a0 is gone: rendered again, delta against the best shared prefix
    assert continued_turn(gateway.state, a.messages, None) is not None
    assert a1.parent == 2 and a1.prefix_len == len(rendered(SYSTEM)) + 1  # and the user role
    assert gateway.state.turns == 4 and gateway.state.describe()["turns"] == 4
    recovered = fold(gateway.events, kept=Kept(turns=2))
    assert recovered is not None and same_nodes(recovered, gateway.state)


def test_branch_tips_beyond_the_token_budget_are_forgotten() -> None:
    """Each retry of turn 0's question is a branch holding an array of its own; the arrays the
    kept turns hold stay within Kept.tokens (the newest turn is always kept)."""
    a = Agent(ToyGateway(), "main")
    a.step("a0")
    a.step("a1")
    size = len(a.gateway.state.nodes[1].context_ids)
    gateway = ToyGateway(kept=Kept(tokens=3 * size))
    a = Agent(gateway, "main")
    a.step("a0")
    asked = list(a.messages)
    a.step("a1")
    for retry in range(6):  # each a new child of turn 0 (another temperature: not a resend),
        gateway.turn(asked, f"retry {retry}", temperature=retry / 10)  # a tip owning ~size tokens
    held = {id(n.context_ids.base if n.context_ids.base is not None else n.context_ids):
            len(n.context_ids.base if n.context_ids.base is not None else n.context_ids)
            for n in gateway.state.nodes.values()}  # fmt: skip
    assert sum(held.values()) <= 3 * size and gateway.state.turns == 8
    assert 7 in gateway.state.nodes and len(gateway.state.nodes) < 8
    recovered = fold(gateway.events, kept=Kept(tokens=3 * size))
    assert recovered is not None and same_nodes(recovered, gateway.state)


def same_nodes(x: SessionState, y: SessionState) -> bool:
    return list(x.nodes) == list(y.nodes) and all(
        x.nodes[t].context_ids.tolist() == y.nodes[t].context_ids.tolist()
        and x.nodes[t].keys == y.nodes[t].keys
        and x.nodes[t].conversation == y.nodes[t].conversation
        and x.nodes[t].tools == y.nodes[t].tools
        and x.nodes[t].continued == y.nodes[t].continued
        for t in x.nodes
    )


@settings(max_examples=60, deadline=None)
@given(
    turns_kept=st.integers(1, 6),
    moves=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 3)), min_size=1, max_size=14),
)
def test_recovery_keeps_the_same_turns_as_the_live_session(
    turns_kept: int, moves: list[tuple[int, int]]
) -> None:
    """Random trees: conversations started, continued, branched off an earlier point."""
    gateway = ToyGateway(kept=Kept(turns=turns_kept))
    agents: list[Agent] = []
    for n, (which, back) in enumerate(moves):
        if which >= len(agents):
            agents.append(Agent(gateway, f"task {len(agents)}"))
            which = len(agents) - 1
        agent = agents[which]
        if back and len(agent.messages) > 2 * back + 2:  # branch: drop the last `back` exchanges
            agent.messages = [*agent.messages[: -2 * back - 1], user(f"edit {n}")]
        agent.step(f"reply {n}")
    live = gateway.state
    assert len(live.nodes) <= turns_kept and live.turns == len(moves)
    recovered = fold(gateway.events, kept=Kept(turns=turns_kept))
    assert recovered is not None and same_nodes(recovered, live)
    contexts = full_contexts(gateway.events)
    for turn, node in live.nodes.items():
        assert node.context_ids.tolist() == contexts[turn]
        owner = node.context_ids if node.context_ids.base is None else node.context_ids.base
        assert owner.base is None and owner.tolist()[: len(contexts[turn])] == contexts[turn]


def test_other_tools_continue_nothing_and_a_tie_goes_to_the_most_recent() -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    gateway = ToyGateway()
    first = gateway.turn([SYSTEM, user("q")], "same", tools)
    twin = gateway.turn([SYSTEM, user("q")], "same", tools, temperature=0.5)  # same reply
    asked = [SYSTEM, user("q"), first.assistant_message, user("next")]
    node = continued_turn(gateway.state, asked, tools)
    assert node is not None and node.turn == twin.turn
    assert continued_turn(gateway.state, asked, None) is None
    assert continued_turn(gateway.state, asked, [*tools, *tools]) is None


def test_a_kept_turn_holds_its_prompt_once_in_its_chains_array() -> None:
    # A first turn's prompt is its whole context (100k tokens: 400 KB); the kept event's
    # prompt_ids view the chain's one array instead of holding a copy beside it (issue 40),
    # and the event stays the one object: the state's, the caller's, a resend's answer.
    gateway = ToyGateway()
    a = Agent(gateway, "task")
    turns = [a.step(f"reply {i}") for i in range(4)]
    prompts = full_contexts(gateway.events)
    nodes = gateway.state.nodes
    tip = nodes[turns[-1].turn].context_ids
    for t in turns:
        assert nodes[t.turn].event is t
        start = t.prefix_len
        assert t.prompt_ids.tolist() == full_prompt(prompts, t)[start:]
        assert t.prompt_ids.base is tip and np.shares_memory(t.prompt_ids, tip)
    assert gateway.state.last_turn is turns[-1]
    assert gateway.turn(a.messages[:-2], "a retry") is turns[-1]  # its client resends it
    recovered = fold(gateway.events)
    assert recovered is not None
    for t in turns:
        assert recovered.nodes[t.turn].event is t
