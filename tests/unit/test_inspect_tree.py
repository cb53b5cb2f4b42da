"""The turn tree ``turnstream inspect`` draws (issue 18, point 4): nodes, compact paths, the
per-segment view of a tree session, and both renderers' structure. Pure: no log."""

from __future__ import annotations

import re
from html.parser import HTMLParser

import pytest
from rich.console import Console

from schemas.events import SessionEvent, TurnCompleted
from schemas.trust import VettedSession
from tests.helpers.agent_sessions import FRESH, claude_code_turns
from tests.helpers.sessions import reward
from tests.helpers.tree_sessions import TreeTurn, tree_events, tree_session
from turnstream.inspect.command import html_tree, render_html, render_terminal, terminal_tree
from turnstream.inspect.text import first_words
from turnstream.inspect.tree import (
    BRANCH,
    CONTINUES,
    FORK,
    NEW_FROM,
    NOT_FOLDED,
    ROOT,
    Relation,
    TreeNode,
    TreePath,
    node_text,
    tree_nodes,
    tree_paths,
)
from turnstream.inspect.view import SessionView, agent_text, session_view, start_text

SYS = [1, 2]  # a system prompt both conversations start with


def interleaved_with_an_edit() -> list[TreeTurn]:
    """A and B take turns (B under A's system prompt: a new conversation from turn 0); turn 5
    edits A's history after turn 2, keeping part of turn 0's reply (a fork)."""
    t0 = TreeTurn(-1, [*SYS, 10], [11, 12], [{"role": "user", "content": "task A please"}])
    t1 = TreeTurn(0, [*SYS, 20], [21], [{"role": "user", "content": "task B"}])
    t2 = TreeTurn(0, [*t0.context, 13], [14], [*t0.messages, t0.assistant_message, _tool("ra")])
    t3 = TreeTurn(1, [*t1.context, 22], [23], [*t1.messages, t1.assistant_message, _tool("rb")])
    t4 = TreeTurn(2, [*t2.context, 15], [16], [*t2.messages, t2.assistant_message, _tool("ra2")])
    t5 = TreeTurn(2, [*t0.context[:4], 30], [31], [{"role": "user", "content": "edited"}])
    return [t0, t1, t2, t3, t4, t5]


def _tool(content: str) -> dict[str, str]:
    return {"role": "tool", "content": content}


def linear(turns: int) -> list[TreeTurn]:
    specs = [TreeTurn(-1, [*SYS, 3], [4])]
    for t in range(1, turns):
        specs.append(TreeTurn(t - 1, [*specs[-1].context, 100 + t], [200 + t]))
    return specs


def node(turn: int, parent: int, relation: Relation = CONTINUES, segment: int = 0) -> TreeNode:
    return TreeNode(turn=turn, parent=parent, segment=segment, relation=relation)


def shape(paths: list[TreePath]) -> list[object]:
    """A path as [turns, [branches...]], comparable in one assert."""
    return [[[n.turn for n in p.nodes], shape(list(p.branches))] for p in paths]


def view_of(events: list[SessionEvent], *, per_turn: bool = False) -> SessionView:
    decode = {i: f"<{i}>" for i in range(300)}
    return session_view("r", "s", VettedSession(events=events), decode, per_turn=per_turn)


# -- tree_paths ------------------------------------------------------------------------------


def test_a_linear_session_is_one_flat_path() -> None:
    nodes = [node(0, -1, ROOT), *(node(t, t - 1) for t in range(1, 200))]

    paths = tree_paths(nodes)

    assert shape(paths) == [[list(range(200)), []]]


@pytest.mark.parametrize(
    ("parents", "expected"),
    [
        # 0 -> {1 -> 3, 2 -> {4, 5}}: a path ends where a turn has several children.
        ([-1, 0, 0, 1, 2, 2], [[[0], [[[1, 3], []], [[2], [[[4], []], [[5], []]]]]]]),
        # Two roots (a conversation with no parent at turn 2) are two top-level paths.
        ([-1, 0, -1, 2, 1], [[[0, 1, 4], []], [[2, 3], []]]),
        # A parent missing from the log: its child heads a path of its own.
        ([-1, 0, 7], [[[0, 1], []], [[2], []]]),
    ],
)
def test_paths_branch_only_where_a_turn_has_several_children(
    parents: list[int], expected: list[object]
) -> None:
    nodes = [node(t, p, ROOT if p < 0 else CONTINUES) for t, p in enumerate(parents)]
    assert shape(tree_paths(nodes)) == expected


def test_a_deep_tree_needs_no_recursion() -> None:
    # A retry of every turn: each turn has two children, so the tree is 3000 branches deep.
    nodes = [node(0, -1, ROOT)]
    for t in range(1, 6001, 2):
        nodes += [node(t, t - 1 if t > 1 else 0), node(t + 1, t - 1 if t > 1 else 0, FORK)]

    [path] = tree_paths(nodes)
    page = "\n".join(html_tree([path]))

    assert page.count("<ul") == page.count("</ul>") == 3001
    assert page.count('class="node') == len(nodes)


# -- tree_nodes ------------------------------------------------------------------------------


def test_nodes_say_what_each_turn_is_to_its_parent() -> None:
    events = tree_events(interleaved_with_an_edit())

    nodes = tree_nodes(
        events,
        chains=(0, 1, 0, 1, 0, 2),
        samples=(0, 1, 0, 1, 0, 2),
        fork_turns=(5,),
        rewards={3: 0.5},
    )

    assert [(n.turn, n.parent, n.segment, n.relation) for n in nodes] == [
        (0, -1, 0, ROOT),
        (1, 0, 1, NEW_FROM),
        (2, 0, 0, CONTINUES),
        (3, 1, 1, CONTINUES),
        (4, 2, 0, CONTINUES),
        (5, 2, 2, FORK),
    ]
    # Shared: the parent's context tokens kept; added: the prompt tokens after them.
    assert [(n.shared, n.added, n.generated) for n in nodes] == [
        (0, 3, 2), (2, 1, 1), (5, 1, 1), (4, 1, 1), (7, 1, 1), (4, 1, 1),
    ]  # fmt: skip
    assert nodes[3].reward == 0.5 and nodes[0].reward is None
    assert nodes[0].preview == "user: task A please" and nodes[4].preview == "tool: ra2"
    assert node_text(nodes[5]) == (
        "turn 5 · segment 2 · ⑂ fork of turn 2 · 4 shared + 1 prompt + 1 generated tokens · "
        "weight_version 0 · finish stop · “user: edited”"
    )
    assert node_text(nodes[1]).startswith(
        "turn 1 · segment 1 · new conversation from turn 0's prompt · 2 shared + 1 prompt"
    )
    assert "reward 0.5 · “tool: rb”" in node_text(nodes[3])


def test_per_turn_samples_keep_the_chains_relations() -> None:
    events = tree_events(interleaved_with_an_edit())

    nodes = tree_nodes(events, chains=(0, 1, 0, 1, 0, 2), samples=range(6), fork_turns=(5,))

    assert [n.segment for n in nodes] == list(range(6))
    assert [n.relation for n in nodes] == [ROOT, NEW_FROM, CONTINUES, CONTINUES, CONTINUES, FORK]


def test_an_unfolded_session_and_a_late_turn_are_marked_not_folded() -> None:
    events = tree_events(linear(3))

    refused = tree_nodes(events, chains=None, samples=None)
    late = tree_nodes(events, chains=(0, 0), samples=(0, 0))

    assert [(n.relation, n.segment) for n in refused] == [
        (ROOT, None), (NOT_FOLDED, None), (NOT_FOLDED, None),
    ]  # fmt: skip
    assert [n.relation for n in late] == [ROOT, CONTINUES, NOT_FOLDED]
    assert "after turn 1, not folded" in node_text(late[2])


def test_first_words_keep_one_short_line() -> None:
    assert first_words("a\nb  c", 8) == "a b c"
    assert first_words("one two three", 2) == "one two …"
    assert first_words("x" * 100, 8, max_chars=10) == "xxxxxxxxx …"


# -- the session view ------------------------------------------------------------------------


def test_segments_of_a_tree_hold_their_own_turns_and_say_how_they_start() -> None:
    view = view_of(tree_session(interleaved_with_an_edit(), extra=[reward(0.5, turn=3)]))

    assert view.result is not None and view.result.forks == 1
    assert [[t.event.turn for t in s.turns] for s in view.segments] == [[0, 2, 4], [1, 3], [5]]
    b, edit = view.segments[1], view.segments[2]
    assert (b.shared, b.parent_segment, b.parent_context, b.fork) == (2, 0, 5, False)
    assert (edit.shared, edit.parent_segment, edit.parent_context, edit.fork) == (4, 0, 7, True)
    assert start_text(view.segments[0]) is None
    assert start_text(b) == (
        "↳ new conversation at turn 1: its prompt shares 2 prompt tokens of turn 0's context, "
        "none it generated: segment 1 starts here"
    )
    assert start_text(edit) == (
        "⑂ fork at turn 5: its prompt keeps 4 of turn 2's 7 context tokens and rewrites the "
        "rest: segment 2 starts here"
    )
    # Each turn's own tokens, after what its segment's first turn shares with its parent.
    assert [[t.id for t in (*v.prompt, *v.completion)] for v in b.turns] == [[20, 21], [22, 23]]
    assert [v.reward for v in b.turns] == [None, 0.5]
    assert [[t.id for t in (*v.prompt, *v.completion)] for v in edit.turns] == [[30, 31]]
    assert shape(view.tree) == [[[0], [[[1, 3], []], [[2], [[[4], []], [[5], []]]]]]]


def test_per_turn_view_relations_come_from_the_chains() -> None:
    view = view_of(tree_session(interleaved_with_an_edit()), per_turn=True)

    assert [s.start.relation if s.start else None for s in view.segments] == [
        ROOT, NEW_FROM, CONTINUES, CONTINUES, CONTINUES, FORK,
    ]  # fmt: skip
    assert start_text(view.segments[2]) is None  # turn 2 continues turn 0: no marker
    assert view.segments[4].shared == 7 and view.segments[4].parent_segment == 2


# -- renderers -------------------------------------------------------------------------------


class _Nodes(HTMLParser):
    """Each li.node's turn and how many ul.branches lists enclose it."""

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0
        self.found: dict[int, int] = {}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "ul" and a.get("class") == "branches":
            self.depth += 1
        if tag == "li" and "node" in (a.get("class") or "").split():
            self.found[int(a["data-turn"] or -1)] = self.depth

    def handle_endtag(self, tag: str) -> None:
        if tag == "ul":
            self.depth -= 1  # the outer ul.tree ends last: balance does not matter then


def test_both_renderers_draw_branches_and_keep_a_path_at_one_level() -> None:
    view = view_of(tree_session(interleaved_with_an_edit()))

    parser = _Nodes()
    parser.feed(render_html(view))
    console = Console(width=200, record=True)
    console.print(terminal_tree(view))
    lines = console.export_text().splitlines()
    column = {
        int(m[1]): line.index(m[0]) for line in lines if (m := re.search(r"turn (\d+) ·", line))
    }

    # 0 | {1, 3} and {2 | {4}, {5}}: a path's turns at one level, a branch one level deeper.
    assert parser.found == {0: 0, 1: 1, 3: 1, 2: 1, 4: 2, 5: 2}
    assert column[1] == column[3] == column[2] > column[0]
    assert column[4] == column[5] > column[2]
    assert re.search(r"turn 5 · segment 2 · ⑂ fork of turn 2", "\n".join(lines))


def test_model_text_in_a_node_is_escaped() -> None:
    specs = [TreeTurn(-1, [1], [2], [{"role": "user", "content": "<script>x</script>"}])]
    events: list[TurnCompleted] = tree_events(specs)
    nodes = tree_nodes(events, chains=(0,), samples=(0,))

    page = "".join(html_tree(tree_paths(nodes)))

    assert "<script>" not in page and "“user: &lt;script&gt;x&lt;/script&gt;”" in page


def test_a_retry_is_a_branch_of_its_parent_not_a_fork() -> None:
    """Turn 2 asks turn 0's question again after turn 1 answered it: it extends turn 0 whole,
    whose segment turn 1 carries on, so it is a branch in a segment of its own."""
    t0 = TreeTurn(-1, [*SYS, 10], [11, 12], [{"role": "user", "content": "task"}])
    t1 = TreeTurn(0, [*t0.context, 13], [14], [*t0.messages, t0.assistant_message, _tool("r")])
    t2 = TreeTurn(0, [*t0.context, 13], [15], [*t0.messages, t0.assistant_message, _tool("r")])

    view = view_of(tree_session([t0, t1, t2]))

    assert view.result is not None and view.result.forks == 0
    assert [n.relation for n in tree_nodes(tree_events([t0, t1, t2]), chains=(0, 0, 1),
            samples=(0, 0, 1))] == [ROOT, CONTINUES, BRANCH]  # fmt: skip
    marker = start_text(view.segments[1])
    assert marker is not None and marker.startswith("⑃ branch at turn 2")


# -- agents (issue 35) -------------------------------------------------------------------------


def test_each_trajectory_says_whose_conversation_it_is() -> None:
    turns = claude_code_turns()  # main, fork, fresh, main, fork, fresh, a compaction call
    gone = TreeTurn(5, [*turns[5].context, 24], [25], extra={
        "agent": {**FRESH, "mismatch": "shares no <parent> request"}, "client_gone": True,
    })  # fmt: skip

    view = view_of(tree_session([*turns, gone]))
    page = render_html(view)
    console = Console(width=300, record=True)
    for part in render_terminal(view):
        console.print(part)
    shown = console.export_text()

    assert [agent_text(s) for s in view.segments] == [
        "agent main (main) · request class main · named by claude_code",
        "agent a9e64a5ca0980ef44 (fork of main) · type fork · named by claude_code",
        "agent adfda152c31bc96cc (fresh of main) · type general-purpose · named by claude_code · "
        "the tokens overruled the client: shares no <parent> request · client gone: it never "
        "saw the last reply",
        "agent main (main) · request class compaction · named by claude_code · side call: left "
        "out of training rows unless kept",
    ]
    nodes = {n.turn: node_text(n) for path in _flatten(view.tree) for n in path.nodes}
    assert "· agent a9e64a5ca0980ef44 ·" in nodes[1]
    assert "· agent main · side call (compaction) ·" in nodes[6]
    assert "· client gone ·" in nodes[7]
    for text in filter(None, map(agent_text, view.segments)):
        assert text in shown
    assert "shares no &lt;parent&gt; request" in page and "<parent>" not in page
    assert dict(view.header())["agents"] == (
        "main (main), a9e64a5ca0980ef44 (fork), adfda152c31bc96cc (fresh); 1 side call"
    )


def test_a_trajectory_of_a_client_that_names_no_agents_says_nothing_of_agents() -> None:
    view = view_of(tree_session(linear(3)))

    assert [agent_text(s) for s in view.segments] == [None]
    assert "agents" not in dict(view.header())
    assert "agent" not in render_html(view).split("turn tree")[1]


def _flatten(paths: list[TreePath]) -> list[TreePath]:
    out: list[TreePath] = []
    pending = list(paths)
    while pending:
        path = pending.pop()
        out.append(path)
        pending.extend(path.branches)
    return out
