"""What ``turnstream inspect`` shows of one session, before any rendering. Pure: no I/O.

``session_view`` folds the session's vetted events exactly as the fold worker does
(``consumers.worker.fold_session``) and lays them out twice: as the session's turn tree
(``turnstream.inspect.tree``: every turn under its parent, continuing it, forking from it or
starting a new conversation) and per segment (sample) and turn: the prompt tokens each turn
added, its completion, the tokens a segment's first turn shares with its parent's context
(collapsed), and what starts the segment. A segment's turns are the ones the fold put in it
(``FoldResult.turn_segments``), not an index range: in a tree, conversations interleave. The
``*_text`` helpers here and in ``turnstream.inspect.text`` are the words both renderers
(terminal, HTML) use, so the two views say the same.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from consumers.config import FoldWorkerSettings
from consumers.errors import FoldError
from consumers.fold import FoldResult
from consumers.worker import fold_options, fold_session
from schemas.events import (
    UNKNOWN_VERSION,
    RewardAssigned,
    SessionClosed,
    SessionOpened,
    TurnCompleted,
)
from schemas.images import ImageRef
from schemas.trust import VettedSession
from turnstream.inspect.text import number, printable, version_story
from turnstream.inspect.tree import (
    BRANCH,
    FORK,
    NEW_FROM,
    ROOT,
    TreeNode,
    TreePath,
    tree_nodes,
    tree_paths,
)

__all__ = [
    "SegmentView",
    "SessionView",
    "Token",
    "TurnView",
    "agent_text",
    "heat",
    "prompt_items",
    "segment_title",
    "session_view",
    "shared_text",
    "start_text",
    "token_title",
    "turn_title",
]

_UNFOLDED = "not folded: each turn's prompt delta and completion as stored"
JSON = dict[str, Any]


@dataclass(frozen=True)
class Token:
    id: int
    text: str
    generated: bool  # loss_mask 1
    logprob: float  # 0 where not generated
    version: int  # weight_version of a generated token (UNKNOWN_VERSION: unknown), -1 elsewhere


@dataclass(frozen=True)
class TurnView:
    event: TurnCompleted
    prompt: list[Token]  # the prompt tokens this turn added to its segment
    completion: list[Token]
    reward: float | None  # per-turn reward
    start: int = 0  # the index of ``prompt[0]`` in the turn's full prompt


def prompt_items(view: TurnView) -> list[Token | ImageRef]:
    """The turn's prompt tokens, each of its images (``event.images``) standing in place of
    its run of placeholder tokens: what the views draw (one mark, not 256 ``<|image_pad|>``).

    >>> ref = ImageRef("ab" * 32, offset=11, length=2, width=8, height=8)
    >>> turn = TurnCompleted(run="r", session="s", turn=0, prompt_ids=[1] * 14, completion_ids=[],
    ...                      logprobs=[], images=[ref])
    >>> tokens = [Token(i, "t", False, 0.0, -1) for i in range(4)]
    >>> items = prompt_items(TurnView(turn, tokens, [], None, start=10))
    >>> [getattr(item, "offset", None) for item in items]
    [None, 11, None]
    """
    at = {ref.offset: ref for ref in view.event.images}
    items: list[Token | ImageRef] = []
    skip_to = -1
    for position, token in enumerate(view.prompt, view.start):
        if position < skip_to:
            continue
        if (ref := at.get(position)) is not None:
            items.append(ref)
            skip_to = ref.end
        else:
            items.append(token)
    return items


@dataclass(frozen=True)
class SegmentView:
    trajectory_id: str
    segment: int
    tokens: int
    generated: int
    reward: float | None
    turns: list[TurnView]
    start: TreeNode | None = None  # the first turn's node: what it is to its parent
    shared: int = 0  # leading prompt tokens shared with the parent's context (collapsed)
    parent_context: int = 0  # tokens in the parent turn's context (0: no parent)
    parent_segment: int | None = None  # the segment that holds the parent turn
    folded: bool = True  # False: the turns as stored, of a session the fold refused
    metadata: JSON = field(default_factory=dict)  # the trajectory's (its agent, side, ...)

    @property
    def fork(self) -> bool:
        """The segment begins inside generated history (an edited history, a retry)."""
        return self.start is not None and self.start.relation == FORK


@dataclass(frozen=True)
class SessionView:
    run: str
    session: str
    opened: SessionOpened | None
    closed: SessionClosed | None
    turns: list[TurnCompleted]
    rewards: list[RewardAssigned]
    result: FoldResult | None
    fold_error: str | None
    untrusted: int  # events the vetting left out (schemas.trust)
    segments: list[SegmentView]
    tree: list[TreePath]  # the turn tree, one path per conversation root

    @property
    def status(self) -> str:
        return self.closed.status if self.closed is not None else "open"

    @property
    def final_reward(self) -> float | None:
        if self.result is not None and self.result.trajectories:
            return self.result.trajectories[-1].reward
        return self.closed.reward if self.closed is not None else None

    @property
    def weight_versions(self) -> list[int]:
        return sorted({turn.weight_version for turn in self.turns})

    def header(self) -> list[tuple[str, str]]:
        group = (self.opened.group if self.opened else None) or f"{self.session} (none given)"
        forks = str(self.result.forks) if self.result is not None else "?"
        rows = [
            ("run", self.run),
            ("session", self.session),
            ("group", group),
            ("model", self.opened.model if self.opened else "?"),
            ("status", self.status),
            ("reward", number(self.final_reward)),
            ("turns", str(len(self.turns))),
            ("weight versions", ", ".join(map(str, self.weight_versions)) or "-"),
            ("forks", forks),
            ("trajectories", str(len(self.result.trajectories)) if self.result else "-"),
        ]
        if agents := self._agents():
            rows.append(("agents", agents))
        if self.rewards:
            rows.append(("rewards", ", ".join(map(_reward_text, self.rewards))))
        if self.opened is not None and self.opened.metadata:
            rows.append(("metadata", json.dumps(self.opened.metadata, sort_keys=True)))
        if self.result is not None and (self.result.late_events or self.untrusted):
            rows.append(
                ("left out", f"{self.result.late_events} late, {self.untrusted} untrusted events")
            )
        if self.fold_error is not None:
            rows.append(("not folded", self.fold_error))
        return [(key, printable(value)) for key, value in rows]  # metadata is the agent's

    def _agents(self) -> str:
        """The agents the session's trajectories name, each once with its kind, and how many
        side calls: "" for a client that names none."""
        named: dict[str, str] = {}
        side = 0
        for trajectory in self.result.trajectories if self.result is not None else []:
            m = trajectory.metadata
            side += m.get("side") is True
            if isinstance(agent := m.get("agent_id"), str) and not m.get("side"):
                named.setdefault(agent, str(m.get("agent_kind") or "?"))
        text = ", ".join(f"{agent} ({kind})" for agent, kind in named.items())
        if side:
            text += f"{'; ' if text else ''}{side} side call{'s' if side != 1 else ''}"
        return text


# -- the view (pure) --------------------------------------------------------------------------


def session_view(
    run: str, session: str, vetted: VettedSession, decode: dict[int, str], *, per_turn: bool
) -> SessionView:
    """The view of one session's vetted events; ``decode`` maps every token id to its text."""
    by_index: dict[int, TurnCompleted] = {}
    for event in vetted.events:
        if isinstance(event, TurnCompleted):
            by_index.setdefault(event.turn, event)
    turns = [by_index[t] for t in sorted(by_index)]
    opened = next((e for e in vetted.events if isinstance(e, SessionOpened)), None)
    try:
        result, chains = _fold(vetted, opened, per_turn)
    except FoldError as exc:
        nodes = tree_nodes(turns, chains=None, samples=None)
        segment = _unfolded(turns, decode)
        return _view(run, session, vetted, turns, None, str(exc), [segment], nodes)
    members = _sample_turns(result)
    rewards = {
        turn: value
        for sample, indices in zip(result.trajectories, members, strict=True)
        for turn, value in zip(indices, sample.turn_rewards, strict=True)
    }
    nodes = tree_nodes(
        turns,
        chains=chains.turn_segments,
        samples=result.turn_segments,
        fork_turns=result.fork_turns,
        rewards=rewards,
    )
    by_turn = {node.turn: node for node in nodes}
    # Where each folded turn's context ends, and in which sample: a branch's parent context.
    ends = {
        turn: (s, end)
        for s, (sample, indices) in enumerate(zip(result.trajectories, members, strict=True))
        for turn, end in zip(indices, sample.turn_ends.tolist(), strict=True)
    }
    segments: list[SegmentView] = []
    for sample, indices in zip(result.trajectories, members, strict=True):
        ids, mask = sample.input_ids, sample.loss_mask
        start = by_turn[indices[0]]
        shared = start.shared if start.parent in ends else 0
        tokens = [
            Token(int(i), decode.get(int(i), "�"), bool(m), float(lp), int(v))
            for i, m, lp, v in zip(
                ids.tolist(), mask.tolist(), sample.logprobs.tolist(), sample.versions.tolist(),
                strict=True,
            )
        ]  # fmt: skip
        views: list[TurnView] = []
        begin = shared
        for turn, end, reward in zip(
            indices, sample.turn_ends.tolist(), sample.turn_rewards, strict=True
        ):
            generated = int(mask[begin:end].sum())  # the completion closes the turn's span
            views.append(
                TurnView(
                    event=by_index[turn],
                    prompt=tokens[begin : end - generated],
                    completion=tokens[end - generated : end],
                    reward=reward,
                    start=begin,  # a sample's ids are its turns' full prompts, extended
                )
            )
            begin = end
        parent_segment, parent_context = ends.get(start.parent, (None, 0))
        segments.append(
            SegmentView(
                trajectory_id=sample.trajectory_id,
                segment=sample.segment,
                tokens=len(ids),
                generated=int(mask.sum()),
                reward=sample.reward,
                turns=views,
                start=start,
                shared=shared,
                parent_context=parent_context,
                parent_segment=parent_segment,
                metadata=sample.metadata,
            )
        )
    return _view(run, session, vetted, turns, result, None, segments, nodes)


def _fold(
    vetted: VettedSession, opened: SessionOpened | None, per_turn: bool
) -> tuple[FoldResult, FoldResult]:
    """The fold as the worker does it (``per_turn`` forced on, if given), and the fold into
    chains, which the tree's relations come from: the same fold unless it is per turn."""
    defaults = FoldWorkerSettings()
    result = fold_session(vetted, defaults, per_turn=per_turn or None)
    if per_turn or fold_options(defaults, opened).per_turn:
        return result, fold_session(vetted, defaults, per_turn=False)
    return result, result


def _sample_turns(result: FoldResult) -> list[list[int]]:
    """The turn indices of each sample, in order."""
    members: list[list[int]] = [[] for _ in result.trajectories]
    for turn, sample in enumerate(result.turn_segments):
        members[sample].append(turn)
    return members


def _view(
    run: str,
    session: str,
    vetted: VettedSession,
    turns: list[TurnCompleted],
    result: FoldResult | None,
    error: str | None,
    segments: list[SegmentView],
    nodes: list[TreeNode],
) -> SessionView:
    events = vetted.events
    return SessionView(
        run=run,
        session=session,
        opened=next((e for e in events if isinstance(e, SessionOpened)), None),
        closed=next((e for e in events if isinstance(e, SessionClosed)), None),
        turns=turns,
        rewards=[e for e in events if isinstance(e, RewardAssigned)],
        result=result,
        fold_error=error,
        untrusted=len(vetted.rejected),
        segments=segments,
        tree=tree_paths(nodes),
    )


def _unfolded(turns: list[TurnCompleted], decode: dict[int, str]) -> SegmentView:
    """The turns of a session the fold refused, as stored: each prompt is its delta."""
    views = [
        TurnView(
            event=turn,
            prompt=[Token(i, decode.get(i, "�"), False, 0.0, -1) for i in turn.prompt_ids.tolist()],
            completion=[
                Token(i, decode.get(i, "�"), True, lp, v)
                for i, lp, v in zip(
                    turn.completion_ids.tolist(),
                    turn.logprobs.tolist(),
                    turn.token_versions().tolist(),
                    strict=True,
                )
            ],
            reward=None,
            start=turn.prefix_len,
        )
        for turn in turns
    ]
    generated = sum(len(view.completion) for view in views)
    return SegmentView(
        trajectory_id="",
        segment=0,
        tokens=generated + sum(len(view.prompt) for view in views),
        generated=generated,
        reward=None,
        turns=views,
        folded=False,
    )


def _reward_text(reward: RewardAssigned) -> str:
    where = "episode" if reward.turn is None else f"turn {reward.turn}"
    return f"{reward.key}={reward.value:g} ({where})"


def heat(logprob: float) -> tuple[int, int, int]:
    """Red (probability 0) through yellow (0.5) to green (1)."""
    p = math.exp(min(logprob, 0.0))
    return min(255, int(510 * (1 - p))), min(255, int(510 * p)), 0


def turn_title(view: TurnView) -> str:
    e = view.event
    parts = [f"turn {e.turn}", f"weight_version {e.weight_version}", *version_story(e)]
    parts.append(f"finish {e.finish_reason}")
    parts.append(f"{len(view.prompt)} prompt + {len(view.completion)} generated tokens")
    if view.reward is not None:
        parts.append(f"reward {view.reward:g}")
    return " · ".join(parts)


def segment_title(segment: SegmentView) -> str:
    turns = [view.event.turn for view in segment.turns]
    if not turns:
        span = "no turns"
    elif len(turns) == 1:
        span = f"turn {turns[0]}"
    elif turns == list(range(turns[0], turns[-1] + 1)):
        span = f"turns {turns[0]}-{turns[-1]}"
    else:
        span = f"turns {', '.join(map(str, turns))}"
    what = f"trajectory {segment.trajectory_id}" if segment.folded else _UNFOLDED
    return (
        f"{what} · {span} · {segment.tokens} tokens, {segment.generated} generated · "
        f"reward {number(segment.reward)}"
    )


def start_text(segment: SegmentView) -> str | None:
    """What starts the segment, when it is not the session's first nor a turn continuing the
    sample before it (per-turn samples): a fork, or a new conversation."""
    node = segment.start
    if node is None or segment.segment == 0:
        return None
    here = f"segment {segment.segment} starts here"
    if node.relation == FORK:
        return (
            f"⑂ fork at turn {node.turn}: its prompt keeps {segment.shared} of turn "
            f"{node.parent}'s {segment.parent_context} context tokens and rewrites the rest: "
            f"{here}"
        )
    if node.relation == BRANCH:
        return (
            f"⑃ branch at turn {node.turn}: it continues turn {node.parent}'s whole context "
            f"({segment.parent_context} tokens), which segment {segment.parent_segment} carries "
            f"on too (a retry, another sub-agent from that context): {here}"
        )
    if node.relation == NEW_FROM:
        return (
            f"↳ new conversation at turn {node.turn}: its prompt shares {segment.shared} "
            f"prompt tokens of turn {node.parent}'s context, none it generated: {here}"
        )
    if node.relation == ROOT:
        return f"↳ new conversation at turn {node.turn}, with no parent: {here}"
    return None


def agent_text(segment: SegmentView) -> str | None:
    """Whose conversation the segment is (issue 35): the agent its client named, its kind and
    parent agent, type, request class, the headers that named it, where the tokens overruled
    the client, and whether it is a side call or its client went away. None when the
    trajectory says none of it (a client that names no agents)."""
    m = segment.metadata
    parts: list[str] = []
    if agent := m.get("agent_id"):
        kind, parent = m.get("agent_kind"), m.get("parent_agent")
        relation = (
            f"{kind} of {parent}"
            if kind and parent
            else kind or (f"under {parent}" if parent else "")
        )
        parts.append(f"agent {agent}" + (f" ({relation})" if relation else ""))
    for key, label in (
        ("agent_type", "type"),
        ("request_class", "request class"),
        ("agent_source", "named by"),
        ("agent_mismatch", "the tokens overruled the client"),
    ):
        if value := m.get(key):
            parts.append(f"{label} {value}" if key != "agent_mismatch" else f"{label}: {value}")
    if m.get("side"):
        parts.append("side call: left out of training rows unless kept")
    if m.get("client_gone"):
        parts.append("client gone: it never saw the last reply")
    return printable(" · ".join(parts)) if parts else None


def shared_text(segment: SegmentView) -> str:
    return f"[{segment.shared} tokens shared with segment {segment.parent_segment}]"


def token_title(token: Token) -> str:
    if not token.generated:
        return f"id {token.id} · prompt (loss_mask 0)"
    return (
        f"id {token.id} · logprob {token.logprob:.4f} · p {math.exp(token.logprob):.3f} · "
        f"weight_version {'? (unknown)' if token.version == UNKNOWN_VERSION else token.version}"
    )
