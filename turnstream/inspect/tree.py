"""The turn tree of one session, as ``turnstream inspect`` draws it (issue 18). Pure.

A session is a tree (DESIGN §5): every turn hangs under its parent (``TurnCompleted.parent``,
-1: none). ``tree_nodes`` says what each turn is to its parent, from the fold's chains:

- it *continues* its parent (it joined the parent's segment, the parent's context extended);
- it is a *fork*: a new segment that diverges inside generated history (an edited history);
- it is a *branch*: a new segment that extends its parent whose segment another turn carries
  on already (a retry of a turn, a second sub-agent started from one context);
- it starts a *new conversation*: no parent, or a new segment that shares only prompt tokens
  with its parent's context (a sub-agent that shares the system prompt);

with the segment (sample) it was folded into, the agent its client named (a side call, a
client gone), the tokens it shares with its parent's context and adds, its weight_version,
finish reason, per-turn reward and the first words of its newest message. ``tree_paths``
lays the nodes out compactly: a chain of only children is one path drawn at one level, and
only a turn with several children opens branches, so a linear session is one flat path, not a
staircase.

>>> nodes = [TreeNode(turn=t, parent=p, segment=s, relation=r) for t, p, s, r in
...          [(0, -1, 0, ROOT), (1, 0, 0, CONTINUES), (2, 1, 0, CONTINUES), (3, 1, 1, FORK)]]
>>> [path] = tree_paths(nodes)
>>> [n.turn for n in path.nodes], [[n.turn for n in b.nodes] for b in path.branches]
([0, 1], [[2], [3]])
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Literal

from schemas.agents import is_side_class
from schemas.events import TurnCompleted
from turnstream.inspect.text import first_words, message_text, number, printable, version_story

__all__ = [
    "BRANCH",
    "CONTINUES",
    "FORK",
    "NEW_FROM",
    "NOT_FOLDED",
    "ROOT",
    "Relation",
    "TreeNode",
    "TreePath",
    "node_text",
    "relation_text",
    "tree_nodes",
    "tree_paths",
]

Relation = Literal[
    "new conversation", "continues", "fork", "branch", "new from prompt", "not folded"
]
ROOT: Final = "new conversation"  # no parent: the context starts empty
CONTINUES: Final = "continues"  # in its parent's segment
FORK: Final = "fork"  # a new segment diverging inside generated history
BRANCH: Final = "branch"  # a new segment extending its parent (a retry, a second sub-agent)
NEW_FROM: Final = "new from prompt"  # a new segment sharing only prompt tokens: a new conversation
NOT_FOLDED: Final = "not folded"  # the fold refused the session, or the turn came after the close

_PREVIEW_WORDS = 8


@dataclass(frozen=True)
class TreeNode:
    turn: int
    parent: int  # -1: none
    segment: int | None  # the sample the turn was folded into; None: not folded
    relation: Relation
    shared: int = 0  # tokens of the parent's context its prompt starts with
    added: int = 0  # prompt tokens after those
    generated: int = 0
    weight_version: int = 0
    versions: tuple[str, ...] = ()  # its version boundaries and continuations (version_story)
    finish_reason: str = "stop"
    reward: float | None = None  # per-turn reward
    preview: str = ""  # the first words of its newest message
    orphan: bool = False  # its parent is not among the turns (a gap in the log)
    agent: str = ""  # the agent its client named ("": none)
    side: str = ""  # the request class of a side request ("": the agent's own turn)
    client_gone: bool = False  # the client went away before the reply was whole


@dataclass(frozen=True)
class TreePath:
    """Turns each the only child of the one before, drawn at one level; ``branches``: the paths
    that start at the children of the last one, when it has several (else none)."""

    nodes: tuple[TreeNode, ...]
    branches: tuple[TreePath, ...] = ()


def tree_nodes(
    turns: Sequence[TurnCompleted],
    *,
    chains: Sequence[int] | None,
    samples: Sequence[int] | None,
    fork_turns: Collection[int] = (),
    rewards: Mapping[int, float | None] | None = None,
) -> list[TreeNode]:
    """One node per turn (``turns``: distinct turn indices, in order).

    ``chains`` is the segment of each folded turn when every chain is one sample (the fold's
    ``turn_segments`` without per_turn), ``samples`` the sample of each folded turn as shown
    (the same, or one per turn); indexed by turn, shorter than ``turns`` by the late turns, None
    when the fold refused the session. ``fork_turns`` and per-turn ``rewards`` as the fold gave.
    """
    events = {turn.turn: turn for turn in turns}
    forks = frozenset(fork_turns)
    nodes: list[TreeNode] = []
    for event in turns:
        t, p = event.turn, event.parent
        folded = chains is not None and samples is not None and t < len(chains)
        parent = events.get(p)
        extends = parent is not None and event.prefix_len == _context_len(parent)
        relation = _relation(t, p, chains if folded else None, forks, extends)
        prompt_len = event.prefix_len + len(event.prompt_ids)
        # Continuing means starting with the parent's whole context, however it was encoded (a
        # client that resends its history stores a shorter prefix_len).
        shared = (
            _context_len(parent) if relation in (CONTINUES, BRANCH) and parent else event.prefix_len
        )
        newest = event.new_messages[-1] if event.new_messages else None
        nodes.append(
            TreeNode(
                turn=t,
                parent=p,
                segment=samples[t] if folded and samples is not None else None,
                relation=relation,
                shared=shared,
                added=prompt_len - shared,
                generated=len(event.completion_ids),
                weight_version=event.weight_version,
                versions=tuple(version_story(event)),
                finish_reason=event.finish_reason,
                reward=(rewards or {}).get(t),
                preview=first_words(message_text(newest), _PREVIEW_WORDS) if newest else "",
                orphan=p >= 0 and parent is None,
                agent=_text(event.agent.get("id")),
                side=_side_class(event),
                client_gone=event.client_gone,
            )
        )
    return nodes


def _relation(
    turn: int, parent: int, chains: Sequence[int] | None, forks: Collection[int], extends: bool
) -> Relation:
    if parent < 0:
        return ROOT
    if chains is None or parent >= len(chains):
        return NOT_FOLDED
    if turn in forks:
        return FORK
    if chains[turn] == chains[parent]:
        return CONTINUES
    return BRANCH if extends else NEW_FROM


def _side_class(event: TurnCompleted) -> str:
    request_class = _text(event.agent.get("request_class"))
    return request_class if is_side_class(request_class) else ""


def _text(value: object) -> str:
    return value if isinstance(value, str) else ""


def _context_len(event: TurnCompleted) -> int:
    return event.prefix_len + len(event.prompt_ids) + len(event.completion_ids)


def tree_paths(nodes: Iterable[TreeNode]) -> list[TreePath]:
    """The nodes as paths: one per root (a turn with no parent, or whose parent is missing), in
    turn order, each ending where a turn has several children. Iterative: a deep tree (a retry
    of every turn) needs no recursion."""
    by_turn = {node.turn: node for node in nodes}
    children: dict[int, list[TreeNode]] = {}
    for node in by_turn.values():
        if node.parent in by_turn:
            children.setdefault(node.parent, []).append(node)
    heads = [
        node
        for node in by_turn.values()
        if node.parent not in by_turn or len(children[node.parent]) > 1
    ]
    # A branch's head comes after the head of the path it hangs from (a child's index is higher
    # than its parent's), so building from the last head back finds every branch already built.
    built: dict[int, TreePath] = {}
    for head in sorted(heads, key=lambda node: node.turn, reverse=True):
        path = [head]
        while len(below := children.get(path[-1].turn, [])) == 1:
            path.append(below[0])
        branches = tuple(built.pop(child.turn) for child in sorted(below, key=_turn))
        built[head.turn] = TreePath(nodes=tuple(path), branches=branches)
    return [built[turn] for turn in sorted(built)]


def _turn(node: TreeNode) -> int:
    return node.turn


def relation_text(node: TreeNode) -> str:
    """What the turn is to its parent, in words."""
    if node.orphan:
        return f"parent turn {node.parent} not in the log"
    if node.relation == ROOT:
        return "new conversation"
    if node.relation == CONTINUES:
        return f"continues turn {node.parent}"
    if node.relation == FORK:
        return f"⑂ fork of turn {node.parent}"
    if node.relation == BRANCH:
        return f"⑃ branch of turn {node.parent} (continues it in a new segment)"
    if node.relation == NEW_FROM:
        return f"new conversation from turn {node.parent}'s prompt"
    return f"after turn {node.parent}, not folded"


def node_text(node: TreeNode) -> str:
    """One line per turn: what it is, what it added, how it ended, and how it began."""
    parts = [f"turn {node.turn}"]
    if node.segment is not None:
        parts.append(f"segment {node.segment}")
    parts.append(relation_text(node))
    if node.agent:
        parts.append(f"agent {printable(node.agent)}")
    if node.side:
        parts.append(f"side call ({printable(node.side)})")
    if node.client_gone:
        parts.append("client gone")
    tokens = f"{node.added} prompt + {node.generated} generated tokens"
    parts.append(f"{node.shared} shared + {tokens}" if node.shared else tokens)
    parts.append(f"weight_version {node.weight_version}")
    parts.extend(node.versions)
    parts.append(f"finish {node.finish_reason}")
    if node.reward is not None:
        parts.append(f"reward {number(node.reward)}")
    if node.preview:
        parts.append(f"“{node.preview}”")
    return " · ".join(parts)
