"""Where a turn joins its session's tree when its client names the agent (issue 35, DESIGN §4
"Identity comes from the client"): ``gateway.core.branches.placement`` read as a table, then
the aggregate's rules for side requests and turns whose client went away, live and in recovery,
and a fork through the fold (its prompt, the rewritten spawning message included, never
trained).

``AgentToy`` takes turns the way ``gateway.serving.engine`` does (continue the placed turn,
else render and delta-encode against the placement's base, else the longest shared prefix),
with test_session_tree's toy template (a rendered reply's ids differ from the sampled ones)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from consumers import fold
from gateway.core.agents import MAIN_AGENT, AgentIdentity
from gateway.core.aggregate import SessionState, TurnDraft, apply, prefix_parent, turn_event
from gateway.core.aggregate import fold as recover
from gateway.core.branches import Placement, continued_turn, placement, resent_turn
from gateway.core.conversation import message_keys
from schemas.codec import Codec
from schemas.events import SessionEvent, SessionOpened, TurnCompleted
from tests.helpers.sessions import RUN, SESSION, closed
from tests.unit.test_session_tree import END, ROLES, rendered, sampled

JSON = dict[str, Any]
SYSTEM = {"role": "system", "content": "main system"}
HELPER = {"role": "system", "content": "helper system"}


def user(text: str) -> JSON:
    return {"role": "user", "content": text}


def tool(text: str) -> JSON:
    return {"role": "tool", "content": text, "tool_call_id": "t1"}


def assistant(text: str) -> JSON:
    return {"role": "assistant", "content": text}


MAIN = AgentIdentity(MAIN_AGENT, source="claude_code")


def sub(agent: str, kind: str = "", request_class: str = "") -> AgentIdentity:
    return AgentIdentity(agent, parent=MAIN_AGENT, kind=kind, request_class=request_class)


@dataclass
class AgentToy:
    state: SessionState = field(init=False)
    events: list[SessionEvent] = field(default_factory=list)

    def __post_init__(self) -> None:
        opened = SessionOpened(run=RUN, session=SESSION)
        self.state = apply(None, opened)  # type: ignore[assignment]
        self.events.append(opened)

    def place(self, messages: Sequence[JSON], agent: AgentIdentity | None) -> Placement:
        return placement(self.state, messages, None, message_keys(messages), agent)

    def turn(
        self,
        messages: Sequence[JSON],
        reply: str,
        agent: AgentIdentity | None = None,
        client_gone: bool = False,
    ) -> TurnCompleted:
        record = {"api": "chat.completions"}
        keys = message_keys(messages)
        resent = resent_turn(
            self.state, messages, None, record, keys, None if agent is None else agent.id
        )
        if resent is not None:
            return resent
        place = placement(self.state, messages, None, keys, agent)
        node = place.continued
        if node is not None:
            new = messages[len(node.conversation) :]
            suffix = [END, *(i for m in new for i in rendered(m)), ROLES["assistant"]]
            prompt, parent = [*node.context_ids.tolist(), *suffix], node.turn
        else:
            prompt = [*(i for m in messages for i in rendered(m)), ROLES["assistant"]]
            parent = place.base if place.base is not None else prefix_parent(self.state, prompt)
        draft = TurnDraft(
            prompt_ids=prompt,
            messages=list(messages),
            tools=None,
            completion_ids=sampled(reply),
            logprobs=[-0.25] * len(reply),
            text=reply,
            request=record,
            parent_turn=parent,
            agent=place.record(agent),
            client_gone=client_gone,
        )
        event = Codec().decode(Codec().encode(turn_event(self.state, draft)))
        assert isinstance(event, TurnCompleted)
        self.state = apply(self.state, event)  # type: ignore[assignment]
        self.events.append(event)
        return event


def spawned() -> AgentToy:
    """The main agent's two turns: a task, then (after a tool result) the spawning turn."""
    toy = AgentToy()
    toy.turn([SYSTEM, user("task")], "look", MAIN)  # turn 0
    toy.turn([SYSTEM, user("task"), assistant("look"), tool("seen")], "spawn", MAIN)  # turn 1
    return toy


MAIN_1 = [SYSTEM, user("task"), assistant("look"), tool("seen")]  # turn 1's request
# A Claude Code fork's first request: the spawning request, the spawning assistant message
# rewritten to keep only this fork's own tool_use, a placeholder result, its directive.
FORK = [*MAIN_1, assistant("spawn (only a1's call)"), tool("placeholder"), user("do part 1")]
FRESH = [HELPER, user("explore the repo")]


@pytest.mark.parametrize(
    ("messages", "agent", "continued", "base", "kind", "mismatch"),
    [
        # no identity: the prefix rules (the conversation extended furthest: a fork's is turn
        # 0's, whose reply it holds, not the spawning turn 1's, whose reply it rewrote)
        ([*MAIN_1, assistant("spawn"), tool("r")], None, 1, None, "", ""),
        (FORK, None, 0, None, "", ""),
        # the main agent continues its own turn
        ([*MAIN_1, assistant("spawn"), tool("r")], MAIN, 1, None, "main", ""),
        # a new sub-agent: a fork of the spawning turn (the longest of main's requests it
        # starts with), rendered in full
        (FORK, sub("a1"), None, 1, "fork", ""),
        (FORK, sub("a1", kind="fork"), None, 1, "fork", ""),
        (FORK, sub("a1", kind="fresh"), None, 1, "fork", "claimed fresh"),
        # a new sub-agent with its own system prompt: fresh
        (FRESH, sub("a2"), None, None, "fresh", ""),
        (FRESH, sub("a2", kind="fresh"), None, None, "fresh", ""),
        (FRESH, sub("a2", kind="fork"), None, None, "fresh", "claimed fork"),
        # a sub-agent whose parent has no kept turns: fresh
        (FORK, AgentIdentity("a3", parent="nobody"), None, None, "fresh", ""),
        # a new root agent: main, the prefix rules
        ([*MAIN_1, assistant("spawn"), tool("r")], AgentIdentity("other"), 1, None, "main", ""),
    ],
)
def test_where_a_first_request_joins_the_tree(
    messages: list[JSON],
    agent: AgentIdentity | None,
    continued: int | None,
    base: int | None,
    kind: str,
    mismatch: str,
) -> None:
    place = spawned().place(messages, agent)
    assert (None if place.continued is None else place.continued.turn) == continued
    assert (place.base, place.resolved_kind) == (base, kind)
    assert place.mismatch.startswith(mismatch) and bool(place.mismatch) == bool(mismatch)


def test_a_known_agent_continues_its_own_conversation_before_anyone_elses() -> None:
    toy = spawned()
    first = toy.turn(FORK, "part 1 begun", sub("a1"))
    assert first.agent == {"id": "a1", "parent": "main", "resolved_kind": "fork"}
    assert first.parent == 1 and first.prefix_len < len(toy.state.nodes[1].context_ids)
    mine = [*FORK, assistant("part 1 begun"), tool("out")]
    place = toy.place(mine, sub("a1"))
    assert place.continued is not None and place.continued.turn == first.turn
    assert (place.resolved_kind, place.mismatch) == ("fork", "")
    # extending only the main agent's conversation: the tokens win, the claim is recorded
    theirs = toy.place([*MAIN_1, assistant("spawn"), tool("r")], sub("a1"))
    assert theirs.continued is not None and theirs.continued.turn == 1
    assert theirs.mismatch == "extends turn 1 of agent main, not its own"
    # extending nothing: a rewritten history, rendered (the fold makes it a fork)
    rewritten = toy.place([SYSTEM, user("a summary of it all"), tool("x")], sub("a1"))
    assert (rewritten.continued, rewritten.mismatch) == (None, "")


def test_the_main_agent_and_its_fork_each_continue_their_own_line() -> None:
    """Both extend the spawning request; the identity, not arrival order, says whose is whose."""
    toy = spawned()
    fork = toy.turn(FORK, "part 1", sub("a1"))
    main_next = toy.turn([*MAIN_1, assistant("spawn"), tool("spawned")], "waiting", MAIN)
    assert fork.parent == 1 and main_next.parent == 1
    assert main_next.prefix_len == len(toy.state.nodes[1].context_ids)  # token for token
    assert main_next.agent["resolved_kind"] == "main"


def test_identical_requests_of_two_agents_are_two_turns_and_each_resends_its_own() -> None:
    toy = spawned()
    one = toy.turn(FRESH, "r1", sub("a1"))
    two = toy.turn(FRESH, "r2", sub("a2"))
    assert (one.turn, two.turn) == (2, 3)
    assert toy.turn(FRESH, "never sampled", sub("a1")) is one
    assert toy.turn(FRESH, "never sampled", sub("a2")) is two
    assert toy.turn(FRESH, "r3", None).turn == 4  # no identity: none of theirs


def test_a_side_request_leaves_its_parent_the_tip_live_and_in_recovery() -> None:
    toy = spawned()
    compact = [*MAIN_1, assistant("spawn"), user("summarize the conversation")]
    side = toy.turn(compact, "summary", sub(MAIN_AGENT, request_class="compaction"))
    assert side.parent == 1 and side.agent["request_class"] == "compaction"
    assert not toy.state.nodes[1].continued, "still the main conversation's tip"
    assert toy.turn(MAIN_1, "never sampled", MAIN).turn == 1  # a resend still finds the tip
    again = toy.turn([*MAIN_1, assistant("spawn"), tool("r")], "next", MAIN)
    assert again.parent == 1 and again.prefix_len == len(toy.state.nodes[1].context_ids)
    assert toy.state.nodes[1].continued
    recovered = recover(toy.events)
    assert recovered is not None
    assert {t: n.continued for t, n in recovered.nodes.items()} == {
        t: n.continued for t, n in toy.state.nodes.items()
    }


def test_a_turn_whose_client_went_away_is_never_continued_nor_resent() -> None:
    toy = AgentToy()
    gone = toy.turn([SYSTEM, user("task")], "unseen", client_gone=True)
    assert gone.client_gone
    extending = [SYSTEM, user("task"), assistant("unseen"), user("more")]
    assert continued_turn(toy.state, extending, None) is None
    retry = toy.turn([SYSTEM, user("task")], "sampled anew")
    assert retry.turn == 1 and retry.text == "sampled anew"
    assert 0 in toy.state.nodes  # still kept: recovery holds the same nodes
    assert set(recover(toy.events).nodes) == set(toy.state.nodes)  # type: ignore[union-attr]


def test_a_forks_whole_first_prompt_is_never_trained() -> None:
    """Through the fold: the fork starts its own chain, and its prompt (the spawning request,
    the rewritten assistant message, the placeholder, the directive) is loss-masked 0; what it
    trains is what it sampled."""
    toy = spawned()
    fork = toy.turn(FORK, "part 1", sub("a1"))
    after = toy.turn([*FORK, assistant("part 1"), tool("done")], "finished", sub("a1"))
    toy.turn([*MAIN_1, assistant("spawn"), tool("spawned")], "waiting", MAIN)
    result = fold([*toy.events, closed(num_turns=5, reward=1.0)])
    segment = result.turn_segments[fork.turn]
    assert result.turn_segments[after.turn] == segment != result.turn_segments[1]
    chain = result.trajectories[segment]
    assert chain.metadata["branch_of"]["turn"] == 1  # off the spawning turn
    prompt_len = len(fork.prompt_ids) + fork.prefix_len
    assert chain.input_ids[:prompt_len].tolist() == [
        *(i for m in FORK for i in rendered(m)),
        ROLES["assistant"],
    ]
    assert not chain.loss_mask[:prompt_len].any()
    assert int(chain.loss_mask.sum()) == len(sampled("part 1")) + len(sampled("finished"))


@pytest.mark.parametrize(
    ("messages", "agent", "unsure"),
    [
        # the continued conversation + a tool result: no reply this copy could lack
        ([*MAIN_1, assistant("spawn"), tool("r")], MAIN, False),
        ([*MAIN_1, assistant("spawn"), tool("r")], None, False),
        # a reply after the conversation it continues: another gateway's turn, maybe
        ([*MAIN_1, assistant("spawn"), tool("r"), assistant("elsewhere"), tool("r2")], MAIN, True),
        ([SYSTEM, user("task"), assistant("history the client wrote")], None, True),
        # a sub-agent's first turn here: its spawning turn may be another gateway's
        (FRESH, sub("a2"), True),
        (FORK, sub("a1"), True),
        # a first request with no reply in it, from no sub-agent
        ([SYSTEM, user("another task")], None, False),
    ],
)
def test_a_placement_says_when_a_turn_this_copy_lacks_could_change_it(
    messages: list[JSON], agent: AgentIdentity | None, unsure: bool
) -> None:
    """``Placement.unsure``: the gateway reads the log before it prepares such a turn (issue 36:
    the log decides; affinity only saves the read)."""
    assert spawned().place(messages, agent).unsure is unsure


def test_a_sub_agent_with_turns_of_its_own_here_is_sure() -> None:
    toy = spawned()
    toy.turn(FRESH, "explored", sub("a2"))
    assert not toy.place([*FRESH, assistant("explored"), tool("ok")], sub("a2")).unsure
