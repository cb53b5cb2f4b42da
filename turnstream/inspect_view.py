"""What ``turnstream inspect`` shows of one session, before any rendering. Pure: no I/O.

``session_view`` folds the session's vetted events exactly as the fold worker does
(``consumers.worker.fold_session``) and lays the trajectories out per segment and turn: the
prompt tokens each turn added, its completion, the tokens a segment shares with the previous
context (collapsed), and whether it starts with a fork. The ``*_text`` helpers are the words
both renderers (terminal, HTML) use, so the two views say the same.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from consumers.config import FoldWorkerSettings
from consumers.errors import FoldError
from consumers.fold import FoldResult
from consumers.worker import fold_session
from schemas.events import JSON, RewardAssigned, SessionClosed, SessionOpened, TurnCompleted
from schemas.trust import VettedSession

__all__ = [
    "SegmentView",
    "SessionView",
    "Token",
    "TurnView",
    "fork_text",
    "heat",
    "message_text",
    "printable",
    "segment_title",
    "session_view",
    "shared_text",
    "token_title",
    "tool_call_text",
    "turn_title",
]

_SHOWN_CHARS = 300  # of each message's content
_UNFOLDED = "not folded: each turn's prompt delta and completion as stored"


@dataclass(frozen=True)
class Token:
    id: int
    text: str
    generated: bool  # loss_mask 1
    logprob: float  # 0 where not generated
    version: int  # weight_version of a generated token, -1 elsewhere


@dataclass(frozen=True)
class TurnView:
    event: TurnCompleted
    prompt: list[Token]  # the prompt tokens this turn added to its segment
    completion: list[Token]
    reward: float | None  # per-turn reward


@dataclass(frozen=True)
class SegmentView:
    trajectory_id: str
    segment: int
    tokens: int
    generated: int
    reward: float | None
    shared: int  # leading prompt tokens shared with the previous segment's context (collapsed)
    fork: bool  # the first turn's prompt does not extend the previous turn's context
    previous_context: int  # tokens in the previous turn's context (0 for segment 0)
    turns: list[TurnView]
    folded: bool = True  # False: the turns as stored, of a session the fold refused


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
            ("reward", _number(self.final_reward)),
            ("turns", str(len(self.turns))),
            ("weight versions", ", ".join(map(str, self.weight_versions)) or "-"),
            ("forks", forks),
            ("trajectories", str(len(self.result.trajectories)) if self.result else "-"),
        ]
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


# -- the view (pure) --------------------------------------------------------------------------


def session_view(
    run: str, session: str, vetted: VettedSession, decode: dict[int, str], *, per_turn: bool
) -> SessionView:
    """The view of one session's vetted events; ``decode`` maps every token id to its text."""
    turns: dict[int, TurnCompleted] = {}
    for event in vetted.events:
        if isinstance(event, TurnCompleted):
            turns.setdefault(event.turn, event)
    result: FoldResult | None = None
    error: str | None = None
    try:
        result = fold_session(vetted, FoldWorkerSettings(), per_turn=per_turn or None)
    except FoldError as exc:
        error = str(exc)
    if result is None:
        return _view(run, session, vetted, turns, None, error, [_unfolded(turns, decode)])
    segments: list[SegmentView] = []
    previous: np.ndarray | None = None
    for sample in result.trajectories:
        ids, mask = sample.input_ids, sample.loss_mask
        first_turn = int(sample.metadata.get("first_turn", 0))
        prompt = ids[: sample.prompt_len]
        shared = _common_prefix(prompt, previous) if previous is not None else 0
        extends = previous is not None and shared == len(previous)
        tokens = [
            Token(int(i), decode.get(int(i), "�"), bool(m), float(lp), int(v))
            for i, m, lp, v in zip(
                ids.tolist(), mask.tolist(), sample.logprobs.tolist(), sample.versions.tolist(),
                strict=True,
            )
        ]  # fmt: skip
        views: list[TurnView] = []
        start = shared
        for j, end in enumerate(sample.turn_ends.tolist()):
            generated = int(mask[start:end].sum())  # the completion closes the turn's span
            views.append(
                TurnView(
                    event=turns[first_turn + j],
                    prompt=tokens[start : end - generated],
                    completion=tokens[end - generated : end],
                    reward=sample.turn_rewards[j],
                )
            )
            start = end
        segments.append(
            SegmentView(
                trajectory_id=sample.trajectory_id,
                segment=sample.segment,
                tokens=len(ids),
                generated=int(mask.sum()),
                reward=sample.reward,
                shared=shared,
                fork=previous is not None and not extends,
                previous_context=len(previous) if previous is not None else 0,
                turns=views,
            )
        )
        previous = ids
    return _view(run, session, vetted, turns, result, None, segments)


def _view(
    run: str,
    session: str,
    vetted: VettedSession,
    turns: dict[int, TurnCompleted],
    result: FoldResult | None,
    error: str | None,
    segments: list[SegmentView],
) -> SessionView:
    events = vetted.events
    return SessionView(
        run=run,
        session=session,
        opened=next((e for e in events if isinstance(e, SessionOpened)), None),
        closed=next((e for e in events if isinstance(e, SessionClosed)), None),
        turns=[turns[t] for t in sorted(turns)],
        rewards=[e for e in events if isinstance(e, RewardAssigned)],
        result=result,
        fold_error=error,
        untrusted=len(vetted.rejected),
        segments=segments,
    )


def _unfolded(turns: dict[int, TurnCompleted], decode: dict[int, str]) -> SegmentView:
    """The turns of a session the fold refused, as stored: each prompt is its delta."""
    views = [
        TurnView(
            event=turn,
            prompt=[Token(i, decode.get(i, "�"), False, 0.0, -1) for i in turn.prompt_ids.tolist()],
            completion=[
                Token(i, decode.get(i, "�"), True, lp, turn.weight_version)
                for i, lp in zip(turn.completion_ids.tolist(), turn.logprobs.tolist(), strict=True)
            ],
            reward=None,
        )
        for _, turn in sorted(turns.items())
    ]
    generated = sum(len(view.completion) for view in views)
    return SegmentView(
        trajectory_id="",
        segment=0,
        tokens=generated + sum(len(view.prompt) for view in views),
        generated=generated,
        reward=None,
        shared=0,
        fork=False,
        previous_context=0,
        turns=views,
        folded=False,
    )


def printable(text: str) -> str:
    """``text`` with control characters (a terminal escape in model output) made visible."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c in "\n\t" else repr(c)[1:-1] for c in text)


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def _reward_text(reward: RewardAssigned) -> str:
    where = "episode" if reward.turn is None else f"turn {reward.turn}"
    return f"{reward.key}={reward.value:g} ({where})"


def heat(logprob: float) -> tuple[int, int, int]:
    """Red (probability 0) through yellow (0.5) to green (1)."""
    p = math.exp(min(logprob, 0.0))
    return min(255, int(510 * (1 - p))), min(255, int(510 * p)), 0


def turn_title(view: TurnView) -> str:
    e = view.event
    parts = [f"turn {e.turn}", f"weight_version {e.weight_version}", f"finish {e.finish_reason}"]
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
        f"reward {_number(segment.reward)}"
    )


def fork_text(segment: SegmentView) -> str:
    turn = segment.turns[0].event.turn
    return (
        f"⑂ fork at turn {turn}: its prompt keeps {segment.shared} of turn {turn - 1}'s "
        f"{segment.previous_context} context tokens and rewrites the rest: segment "
        f"{segment.segment} starts here"
    )


def shared_text(segment: SegmentView) -> str:
    return f"[{segment.shared} tokens shared with segment {segment.segment - 1}]"


def message_text(message: JSON) -> str:
    content: Any = message.get("content")
    if isinstance(content, list):  # OpenAI content parts
        content = " ".join(
            str(part.get("text", part)) if isinstance(part, dict) else str(part) for part in content
        )
    text = content if isinstance(content, str) else json.dumps(content)
    if message.get("tool_call_id"):
        text = f"[{message['tool_call_id']}] {text}"
    if len(text) > _SHOWN_CHARS:
        text = text[:_SHOWN_CHARS] + f"… ({len(text)} chars)"
    return printable(f"{message.get('role', '?')}: {text}")


def tool_call_text(call: JSON) -> str:
    function = call.get("function") or {}
    return printable(f"tool call {function.get('name', '?')}({function.get('arguments', '')})")


def token_title(token: Token) -> str:
    if not token.generated:
        return f"id {token.id} · prompt (loss_mask 0)"
    return (
        f"id {token.id} · logprob {token.logprob:.4f} · p {math.exp(token.logprob):.3f} · "
        f"weight_version {token.version}"
    )
