"""The fold of a session that is a tree (issue 18, DESIGN §5): each turn's delta is taken
against its parent turn, each conversation folds into its own trajectory, and only a chain that
diverges inside generated history (an edit) is a fork; a retry is a branch. Sessions recorded
before turns had parents fold as fold v3 folded them."""

from __future__ import annotations

import base64
import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from consumers import FOLD_VERSION, FoldError, FoldOptions, FoldResult, FoldWorkerSettings, fold
from eventlog.dispositions import DeadLetterIt, disposition
from eventlog.pull import ConsumerSpec
from schemas.codec import Codec
from schemas.delta import encode_delta, replay_context
from schemas.events import JSON, SessionEvent, TrajectoryReady, TurnCompleted
from tests.helpers.sessions import RUN, SESSION, closed, opened

CODEC = Codec()
FIXTURE = Path(__file__).parents[1] / "fixtures" / "fold_v3" / "sessions.json"
TREE_KEYS = ("branch_of", "turns")  # metadata fold v3 did not write
# What fold v7 adds for the fixture's turns (each recorded temperature 1 and no top_p): one
# entry per turn, the defaults filled in.
PLAIN_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}
SYS = [1, 2, 3]  # a system prompt every agent of the session shares


@dataclasses.dataclass(frozen=True)
class Node:
    """One turn as the model lived it, and the turn the gateway chose as its parent."""

    parent: int
    prompt: Sequence[int]
    completion: Sequence[int]
    messages: Sequence[JSON] = ()
    tools: list[JSON] | None = None
    extra: JSON = dataclasses.field(default_factory=dict)

    @property
    def context(self) -> list[int]:
        return [*self.prompt, *self.completion]

    def reply(self, turn: int) -> JSON:
        return {"role": "assistant", "content": f"reply {turn}"}


def tree_events(nodes: Sequence[Node]) -> list[TurnCompleted]:
    """Delta-encode each turn against its parent's full context, as the gateway does."""
    events: list[TurnCompleted] = []
    for turn, node in enumerate(nodes):
        parent = nodes[node.parent] if node.parent >= 0 else None
        context = parent.context if parent else []
        history = [*parent.messages, parent.reply(node.parent)] if parent else []
        delta = encode_delta(context, history, node.prompt, node.messages)
        events.append(
            TurnCompleted(
                run=RUN,
                session=SESSION,
                turn=turn,
                parent_turn=node.parent,
                prefix_len=delta.prefix_len,
                prompt_ids=delta.prompt_ids,
                completion_ids=np.asarray(node.completion, dtype=np.int32),
                logprobs=np.full(len(node.completion), -0.5, dtype=np.float32),
                message_prefix_len=delta.message_prefix_len,
                new_messages=delta.new_messages,
                tools=node.tools,
                text=f"reply {turn}",
                weight_version=turn,
                **node.extra,
            )
        )
    return events


def session(nodes: Sequence[Node]) -> list[SessionEvent]:
    return [opened(), *tree_events(nodes), closed(num_turns=len(nodes), reward=1.0)]


def user(text: str) -> JSON:
    return {"role": "user", "content": text}


def after(nodes: Sequence[Node], parent: int, new: Sequence[int], message: str) -> Node:
    """A turn that continues ``parent``: its whole context, then ``new`` (a tool result)."""
    before = nodes[parent]
    return Node(
        parent,
        [*before.context, *new],
        [],
        [*before.messages, before.reply(parent), user(message)],
    )


def completed(node: Node, completion: Sequence[int]) -> Node:
    return dataclasses.replace(node, completion=completion)


def plain(trajectory: TrajectoryReady) -> dict[str, Any]:
    fields = msgspec.structs.asdict(trajectory)
    return {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in fields.items()}


# -- sessions recorded before turns had parents ----------------------------------------------


def recorded(name: str, mode: str) -> tuple[list[SessionEvent], list[TrajectoryReady], int]:
    """A fixture session's events, and the trajectories and forks fold v3 made of them."""
    stored = json.loads(FIXTURE.read_text())[name]
    decoded = [CODEC.decode(base64.b64decode(e)) for e in stored["events"]]
    events = [e for e in decoded if not isinstance(e, TrajectoryReady)]
    v3 = [CODEC.decode(base64.b64decode(t)) for t in stored[mode]["trajectories"]]
    trajectories = [t for t in v3 if isinstance(t, TrajectoryReady)]
    assert (len(events), len(trajectories)) == (len(decoded), len(v3))
    return events, trajectories, int(stored[mode]["forks"])


MODES = [("segments", FoldOptions()), ("per_turn", FoldOptions(per_turn=True))]


@pytest.mark.parametrize("name", ["linear", "forked"])
@pytest.mark.parametrize(("mode", "options"), MODES)
def test_a_session_recorded_before_parents_folds_as_fold_v3_folded_it(
    name: str, mode: str, options: FoldOptions
) -> None:
    events, v3, v3_forks = recorded(name, mode)

    result = fold(events, options)

    assert result.forks == v3_forks
    assert len(result.trajectories) == len(v3)
    for now, then in zip(result.trajectories, v3, strict=True):
        got, want = plain(now), plain(then)
        assert (got.pop("fold_version"), want.pop("fold_version")) == (FOLD_VERSION, 3)
        added = {k: got["metadata"].pop(k) for k in TREE_KEYS if k in got["metadata"]}
        assert got["metadata"].pop("sampling") == [PLAIN_SAMPLING] * now.num_turns
        assert got == want
        # What fold v4 adds: the chain that starts off turn 1 (the rewrite) says where it
        # branched; in per-turn mode turn 1 is sample 1.
        branch = {"turn": 1, "segment": 0 if mode == "segments" else 1, "shared_tokens": 14}
        starts_a_branch = name == "forked" and now.metadata["first_turn"] == 2
        assert added == ({"branch_of": branch} if starts_a_branch else {})


@pytest.mark.parametrize(("mode", "options"), MODES)
def test_a_recorded_linear_session_gives_the_same_bytes_but_for_the_version(
    mode: str, options: FoldOptions
) -> None:
    events, v3, _ = recorded("linear", mode)

    refolded = fold(events, options).trajectories

    for t in refolded:  # fold v7's per-turn sampling is all the metadata adds
        assert t.metadata.pop("sampling") == [PLAIN_SAMPLING] * t.num_turns
    assert [CODEC.encode(msgspec.structs.replace(t, fold_version=3)) for t in refolded] == [
        CODEC.encode(t) for t in v3
    ]


# -- interleaved sub-agents ------------------------------------------------------------------


def interleaved() -> list[Node]:
    """Agents A and B take turns A, B, A, B, A, B; B's prompt shares A's system prompt."""
    a0 = Node(-1, [*SYS, 10], [11, 12], [user("task A")])
    b0 = Node(0, [*SYS, 20, 21], [22], [user("task B")])
    nodes = [a0, b0]
    for turn in range(2, 6):
        parent = turn - 2  # each agent continues its own last turn
        step = after(nodes, parent, [30 + turn], f"obs {turn}")
        nodes.append(completed(step, [40 + turn, 50 + turn]))
    return nodes


def test_interleaved_sub_agents_give_one_trajectory_per_conversation() -> None:
    nodes = interleaved()

    result = fold(session(nodes))

    a, b = result.trajectories
    assert (a.num_turns, b.num_turns) == (3, 3)
    assert result.forks == 0 and result.fork_turns == ()
    assert result.turn_segments == (0, 1, 0, 1, 0, 1)
    assert a.input_ids.tolist() == nodes[4].context and b.input_ids.tolist() == nodes[5].context
    for trajectory, turns in ((a, [0, 2, 4]), (b, [1, 3, 5])):
        assert int(trajectory.loss_mask.sum()) == sum(len(nodes[t].completion) for t in turns)
        assert trajectory.versions[trajectory.loss_mask == 1].tolist() == [
            t for t in turns for _ in nodes[t].completion
        ]
        assert trajectory.metadata["turns"] == turns
        assert trajectory.messages == [
            *nodes[turns[-1]].messages,
            nodes[turns[-1]].reply(turns[-1]),
        ]
    assert "branch_of" not in a.metadata
    assert b.metadata["branch_of"] == {"turn": 0, "segment": 0, "shared_tokens": len(SYS)}
    assert b.prompt_len == len(nodes[1].prompt)  # the shared system prompt is B's prompt too


def test_a_turn_without_tools_is_given_its_parents_tools() -> None:
    search = {"type": "function", "function": {"name": "search", "parameters": {}}}
    calc = {"type": "function", "function": {"name": "calc", "parameters": {}}}
    nodes = interleaved()
    nodes[0] = Node(-1, nodes[0].prompt, nodes[0].completion, nodes[0].messages, tools=[search])
    nodes[1] = Node(0, nodes[1].prompt, nodes[1].completion, nodes[1].messages, tools=[calc])

    a, b = fold(session(nodes)).trajectories
    per_turn = fold(session(nodes), FoldOptions(per_turn=True)).trajectories

    assert (a.tools, b.tools) == ([search], [calc])  # not "as the turn before"
    assert [t.tools for t in per_turn] == [[search], [calc]] * 3


# -- nested sub-agents, an edit, a retry, a new conversation ----------------------------------


def nested() -> list[Node]:
    """A calls B, B calls C, each returns to its caller; then a client edits A's history (a
    fork), C's second turn is retried (a branch, not a fork), a new task shares only the system
    prompt, and another shares nothing."""
    nodes = [
        Node(-1, [*SYS, 10], [11, 12], [user("A")]),  # 0 A: calls B
        Node(0, [*SYS, 20], [21, 22], [user("B")]),  # 1 B: calls C
        Node(1, [*SYS, 30], [31], [user("C")]),  # 2 C
    ]
    nodes.append(completed(after(nodes, 2, [32], "C obs"), [33, 34]))  # 3 C: answers
    nodes.append(completed(after(nodes, 1, [35], "C said"), [23]))  # 4 B: answers
    nodes.append(completed(after(nodes, 0, [24], "B said"), [13, 14]))  # 5 A: done
    edited = [*nodes[0].prompt, 11, 99]  # A's first reply edited after its first token
    nodes.append(Node(5, edited, [15], [user("A"), {"role": "assistant", "content": "edit"}]))
    nodes.append(completed(after(nodes, 2, [32], "C obs"), [36]))  # 7: turn 3 retried
    nodes.append(Node(0, [*SYS, 60], [61], [user("D")]))  # 8: new task, system prompt only
    nodes.append(Node(-1, [70], [71], [user("E")]))  # 9: shares nothing
    return nodes


NESTED_SEGMENTS = (0, 1, 2, 2, 1, 0, 3, 4, 5, 6)
NESTED_BRANCHES = {  # segment -> branch_of
    1: {"turn": 0, "segment": 0, "shared_tokens": 3},
    2: {"turn": 1, "segment": 1, "shared_tokens": 3},
    3: {"turn": 5, "segment": 0, "shared_tokens": 5},
    4: {"turn": 2, "segment": 2, "shared_tokens": 5},
    5: {"turn": 0, "segment": 0, "shared_tokens": 3},
}


def test_nested_sub_agents_an_edit_a_retry_and_new_conversations() -> None:
    nodes = nested()

    result = fold(session(nodes))

    assert result.turn_segments == NESTED_SEGMENTS
    assert result.fork_turns == (6,) and result.forks == 1
    assert [t.metadata.get("branch_of") for t in result.trajectories] == [
        NESTED_BRANCHES.get(s) for s in range(7)
    ]
    turns = [[t for t, s in enumerate(NESTED_SEGMENTS) if s == segment] for segment in range(7)]
    for trajectory, its_turns in zip(result.trajectories, turns, strict=True):
        last = its_turns[-1]
        assert trajectory.input_ids.tolist() == nodes[last].context
        assert int(trajectory.loss_mask.sum()) == sum(len(nodes[t].completion) for t in its_turns)
        assert trajectory.num_turns == len(its_turns)
        assert trajectory.metadata["first_turn"] == its_turns[0]
        contiguous = its_turns == list(range(its_turns[0], last + 1))
        assert trajectory.metadata.get("turns") == (None if contiguous else its_turns)
        assert trajectory.metadata["forks"] == 1 and trajectory.metadata["segments"] == 7
        assert trajectory.messages == [*nodes[last].messages, nodes[last].reply(last)]


def test_per_turn_samples_of_a_tree_count_the_same_forks() -> None:
    result = fold(session(nested()), FoldOptions(per_turn=True))

    assert result.turn_segments == tuple(range(10))
    assert result.fork_turns == (6,) and result.forks == 1
    branches = {
        t.segment: t.metadata["branch_of"] for t in result.trajectories if "branch_of" in t.metadata
    }
    # Only the turns that start a chain say where they branched; in this mode a turn's
    # sample index is its turn index.
    assert branches == {
        1: {"turn": 0, "segment": 0, "shared_tokens": 3},
        2: {"turn": 1, "segment": 1, "shared_tokens": 3},
        6: {"turn": 5, "segment": 5, "shared_tokens": 5},
        7: {"turn": 2, "segment": 2, "shared_tokens": 5},
        8: {"turn": 0, "segment": 0, "shared_tokens": 3},
    }
    assert all("turns" not in t.metadata for t in result.trajectories)


def test_replaying_a_turns_context_follows_its_parents() -> None:
    nodes = nested()
    events = tree_events(nodes)

    for turn, node in enumerate(nodes):
        context, conversation = replay_context(events[: turn + 1])
        assert context.tolist() == node.context
        assert conversation == [*node.messages, {"role": "assistant", "content": f"reply {turn}"}]
    assert replay_context([])[0].tolist() == []


# -- bad parents -----------------------------------------------------------------------------


def lying(turn: int, **change: Any) -> list[SessionEvent]:
    events = tree_events(nested())
    events[turn] = msgspec.structs.replace(events[turn], **change)
    return [opened(), *events, closed(num_turns=len(events))]


@pytest.mark.parametrize(
    ("events", "fragments"),
    [
        (  # 8 tokens fit turn 3's context (the turn before), not turn 1's (the parent)
            lying(4, prefix_len=8),
            ["turn 4: prefix_len=8", "parent turn 1's full context has only 6 tokens"],
        ),
        (lying(9, prefix_len=1), ["turn 9: prefix_len=1", "no parent turn (parent -1)"]),
        (
            lying(2, message_prefix_len=3),
            ["turn 2: message_prefix_len=3", "its parent turn 1", "only 2 messages"],
        ),
    ],
    ids=["prefix past the parent", "prefix without a parent", "messages past the parent"],
)
def test_a_delta_that_does_not_fit_its_parent_is_dead_lettered(
    events: list[SessionEvent], fragments: list[str]
) -> None:
    with pytest.raises(FoldError) as raised:
        fold(events)

    message = str(raised.value)
    assert f"run={RUN} session={SESSION}" in message and "dead-letter the session" in message
    for fragment in fragments:
        assert fragment in message
    fold_worker = ConsumerSpec.of(FoldWorkerSettings(), stream="EVENTS", filter_subjects=["c"])
    assert disposition(raised.value, delivery=1, spec=fold_worker) == DeadLetterIt("fold_error")


# -- properties ------------------------------------------------------------------------------

_TOKENS = st.lists(st.integers(0, 3), max_size=3)  # a tiny vocabulary: accidental prefixes


_AGENTS = st.one_of(
    st.just({}),  # a client that names no agents
    st.fixed_dictionaries(
        {"id": st.sampled_from(["main", "a1", "a2"])},
        optional={"request_class": st.sampled_from(["main", "subagent", "compaction"])},
    ),
)


def turn_agent(node: Node) -> tuple[str | None, bool, bool]:
    """(agent id, side request, client gone) of a node, as the fold reads its event."""
    named = node.extra.get("agent", {})
    side = named.get("request_class") == "compaction"
    return named.get("id"), side, bool(node.extra.get("client_gone"))


@st.composite
def trees(draw: st.DrawFn) -> list[Node]:
    """Random trees: each turn continues an earlier turn, keeps part of one, or starts anew;
    asked for by one of a few agents (or none named), some side requests, some turns whose
    client went away."""
    nodes: list[Node] = []
    for turn in range(draw(st.integers(1, 7))):
        parent = draw(st.integers(-1, turn - 1))
        context = nodes[parent].context if parent >= 0 else []
        kept = len(context) if draw(st.booleans()) else draw(st.integers(0, len(context)))
        messages = [*nodes[parent].messages, nodes[parent].reply(parent)] if parent >= 0 else []
        nodes.append(
            Node(
                parent,
                [*context[:kept], *draw(_TOKENS)],
                draw(_TOKENS),
                [*messages[: draw(st.integers(0, len(messages)))], user(f"m{turn}")],
                extra={"agent": draw(_AGENTS), "client_gone": draw(st.booleans())},
            )
        )
    return nodes


def encoded(result: FoldResult) -> tuple[object, ...]:
    return (
        [CODEC.encode(t) for t in result.trajectories],
        result.forks,
        result.turn_segments,
        result.fork_turns,
    )


PROPERTY = settings(max_examples=150, deadline=None)


@PROPERTY
@given(st.data())
def test_any_order_and_duplication_of_a_trees_events_fold_the_same(data: st.DataObject) -> None:
    events = session(data.draw(trees()))
    options = FoldOptions(per_turn=data.draw(st.booleans()))
    repeats = data.draw(st.lists(st.sampled_from(events), max_size=6))
    delivered = data.draw(st.permutations([*events, *repeats]))

    assert encoded(fold(delivered, options)) == encoded(fold(events, options))


def reference(nodes: Sequence[Node]) -> tuple[list[int], list[int]]:
    """Chains and forks read literally from the design: marks of generated positions follow
    each context, a turn joins its parent's chain when it extends the parent, the parent
    is that chain's last turn, both name one agent (or none) and neither the parent's chain
    was ended (by a side request or a client gone) nor the turn is a side request, and a new
    chain that does not extend its parent but keeps a generated mark is a fork."""
    marks: list[list[bool]] = []
    chain_of: list[int] = []
    last: list[int] = []
    ended: list[bool] = []
    forks: list[int] = []

    def extends_parent(node: Node) -> bool:
        context = nodes[node.parent].context if node.parent >= 0 else []
        return node.parent >= 0 and node.prompt[: len(context)] == context

    # A cut turn gives way to a sibling of its agent whose client stayed (a retry).
    stayed = {
        (node.parent, turn_agent(node)[0])
        for node in nodes
        if extends_parent(node) and not turn_agent(node)[1] and not turn_agent(node)[2]
    }
    for turn, node in enumerate(nodes):
        context = nodes[node.parent].context if node.parent >= 0 else []
        parent_marks = marks[node.parent] if node.parent >= 0 else []
        prompt = list(node.prompt)
        shared = 0
        while shared < min(len(prompt), len(context)) and prompt[shared] == context[shared]:
            shared += 1
        extends = node.parent >= 0 and prompt[: len(context)] == context
        who, side, gone = turn_agent(node)
        if (
            extends
            and not side
            and last[chain_of[node.parent]] == node.parent
            and not ended[chain_of[node.parent]]
            and turn_agent(nodes[node.parent])[0] == who
            and not (gone and (node.parent, who) in stayed)
        ):
            chain_of.append(chain_of[node.parent])
            last[chain_of[-1]] = turn
        else:
            chain_of.append(len(last))
            last.append(turn)
            ended.append(False)
            if node.parent >= 0 and not extends and any(parent_marks[:shared]):
                forks.append(turn)
        ended[chain_of[-1]] = side or gone
        marks.append(
            [*parent_marks[:shared], *[False] * (len(prompt) - shared)]
            + [True] * len(node.completion)
        )
    return chain_of, forks


@PROPERTY
@given(trees(), st.booleans())
def test_a_trees_chains_and_forks_are_the_design_read_literally(
    nodes: list[Node], per_turn: bool
) -> None:
    chain_of, forks = reference(nodes)

    result = fold(session(nodes), FoldOptions(per_turn=per_turn))

    assert result.fork_turns == tuple(forks) and result.forks == len(forks)
    assert result.turn_segments == (tuple(range(len(nodes))) if per_turn else tuple(chain_of))
    assert sum(t.num_turns for t in result.trajectories) == len(nodes)
    for trajectory in result.trajectories:
        its_turns = [t for t, s in enumerate(result.turn_segments) if s == trajectory.segment]
        assert trajectory.input_ids.tolist() == nodes[its_turns[-1]].context
        assert int(trajectory.loss_mask.sum()) == sum(len(nodes[t].completion) for t in its_turns)
        # One agent's turns (or turns of none), named in the metadata with the flags.
        [who] = {turn_agent(nodes[t])[0] for t in its_turns}
        assert trajectory.metadata.get("agent_id") == who
        assert trajectory.metadata.get("side", False) == any(
            turn_agent(nodes[t])[1] for t in its_turns
        )
        assert trajectory.metadata.get("client_gone", False) == turn_agent(nodes[its_turns[-1]])[2]
