"""The fold (DESIGN §5): one session's events in, its trajectories out. Pure: no I/O, no clock.

Shaped like an event-sourced projection::

    state = initial()
    for event in events:  # any order, redeliveries included
        state = apply(state, event)
    result = finish(state, FoldOptions())

``apply`` only accumulates: it links the event in front of the events before it, a log that
every earlier state shares, so a session of n events costs O(n) time and memory and no state is
ever changed or copied. ``finish`` keeps one event per identity (the open, each turn index, each
reward (key, turn), the close), so neither the order of the events nor their duplicates change
the result. Everything that needs the whole session (which events are late, rebuilding the
delta-encoded prompts, cutting segments, rewards) happens in ``finish``.

A session is a tree (DESIGN §5): each turn's delta is taken against its parent turn
(``TurnCompleted.parent``). Turns are cut into chains, one trajectory each: a turn joins its
parent's chain when its prompt starts with the parent's whole context, the parent has no
continuing child yet and both turns are one agent's (``TurnCompleted.agent``: the same id, or
no id on either); any other turn starts a chain. A side request (compaction, auxiliary, ...)
is a chain of its own, and nothing continues it nor a turn whose client went away
(``client_gone``). Interleaved sub-agents thus become one trajectory per conversation, a fork
sub-agent a trajectory whose copy of its parent's history is all prompt, and a linear session
one trajectory, as before.

A two-turn session, delivered out of order and with turn 1 twice; turn 1 extends turn 0's
context ``[1, 2] + [3]`` by the tool result ``[4]``:

>>> t0 = TurnCompleted(run="r", session="s", turn=0, prompt_ids=[1, 2], completion_ids=[3],
...                    logprobs=[-0.5])
>>> t1 = TurnCompleted(run="r", session="s", turn=1, prefix_len=3, prompt_ids=[4],
...                    completion_ids=[5, 6], logprobs=[-0.25, -1.0], weight_version=7)
>>> close = SessionClosed(run="r", session="s", reward=1.0, num_turns=2)
>>> result = fold([close, t1, t0, t1])
>>> [sample] = result.trajectories
>>> sample.trajectory_id, sample.input_ids.tolist(), sample.loss_mask.tolist()
('r/s/0', [1, 2, 3, 4, 5, 6], [0, 0, 1, 0, 1, 1])
>>> sample.versions.tolist(), sample.logprobs.tolist(), sample.turn_ends.tolist()
([-1, -1, 0, -1, 7, 7], [0.0, 0.0, -0.5, 0.0, -0.25, -1.0], [3, 6])
>>> sample.prompt_len, sample.reward, result.forks, result.duplicates
(2, 1.0, 0, 1)

A retry of turn 1: turn 2 continues turn 0 too. Turn 1 already carries turn 0's chain on, so
turn 2 starts a second one, a branch; it extends turn 0 (nothing was rewritten), so it is no fork:

>>> t2 = TurnCompleted(run="r", session="s", turn=2, parent_turn=0, prefix_len=3,
...                    prompt_ids=[4], completion_ids=[8], logprobs=[-0.5])
>>> tree = fold([t0, t1, t2])
>>> [t.input_ids.tolist() for t in tree.trajectories], tree.turn_segments, tree.fork_turns
([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 8]], (0, 0, 1), ())
>>> tree.trajectories[1].metadata["branch_of"]
{'turn': 0, 'segment': 0, 'shared_tokens': 3}
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property, reduce
from itertools import islice
from typing import Literal, TypeVar

from consumers._metadata import (
    agent_metadata,
    raw_logprobs,
    sampling,
    temperatures,
    tree_metadata,
)
from consumers._segments import RebuiltTurn, rebuild, sample_spans, split
from consumers.errors import FoldError, MissingTurns
from schemas.codec import Codec
from schemas.events import (
    JSON,
    CompactTrajectory,
    RewardAssigned,
    SessionClosed,
    SessionEvent,
    SessionOpened,
    TrajectoryReady,
    TurnCompleted,
)

__all__ = [
    "FOLD_VERSION",
    "FoldOptions",
    "FoldResult",
    "SessionState",
    "apply",
    "finish",
    "fold",
    "initial",
]

FOLD_VERSION = 8
"""Stored in every TrajectoryReady: bump it whenever the same events would fold differently.
4: a turn's delta and chain follow its ``parent_turn`` (a session is a tree); a fork is a chain
that begins inside generated history. (Issue 19's ``logprobs_kind: "raw"`` in metadata needed no
bump: it came with the events that carry it, and every other sample folds as before.)
5 (issue 35): the agents the client named cut the chains: a turn joins its parent's chain only
when both have one agent id (or neither has one), a side request (``schemas.agents``) is a chain
of its own that nothing continues, and a turn whose client went away ends its chain; the
metadata names the chain's agent, ``side`` and ``client_gone``, and with
``final_reward_scope="last"`` the reward goes to the last sample that is not a side request;
``side_calls`` counts a session's side samples (beside ``segments``).
Events without agents or those flags fold to the same trajectories as under 4 but for the
version; a bump all the same, since one version must mean one rule.
6 (issue 37): a turn's completion carries each token's version (``TurnCompleted.version_spans``:
a generation the backend aborted for a weight update and the gateway continued), so its
generated tokens split into one span per version, and a token whose version is unknown has
``UNKNOWN_VERSION`` (-2). Events without the field fold as under 5.
7 (issue 38): a sample's metadata holds each turn's sampling (``sampling``: temperature, top_p,
top_k, min_p, one entry per turn), so a trainer recomputes each token's distribution, nucleus
included; ``temperatures`` stays beside it for readers of older rows. Events recording no
sampling fold as under 6.
8 (issue 39): a sample carries its images (``images``: digest, where its placeholder tokens sit
in the sample's ids, size, patch grid): its last turn's full prompt images, each turn's being
its parent's inside its shared prefix + its own (``schemas.images.prompt_images``). Text-only
events fold as under 7."""

RewardKey = tuple[str, int | None]  # (key, turn); turn None is the episode reward

# Only orders differing duplicates; no size limit, because an event too large for the wire can
# still be folded when it was built in memory.
_TIE_BREAK = Codec(max_payload=sys.maxsize)
_MISSING_SHOWN = 100

_E = TypeVar("_E", SessionOpened, TurnCompleted, RewardAssigned, SessionClosed)


@dataclass(frozen=True)
class FoldOptions:
    """How a session becomes samples."""

    per_turn: bool = False
    """Every turn its own sample (step-wise training) instead of one per segment."""
    final_reward_scope: Literal["last", "all"] = "all"
    """"all": every sample of the session carries the final reward; "last": only its last
    sample does, the earlier ones get None."""

    def __post_init__(self) -> None:
        if self.final_reward_scope not in ("last", "all"):
            raise ValueError(
                f"final_reward_scope must be 'last' or 'all', got {self.final_reward_scope!r}"
            )


@dataclass(frozen=True)
class FoldResult:
    compact_trajectories: list[CompactTrajectory]
    """The samples in the form TRAJ carries them (generated spans, not per-token arrays): what
    the fold worker publishes; ``trajectories`` has them per token."""
    forks: int
    """Chains whose first turn diverges inside generated history: it does not extend its
    parent, and the prefix it shares with the parent's context holds a token some turn
    generated (an edited or truncated history, a rewrite that keeps part of a reply). A chain
    whose first turn extends its parent (a retry of a turn, a second sub-agent started from one
    context) is a branch, not a fork; one that shares only prompt tokens (a sub-agent under its
    caller's system prompt) or nothing is a new conversation. Counted on the chains in
    per_turn mode too."""
    late_events: int
    """Distinct events not folded: turns at or after the close's num_turns, rewards created
    after the close, and per-turn rewards naming a turn that was not folded."""
    duplicates: int
    """Events dropped because another with the same identity was kept."""
    turn_segments: tuple[int, ...] = ()
    """The index (segment) of the trajectory each folded turn went into, indexed by turn."""
    fork_turns: tuple[int, ...] = ()
    """The turns that begin a fork (``forks`` of them), in order."""

    @cached_property
    def trajectories(self) -> list[TrajectoryReady]:
        """The samples with their per-token arrays, made from the spans on first reading."""
        return [t.expand() for t in self.compact_trajectories]


@dataclass(frozen=True, slots=True, eq=False)
class _Applied:
    """One link of a state's log: an applied event and the link of the events before it.

    Compared by identity: equality or a repr would recurse down the whole log."""

    event: SessionEvent
    before: _Applied | None


@dataclass(frozen=True, slots=True)
class _Kept:
    """One event per identity, the first of each in application order holding its place."""

    opened: SessionOpened | None = None
    turns: Mapping[int, TurnCompleted] = field(default_factory=dict)
    rewards: Mapping[RewardKey, RewardAssigned] = field(default_factory=dict)
    closed: SessionClosed | None = None
    duplicates: int = 0


@dataclass(frozen=True, slots=True)
class SessionState:
    """What ``apply`` has accumulated: the session's events, newest first.

    The properties resolve the log to one event per identity (the one first by
    (created_at, encoded bytes)) and the count of repeats; each reading walks the whole log, so
    ``finish`` reads it once."""

    run: str | None = None
    session: str | None = None
    log: _Applied | None = field(default=None, repr=False)
    events: int = 0
    """How many events were applied, repeats included."""

    @property
    def opened(self) -> SessionOpened | None:
        return _resolve(self.log).opened

    @property
    def turns(self) -> Mapping[int, TurnCompleted]:
        return _resolve(self.log).turns

    @property
    def rewards(self) -> Mapping[RewardKey, RewardAssigned]:
        return _resolve(self.log).rewards

    @property
    def closed(self) -> SessionClosed | None:
        return _resolve(self.log).closed

    @property
    def duplicates(self) -> int:
        return _resolve(self.log).duplicates


def initial() -> SessionState:
    """The state before any event."""
    return SessionState()


def _keep(current: _E | None, incoming: _E) -> _E:
    """Of two events with one identity, the one first by (created_at, encoded bytes).

    That order is total, so the survivor does not depend on which arrived first.
    """
    if current is None or current is incoming:
        return incoming
    if current.created_at != incoming.created_at:
        return current if current.created_at < incoming.created_at else incoming
    return current if _TIE_BREAK.encode(current) <= _TIE_BREAK.encode(incoming) else incoming


def apply(state: SessionState, event: SessionEvent) -> SessionState:
    """Return a new state with ``event`` accumulated; ``state`` is left unchanged.

    O(1): the new state links ``event`` in front of ``state``'s log, which both then share. A
    redelivered event (same identity as one already applied) only adds to ``duplicates``.
    Raises FoldError for an event of another session, or one that is not a session event.
    """
    if not isinstance(event, SessionOpened | TurnCompleted | RewardAssigned | SessionClosed):
        raise FoldError(
            f"run={getattr(event, 'run', '?')} session={getattr(event, 'session', '?')}: "
            f"cannot fold a {type(event).__name__}; the fold takes SessionOpened, "
            f"TurnCompleted, RewardAssigned and SessionClosed"
        )
    if state.run is not None and (event.run, event.session) != (state.run, state.session):
        raise FoldError(
            f"run={state.run} session={state.session}: got a {type(event).__name__} of "
            f"run={event.run} session={event.session}; a fold takes the events of one session"
        )
    return SessionState(event.run, event.session, _Applied(event, state.log), state.events + 1)


def _resolve(log: _Applied | None) -> _Kept:
    """The log's events in application order, one per identity (``_keep``), and the repeats."""
    applied: list[SessionEvent] = []
    while log is not None:
        applied.append(log.event)
        log = log.before
    opened: SessionOpened | None = None
    closed: SessionClosed | None = None
    turns: dict[int, TurnCompleted] = {}
    rewards: dict[RewardKey, RewardAssigned] = {}
    for event in reversed(applied):
        if isinstance(event, TurnCompleted):
            turns[event.turn] = _keep(turns.get(event.turn), event)
        elif isinstance(event, RewardAssigned):
            key: RewardKey = (event.key, event.turn)
            rewards[key] = _keep(rewards.get(key), event)
        elif isinstance(event, SessionOpened):
            opened = _keep(opened, event)
        else:
            closed = _keep(closed, event)
    distinct = len(turns) + len(rewards) + (opened is not None) + (closed is not None)
    return _Kept(opened, turns, rewards, closed, len(applied) - distinct)


def _turns_to_fold(
    run: str, session: str, turns: Mapping[int, TurnCompleted], closed: SessionClosed | None
) -> tuple[list[TurnCompleted], int]:
    """Turns 0..n-1 in order and the number of late turns; MissingTurns if there is a gap."""
    limit = closed.num_turns if closed is not None else None
    if limit is None:
        expected = max(turns, default=-1) + 1
        why = f"turn {expected - 1} is present"
    elif limit < 0:
        raise FoldError(
            f"run={run} session={session}: the close says num_turns={limit}, which is "
            f"negative; the close is corrupt, dead-letter the session"
        )
    else:
        expected = limit
        why = f"the close says num_turns={limit}"
    present = sum(1 for index in turns if index < expected)
    if present < expected:
        # islice: a corrupt num_turns must not make us list a billion indices.
        gaps = islice((i for i in range(expected) if i not in turns), _MISSING_SHOWN)
        raise MissingTurns(run, session, list(gaps), expected, why, expected - present)
    return [turns[index] for index in range(expected)], len(turns) - expected


def _is_late(reward: RewardAssigned, closed: SessionClosed | None, num_turns: int) -> bool:
    after_close = closed is not None and reward.created_at > closed.created_at
    no_such_turn = reward.turn is not None and not 0 <= reward.turn < num_turns
    return after_close or no_such_turn


def _final_reward(closed: SessionClosed | None, episode: list[RewardAssigned]) -> float | None:
    if closed is not None and closed.reward is not None:
        return closed.reward
    # fsum is exactly rounded, so the sum does not depend on the order of the components.
    return math.fsum(r.value for r in episode) if episode else None


def _turn_rewards(per_turn: list[RewardAssigned]) -> dict[int, float]:
    values: dict[int, list[float]] = {}
    for reward in per_turn:
        assert reward.turn is not None
        values.setdefault(reward.turn, []).append(reward.value)
    return {turn: math.fsum(components) for turn, components in values.items()}


def _tools_by_turn(turns: list[TurnCompleted]) -> dict[int, list[JSON]]:
    """The tool schemas each turn's model was given: a turn records them only when they changed
    (None: as its parent turn's; none for a turn without a parent)."""
    by_turn: dict[int, list[JSON]] = {}
    for turn in turns:
        inherited = by_turn[turn.parent] if turn.parent >= 0 else []
        by_turn[turn.turn] = turn.tools if turn.tools is not None else inherited
    return by_turn


def _created_at(kept: _Kept, turns: list[TurnCompleted], rewards: list[RewardAssigned]) -> float:
    """The time of the result, from the events only: re-folding must give the same bytes."""
    if kept.closed is not None:
        return kept.closed.created_at
    times = [event.created_at for event in (*turns, *rewards)]
    if kept.opened is not None:
        times.append(kept.opened.created_at)
    return max(times, default=0.0)


def finish(state: SessionState, options: FoldOptions = FoldOptions()) -> FoldResult:
    """Fold the accumulated events into trajectories.

    Raises MissingTurns when turns 0..n-1 are not all present (n: the close's num_turns, else
    one past the highest turn seen), FoldError when a turn's delta does not fit its parent turn.
    A session with no close folds as status "open", with no final reward and nothing late.
    """
    kept = _resolve(state.log)
    if state.run is None or state.session is None:
        return FoldResult([], forks=0, late_events=0, duplicates=kept.duplicates)
    run, session, closed = state.run, state.session, kept.closed
    turns, late_turns = _turns_to_fold(run, session, kept.turns, closed)
    rewards = [r for r in kept.rewards.values() if not _is_late(r, closed, len(turns))]
    late_rewards = len(kept.rewards) - len(rewards)

    rebuilt = rebuild(run, session, turns)
    chains = split(rebuilt, options.per_turn)
    samples = chains.samples
    forks = len(chains.fork_turns)
    final_reward = _final_reward(closed, [r for r in rewards if r.turn is None])
    turn_rewards = _turn_rewards([r for r in rewards if r.turn is not None])
    opened = kept.opened
    base_metadata: JSON = dict(opened.metadata) if opened is not None else {}
    # segments: how many samples the session became, so a consumer (a GRPO batcher) knows
    # when it has all of them.
    base_metadata.update(
        model=opened.model if opened is not None else "", forks=forks, segments=len(samples)
    )
    created_at = _created_at(kept, turns, rewards)
    tools = _tools_by_turn(turns)
    agents = [agent_metadata(sample) for sample in samples]
    side_calls = sum(1 for agent in agents if agent.get("side"))
    if side_calls:  # so a batcher leaving them out knows how many rows a session has without
        base_metadata["side_calls"] = side_calls
    # "last": the sample that stands for the session (its last that is not a side request,
    # which training leaves out by default).
    rewarded = max(
        (i for i, agent in enumerate(agents) if not agent.get("side")), default=len(samples) - 1
    )

    def trajectory(index: int, sample: list[RebuiltTurn]) -> CompactTrajectory:
        tokens = sample_spans(sample)
        last = sample[-1]
        return CompactTrajectory(
            run=run,
            session=session,
            created_at=created_at,
            trajectory_id=f"{run}/{session}/{index}",
            group=opened.group if opened is not None and opened.group else session,
            segment=index,
            status=closed.status if closed is not None else "open",
            input_ids=tokens.input_ids,
            spans=tokens.spans,
            span_versions=tokens.span_versions,
            gen_logprobs=tokens.gen_logprobs,
            prompt_len=sample[0].prompt_len,
            turn_ends=tokens.turn_ends,
            turn_rewards=[turn_rewards.get(turn.event.turn) for turn in sample],
            reward=final_reward
            if index == rewarded or options.final_reward_scope == "all"
            else None,
            num_turns=len(sample),
            finish_reason=last.event.finish_reason,
            messages=last.conversation.all(),
            tools=tools[last.event.turn],
            images=list(last.images),
            metadata={
                **base_metadata,
                "first_turn": sample[0].event.turn,
                **tree_metadata(chains, sample),
                **agents[index],
                **temperatures(sample),
                **sampling(sample),
                **raw_logprobs(sample),
            },
            fold_version=FOLD_VERSION,
        )

    return FoldResult(
        [trajectory(index, sample) for index, sample in enumerate(samples)],
        forks=forks,
        late_events=late_turns + late_rewards,
        duplicates=kept.duplicates,
        turn_segments=chains.turn_samples,
        fork_turns=chains.fork_turns,
    )


def fold(events: Iterable[SessionEvent], options: FoldOptions = FoldOptions()) -> FoldResult:
    """All of one session's events, in any order and with any repeats, to its trajectories."""
    return finish(reduce(apply, events, initial()), options)
