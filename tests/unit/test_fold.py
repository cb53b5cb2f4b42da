"""The pure fold: table-driven cases, error cases, and hypothesis properties (DESIGN §5)."""

from __future__ import annotations

import dataclasses
import doctest
import importlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import consumers
from consumers import (
    FOLD_VERSION,
    ConsumerError,
    FoldError,
    FoldOptions,
    FoldResult,
    MissingTurns,
    apply,
    finish,
    fold,
    initial,
)
from schemas.codec import Codec
from schemas.errors import TurnstreamError
from schemas.events import (
    UNKNOWN_VERSION,
    RewardAssigned,
    SessionClosed,
    SessionEvent,
    SessionOpened,
    TrajectoryReady,
    TurnCompleted,
)
from tests.helpers.sessions import (
    RUN,
    SESSION,
    TurnSpec,
    append_only,
    closed,
    opened,
    reward,
    reward_events,
    session_events,
    turn_events,
    turn_specs,
)

CODEC = Codec()
PROPERTY = settings(max_examples=150, deadline=None)
ALL_OPTIONS = st.builds(
    FoldOptions, per_turn=st.booleans(), final_reward_scope=st.sampled_from(["last", "all"])
)


APPEND_5_IDS = [1, 2, 3, 1, 2, 101, 11, 12, 102, 21, 22, 103, 31, 32, 104, 41, 42]


def encoded(result: FoldResult) -> list[bytes]:
    return [CODEC.encode(trajectory) for trajectory in result.trajectories]


def plain(value: object) -> object:
    return value.tolist() if isinstance(value, np.ndarray) else value


def rewritten_at_3(kept: int = 5) -> list[TurnSpec]:
    """Turns 0-2 append-only; turn 3 keeps the first ``kept`` tokens of the history and replaces
    the rest by a summary; turn 4 extends turn 3. Turn 0's prompt is 3 tokens, so keeping 5
    keeps its reply (a fork) and keeping 0 starts a new conversation."""
    t3 = TurnSpec(
        prompt=[*APPEND_5_IDS[:kept], 7, 8, 9],
        completion=[31, 32],
        messages=[{"role": "user", "content": "summary"}],
        text="reply 3",
        weight_version=3,
    )
    t4 = TurnSpec(
        prompt=[*t3.context, 104],
        completion=[41, 42],
        messages=[*t3.messages, t3.assistant_message, {"role": "tool", "content": "obs 4"}],
        text="reply 4",
        weight_version=4,
    )
    return [*append_only(3), t3, t4]


SEGMENT_0_IDS = APPEND_5_IDS[:11]
SEGMENT_1_IDS = [1, 2, 3, 1, 2, 7, 8, 9, 31, 32, 104, 41, 42]


@dataclass(frozen=True)
class Case:
    name: str
    events: Sequence[SessionEvent]
    expect: list[dict[str, Any]]  # per trajectory, the fields to check
    options: FoldOptions = field(default_factory=FoldOptions)
    forks: int = 0
    late_events: int = 0
    duplicates: int = 0


CASES = [
    Case(
        "single turn",
        session_events(
            [
                TurnSpec(
                    prompt=[1, 2, 3],
                    completion=[4, 5],
                    logprobs=[-0.5, -0.25],
                    messages=[{"role": "user", "content": "hi"}],
                    text="hello",
                    weight_version=2,
                    finish_reason="length",
                )
            ],
            group="g",
            metadata={"task": "t"},
            final_reward=1.0,
            status="truncated",
            created_at=5.0,
        ),
        [
            {
                "trajectory_id": f"{RUN}/{SESSION}/0",
                "run": RUN,
                "session": SESSION,
                "group": "g",
                "segment": 0,
                "status": "truncated",
                "input_ids": [1, 2, 3, 4, 5],
                "loss_mask": [0, 0, 0, 1, 1],
                "logprobs": [0.0, 0.0, 0.0, -0.5, -0.25],
                "versions": [-1, -1, -1, 2, 2],
                "prompt_len": 3,
                "response_len": 2,
                "turn_ends": [5],
                "turn_rewards": [None],
                "reward": 1.0,
                "num_turns": 1,
                "finish_reason": "length",
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "hello"},
                ],
                "metadata": {
                    "task": "t",
                    "model": "tiny",
                    "forks": 0,
                    "segments": 1,
                    "first_turn": 0,
                },
                "fold_version": FOLD_VERSION,
                "created_at": 5.0,
            }
        ],
    ),
    Case(
        "5 turns append-only: one segment",
        session_events(append_only(5)),
        [
            {
                "trajectory_id": f"{RUN}/{SESSION}/0",
                "input_ids": APPEND_5_IDS,
                "loss_mask": [0, 0, 0, 1, 1] + [0, 1, 1] * 4,
                "versions": [-1, -1, -1, 0, 0, -1, 1, 1, -1, 2, 2, -1, 3, 3, -1, 4, 4],
                "prompt_len": 3,
                "turn_ends": [5, 8, 11, 14, 17],
                "turn_rewards": [None] * 5,
                "num_turns": 5,
                "group": SESSION,
                "status": "completed",
            }
        ],
    ),
    Case(
        "history rewritten at turn 3: a fork",
        session_events(rewritten_at_3()),
        [
            {
                "trajectory_id": f"{RUN}/{SESSION}/0",
                "segment": 0,
                "input_ids": SEGMENT_0_IDS,
                "prompt_len": 3,
                "turn_ends": [5, 8, 11],
                "num_turns": 3,
                "metadata": {"model": "tiny", "forks": 1, "segments": 2, "first_turn": 0},
            },
            {
                "trajectory_id": f"{RUN}/{SESSION}/1",
                "segment": 1,
                "input_ids": SEGMENT_1_IDS,
                "loss_mask": [0] * 8 + [1, 1, 0, 1, 1],
                "versions": [-1] * 8 + [3, 3, -1, 4, 4],
                "prompt_len": 8,
                "turn_ends": [10, 13],
                "num_turns": 2,
                "metadata": {
                    "model": "tiny",
                    "forks": 1,
                    "segments": 2,
                    "first_turn": 3,
                    "branch_of": {"turn": 2, "segment": 0, "shared_tokens": 5},
                },
            },
        ],
        forks=1,
    ),
    Case(
        "history replaced by a summary that keeps no reply: a new conversation, not a fork",
        session_events(rewritten_at_3(kept=3)),
        [
            {"segment": 0, "input_ids": SEGMENT_0_IDS, "num_turns": 3},
            {
                "segment": 1,
                "input_ids": [1, 2, 3, 7, 8, 9, 31, 32, 104, 41, 42],
                "prompt_len": 6,
                "metadata": {
                    "model": "tiny",
                    "forks": 0,
                    "segments": 2,
                    "first_turn": 3,
                    "branch_of": {"turn": 2, "segment": 0, "shared_tokens": 3},
                },
            },
        ],
    ),
    Case(
        "per_turn: one sample per turn",
        session_events(append_only(3)),
        [
            {
                "trajectory_id": f"{RUN}/{SESSION}/{t}",
                "input_ids": spec.context,
                "loss_mask": [0] * len(spec.prompt) + [1, 1],
                "prompt_len": len(spec.prompt),
                "turn_ends": [len(spec.context)],
                "num_turns": 1,
                "metadata": {"model": "tiny", "forks": 0, "segments": 3, "first_turn": t},
            }
            for t, spec in enumerate(append_only(3))
        ],
        options=FoldOptions(per_turn=True),
    ),
    Case(
        "per_turn counts forks the same way",
        session_events(rewritten_at_3()),
        [{"trajectory_id": f"{RUN}/{SESSION}/{t}", "num_turns": 1} for t in range(5)],
        options=FoldOptions(per_turn=True),
        forks=1,
    ),
    Case(
        "final reward on every segment (scope all)",
        session_events(rewritten_at_3(), final_reward=2.0),
        [{"reward": 2.0}, {"reward": 2.0}],
        forks=1,
    ),
    Case(
        "final reward on the last segment only (scope last)",
        session_events(rewritten_at_3(), final_reward=2.0),
        [{"reward": None}, {"reward": 2.0}],
        options=FoldOptions(final_reward_scope="last"),
        forks=1,
    ),
    Case(
        "per-turn rewards summed over keys, at their turns",
        session_events(
            append_only(5),
            rewards=[
                reward(0.5, turn=1, key="a"),
                reward(0.25, turn=1, key="b"),
                reward(1, turn=3),
            ],
        ),
        [{"turn_rewards": [None, 0.75, None, 1.0, None], "reward": None}],
    ),
    Case(
        "per-turn rewards follow their turn into its segment",
        session_events(
            rewritten_at_3(),
            rewards=[
                reward(0.5, turn=1, key="a"),
                reward(0.25, turn=1, key="b"),
                reward(1, turn=3),
            ],
        ),
        [{"turn_rewards": [None, 0.75, None]}, {"turn_rewards": [1.0, None]}],
        forks=1,
    ),
    Case(
        "keyed episode rewards are summed",
        session_events(append_only(2), rewards=[reward(1.0, key="a"), reward(2.0, key="b")]),
        [{"reward": 3.0, "turn_rewards": [None, None]}],
    ),
    Case(
        "the close's reward overrides keyed rewards",
        session_events(
            append_only(2), rewards=[reward(1.0, key="a"), reward(2.0, key="b")], final_reward=5.0
        ),
        [{"reward": 5.0}],
    ),
    Case(
        "turns at or after the close's num_turns are late",
        [
            opened(),
            *turn_events(append_only(4)),
            closed(num_turns=2, reward=1.0),
            reward(9.0, turn=3),  # names a late turn: late too
        ],
        [{"input_ids": append_only(2)[-1].context, "num_turns": 2, "turn_rewards": [None, None]}],
        late_events=3,
    ),
    Case(
        "rewards created after the close, or for no such turn, are late",
        [
            opened(),
            *turn_events(append_only(2)),
            closed(num_turns=2, created_at=10.0),
            reward(1.0, key="on-time", created_at=10.0),
            reward(7.0, key="after", created_at=10.5),
            reward(7.0, turn=1, key="after", created_at=11.0),
            reward(7.0, turn=2),
        ],
        [{"reward": 1.0, "turn_rewards": [None, None], "created_at": 10.0}],
        late_events=3,
    ),
    Case(
        "a turn that resends the whole history (prefix_len 0) still extends the segment",
        session_events([append_only(2)[0], dataclasses.replace(append_only(2)[1], prefix_len=0)]),
        [{"input_ids": append_only(2)[-1].context, "turn_ends": [5, 8], "num_turns": 2}],
    ),
    Case(
        "redelivered turn, reward and close are no-ops",
        [
            *session_events(append_only(2), rewards=[reward(1.0, turn=0)]),
            *turn_events(append_only(2))[1:],
            reward(1.0, turn=0),
            closed(num_turns=2),
            opened(),
        ],
        [{"input_ids": append_only(2)[-1].context, "turn_rewards": [1.0, None]}],
        duplicates=4,
    ),
    Case("a session without turns folds to nothing", [opened(), closed(num_turns=0)], []),
    Case(
        "without a close: status open, nothing late",
        [opened(created_at=1.0), *turn_events(append_only(2)), reward(3.0, created_at=4.0)],
        [{"status": "open", "reward": 3.0, "created_at": 4.0, "num_turns": 2}],
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_fold_cases(case: Case) -> None:
    result = fold(case.events, case.options)

    assert (result.forks, result.late_events, result.duplicates) == (
        case.forks,
        case.late_events,
        case.duplicates,
    )
    assert len(result.trajectories) == len(case.expect)
    for trajectory, expect in zip(result.trajectories, case.expect, strict=True):
        assert {name: plain(getattr(trajectory, name)) for name in expect} == expect


def bad_prefix(turn: int, prefix_len: int) -> list[SessionEvent]:
    turns = turn_events(append_only(4))
    turns[turn] = msgspec.structs.replace(turns[turn], prefix_len=prefix_len)
    return [opened(), *turns, closed(num_turns=4)]


def bad_message_prefix() -> list[SessionEvent]:
    turns = turn_events(append_only(2))
    turns[1] = msgspec.structs.replace(turns[1], message_prefix_len=3)
    return [opened(), *turns]


ERROR_CASES: list[tuple[str, list[SessionEvent], type[Exception], list[str]]] = [
    (
        "a gap at turn 2",
        [e for e in session_events(append_only(4)) if getattr(e, "turn", None) != 2],
        MissingTurns,
        [f"run={RUN} session={SESSION}", "missing turn(s) 2 of 0..3"],
    ),
    (
        "a gap without a close",
        [e for e in turn_events(append_only(5)) if e.turn not in (1, 2)],
        MissingTurns,
        ["missing turn(s) 1, 2 of 0..4", "turn 4 is present"],
    ),
    (
        "the close promises more turns than arrived",
        [*turn_events(append_only(2)), closed(num_turns=4)],
        MissingTurns,
        ["missing turn(s) 2, 3 of 0..3", "num_turns=4"],
    ),
    (
        "prefix_len past the previous context",
        bad_prefix(2, 99),
        FoldError,
        [f"run={RUN} session={SESSION} turn 2: prefix_len=99", "only 8 tokens"],
    ),
    ("turn 0 with a prefix", bad_prefix(0, 1), FoldError, ["turn 0: prefix_len=1"]),
    (
        "message_prefix_len past the previous conversation",
        bad_message_prefix(),
        FoldError,
        ["turn 1: message_prefix_len=3", "only 2 messages"],
    ),
    (
        "a negative num_turns in the close",
        [*turn_events(append_only(1)), closed(num_turns=-1)],
        FoldError,
        ["num_turns=-1", "negative"],
    ),
    (
        "a weight_version too large for int32",
        [
            *turn_events(append_only(1)),
            msgspec.structs.replace(turn_events(append_only(2))[1], weight_version=2**31),
        ],
        FoldError,
        ["turn 1: weight_version=2147483648"],
    ),
    (
        "events of two sessions",
        [*session_events(append_only(1)), opened(session="sess-2")],
        FoldError,
        [f"session={SESSION}", "session=sess-2"],
    ),
    (
        "events of two runs",
        [*session_events(append_only(1)), reward(1.0, run="run-2")],
        FoldError,
        [f"run={RUN}", "run=run-2"],
    ),
]


@pytest.mark.parametrize(
    ("events", "error", "fragments"),
    [case[1:] for case in ERROR_CASES],
    ids=[case[0] for case in ERROR_CASES],
)
def test_fold_errors(
    events: list[SessionEvent], error: type[Exception], fragments: list[str]
) -> None:
    with pytest.raises(error) as raised:
        fold(events)

    assert type(raised.value) is error
    for fragment in fragments:
        assert fragment in str(raised.value)


def test_missing_turns_carries_the_indices() -> None:
    with pytest.raises(MissingTurns) as raised:
        fold([*turn_events(append_only(1)), closed(num_turns=10**9)])

    assert raised.value.missing[:3] == (1, 2, 3)
    assert raised.value.count == 10**9 - 1  # listed lazily: a corrupt num_turns stays cheap
    assert "(999999999 in all)" in str(raised.value)


def test_a_trajectory_is_not_a_session_event() -> None:
    trajectory = fold(session_events(append_only(1))).trajectories[0]

    with pytest.raises(FoldError, match="cannot fold a TrajectoryReady"):
        apply(initial(), trajectory)  # type: ignore[arg-type]


def test_error_hierarchy() -> None:
    assert issubclass(MissingTurns, FoldError)
    assert issubclass(FoldError, ConsumerError)
    assert issubclass(ConsumerError, TurnstreamError)


def test_loss_mask_covers_exactly_the_completion_tokens() -> None:
    specs = append_only(5)
    [trajectory] = fold(session_events(specs)).trajectories

    assert int(trajectory.loss_mask.sum()) == sum(len(spec.completion) for spec in specs)
    generated = trajectory.loss_mask == 1
    assert np.array_equal(trajectory.input_ids[generated], [t for s in specs for t in s.completion])
    assert np.array_equal(
        trajectory.logprobs[generated],
        np.array([lp for s in specs for lp in s.completion_logprobs], dtype=np.float32),
    )
    assert np.array_equal(trajectory.versions[generated], [0, 0, 1, 1, 2, 2, 3, 3, 4, 4])
    assert set(trajectory.versions[~generated].tolist()) == {-1}
    assert set(trajectory.logprobs[~generated].tolist()) == {0.0}


def test_messages_are_the_full_conversation() -> None:
    specs = rewritten_at_3()
    result = fold(session_events(specs))

    for trajectory, last in zip(result.trajectories, (specs[2], specs[4]), strict=True):
        assert trajectory.messages == [*last.messages, last.assistant_message]


def test_differing_duplicates_keep_the_earliest_whatever_the_order() -> None:
    turns = turn_events(append_only(2))
    first = msgspec.structs.replace(turns[1], created_at=1.0)
    late_copy = msgspec.structs.replace(turns[1], created_at=2.0, text="late copy")
    for order in ([first, late_copy], [late_copy, first]):
        [trajectory] = fold([turns[0], *order]).trajectories
        assert trajectory.messages[-1]["content"] == "reply 1"


def test_differing_duplicates_at_one_time_are_broken_by_their_bytes() -> None:
    turns = turn_events(append_only(2))
    a = msgspec.structs.replace(turns[1], text="a")
    b = msgspec.structs.replace(turns[1], text="b")
    kept = a if CODEC.encode(a) < CODEC.encode(b) else b

    results = [fold([turns[0], *order]) for order in ([a, b], [b, a], [b, a, b])]

    assert {tuple(encoded(result)) for result in results} == {
        tuple(encoded(fold([turns[0], kept])))
    }
    assert [result.duplicates for result in results] == [1, 1, 2]


def test_apply_leaves_the_state_it_was_given() -> None:
    start = initial()
    after_open = apply(start, opened())
    after_turn = apply(after_open, turn_events(append_only(1))[0])

    assert start.run is None and start.opened is None and dict(start.turns) == {}
    assert dict(after_open.turns) == {}
    assert list(after_turn.turns) == [0]
    assert finish(initial()) == FoldResult(
        compact_trajectories=[], forks=0, late_events=0, duplicates=0
    )


def test_states_applied_to_twice_stay_apart() -> None:
    # apply shares the earlier state's events instead of copying them: two events applied to one
    # state must still give two states, each with only its own event.
    t0, t1 = turn_events(append_only(2))
    start = apply(initial(), opened())
    one, other = apply(start, t0), apply(start, t1)

    assert (list(one.turns), list(other.turns), list(start.turns)) == ([0], [1], [])
    assert apply(one, t0).duplicates == 1 and one.duplicates == 0
    assert encoded(finish(apply(one, t1))) == encoded(finish(apply(other, t0)))


def test_a_session_of_thousands_of_turns_folds_without_recursion() -> None:
    # States link each event to the ones before: nothing may walk that chain recursively.
    turns = 2_000
    events: list[SessionEvent] = [opened()]
    for t in range(turns):
        events.append(
            TurnCompleted(
                run=RUN, session=SESSION, turn=t, prefix_len=2 * t, prompt_ids=[t],
                completion_ids=[t], logprobs=[-0.5], message_prefix_len=2 * t,
                new_messages=[{"role": "tool", "content": str(t)}],
            )
        )  # fmt: skip
    state = initial()
    for event in [*events, closed(num_turns=turns), *events[1:]]:
        state = apply(state, event)
    [sample] = finish(state).trajectories

    assert sample.input_ids.tolist() == [t for t in range(turns) for _ in range(2)]
    assert len(sample.messages) == 2 * turns and state.duplicates == turns
    assert "SessionState(" in repr(state) and state == state


def test_fold_options_reject_an_unknown_scope() -> None:
    with pytest.raises(ValueError, match="final_reward_scope"):
        FoldOptions(final_reward_scope="first")  # type: ignore[arg-type]


def test_the_docstring_example_runs() -> None:
    # `consumers.fold` the attribute is the function (exported by the package), not the module.
    module = importlib.import_module("consumers.fold")
    outcome = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)

    assert outcome.attempted > 0
    assert outcome.failed == 0


def test_public_names() -> None:
    fold_names = {"FOLD_VERSION", "FoldError", "FoldOptions", "FoldResult", "MissingTurns"}
    assert fold_names | {"apply", "finish", "fold", "initial"} <= set(consumers.__all__)
    assert all(hasattr(consumers, name) for name in consumers.__all__)


# -- properties ------------------------------------------------------------------------------


def reference_samples(specs: Sequence[TurnSpec], per_turn: bool) -> list[dict[str, Any]]:
    """DESIGN §5 read literally, on Python lists: the fold must agree with it."""
    samples: list[dict[str, Any]] = []
    for spec in specs:
        prompt = list(spec.prompt)
        current = samples[-1] if samples else None
        if (
            current is None
            or per_turn
            or prompt[: len(current["input_ids"])] != current["input_ids"]
        ):
            current = {"input_ids": [], "loss_mask": [], "logprobs": [], "versions": []}
            current.update(prompt_len=len(prompt), turn_ends=[])
            samples.append(current)
        new = prompt[len(current["input_ids"]) :]
        current["input_ids"] += [*new, *spec.completion]
        current["loss_mask"] += [0] * len(new) + [1] * len(spec.completion)
        current["logprobs"] += [0.0] * len(new) + spec.completion_logprobs
        current["versions"] += [-1] * len(new) + [spec.weight_version] * len(spec.completion)
        current["turn_ends"].append(len(current["input_ids"]))
    return samples


def reference_forks(specs: Sequence[TurnSpec]) -> int:
    """Turns that start a new segment while keeping a token some earlier turn generated: each
    context position is marked generated or not, and a prompt keeps the marks of the positions
    it shares with the previous context."""
    forks = 0
    generated: list[bool] = []  # per position of the previous turn's full context
    for before, spec in itertools.pairwise(specs):
        generated = generated or [False] * len(before.prompt) + [True] * len(before.completion)
        prompt = list(spec.prompt)
        shared = 0
        while shared < min(len(prompt), len(before.context)) and (
            prompt[shared] == before.context[shared]
        ):
            shared += 1
        forks += prompt[: len(before.context)] != before.context and any(generated[:shared])
        generated = [
            *generated[:shared],
            *[False] * (len(prompt) - shared),
            *[True] * len(spec.completion),
        ]
    return forks


@st.composite
def sessions(draw: st.DrawFn) -> tuple[list[TurnSpec], list[SessionEvent]]:
    specs = draw(turn_specs())
    events = session_events(
        specs,
        rewards=draw(reward_events(len(specs))),
        close=draw(st.booleans()),
        status=draw(st.sampled_from(["completed", "aborted", "truncated", "timeout"])),
        final_reward=draw(st.none() | st.floats(-1.0, 1.0, width=32)),
        group=draw(st.none() | st.just("prompt-7")),
        created_at=100.0,
    )
    return specs, events


@PROPERTY
@given(st.data())
def test_duplication_and_reordering_do_not_change_the_fold(data: st.DataObject) -> None:
    _, events = data.draw(sessions())
    options = data.draw(ALL_OPTIONS)
    repeats = data.draw(st.lists(st.sampled_from(events), max_size=6))
    delivered = data.draw(st.permutations([*events, *repeats]))

    expected, got = fold(events, options), fold(delivered, options)

    assert encoded(got) == encoded(expected)
    assert (got.forks, got.late_events) == (expected.forks, expected.late_events)
    assert (expected.duplicates, got.duplicates) == (0, len(repeats))


def variant(event: SessionEvent, same_time: bool) -> SessionEvent:
    """Another event with the same identity: later, or at the same time with other bytes."""
    if not same_time:
        return msgspec.structs.replace(event, created_at=event.created_at + 1.0)
    if isinstance(event, TurnCompleted):
        return msgspec.structs.replace(event, text=event.text + "!")
    if isinstance(event, RewardAssigned):
        return msgspec.structs.replace(event, source="copy")
    if isinstance(event, SessionOpened):
        return msgspec.structs.replace(event, model="other")
    return msgspec.structs.replace(event, reward=(event.reward or 0.0) + 1.0)


@PROPERTY
@given(st.data())
def test_differing_duplicates_fold_the_same_in_any_order(data: st.DataObject) -> None:
    _, events = data.draw(sessions())
    options = data.draw(ALL_OPTIONS)
    copies = data.draw(st.lists(st.tuples(st.sampled_from(events), st.booleans()), max_size=6))
    delivered = [*events, *(variant(event, same_time) for event, same_time in copies)]
    one_order = data.draw(st.permutations(delivered))
    other_order = data.draw(st.permutations(delivered))

    first, second = fold(one_order, options), fold(other_order, options)

    assert encoded(first) == encoded(second)
    assert (first.forks, first.late_events, first.duplicates) == (
        second.forks,
        second.late_events,
        second.duplicates,
    )
    if not any(same_time for _, same_time in copies):  # later copies never win
        assert encoded(first) == encoded(fold(events, options))


@PROPERTY
@given(sessions(), ALL_OPTIONS)
def test_every_array_has_one_entry_per_token(
    session: tuple[list[TurnSpec], list[SessionEvent]], options: FoldOptions
) -> None:
    specs, events = session
    result = fold(events, options)

    assert sum(t.num_turns for t in result.trajectories) == len(specs)
    for trajectory in result.trajectories:
        n = len(trajectory.input_ids)
        assert (
            n == len(trajectory.loss_mask) == len(trajectory.logprobs) == len(trajectory.versions)
        )
        assert len(trajectory.turn_ends) == trajectory.num_turns == len(trajectory.turn_rewards)
        assert trajectory.turn_ends[-1] == n
        assert 0 <= trajectory.prompt_len <= trajectory.turn_ends[0]


@PROPERTY
@given(sessions(), ALL_OPTIONS)
def test_folding_twice_and_through_the_codec_gives_identical_bytes(
    session: tuple[list[TurnSpec], list[SessionEvent]], options: FoldOptions
) -> None:
    _, events = session
    decoded: list[Any] = [CODEC.decode(CODEC.encode(event)) for event in events]

    once = encoded(fold(events, options))

    assert encoded(fold(events, options)) == once
    assert encoded(fold(decoded, options)) == once
    assert [CODEC.encode(CODEC.decode(data)) for data in once] == once


@PROPERTY
@given(turn_specs(rewrites=False))
def test_without_forks_the_sample_is_the_last_full_context(specs: list[TurnSpec]) -> None:
    result = fold(session_events(specs))

    assert result.forks == 0
    [trajectory] = result.trajectories
    assert trajectory.input_ids.tolist() == [*specs[-1].prompt, *specs[-1].completion]
    assert trajectory.messages == [*specs[-1].messages, specs[-1].assistant_message]
    assert trajectory.prompt_len == len(specs[0].prompt)


@PROPERTY
@given(turn_specs(), st.booleans())
def test_the_fold_agrees_with_the_design_read_literally(
    specs: list[TurnSpec], per_turn: bool
) -> None:
    result = fold(session_events(specs), FoldOptions(per_turn=per_turn))

    assert result.forks == reference_forks(specs)
    got = [
        {
            "input_ids": t.input_ids.tolist(),
            "loss_mask": t.loss_mask.tolist(),
            "logprobs": t.logprobs.tolist(),
            "versions": t.versions.tolist(),
            "prompt_len": t.prompt_len,
            "turn_ends": t.turn_ends.tolist(),
        }
        for t in result.trajectories
    ]
    want = reference_samples(specs, per_turn)
    for sample in want:  # the events carry float32 logprobs
        sample["logprobs"] = np.array(sample["logprobs"], dtype=np.float32).tolist()
    assert got == want


def test_trajectory_arrays_have_the_wire_dtypes() -> None:
    [trajectory] = fold(session_events(append_only(2))).trajectories

    assert isinstance(trajectory, TrajectoryReady)
    dtypes = [
        trajectory.input_ids.dtype,
        trajectory.loss_mask.dtype,
        trajectory.logprobs.dtype,
        trajectory.versions.dtype,
        trajectory.turn_ends.dtype,
    ]
    assert dtypes == [np.int32, np.int8, np.float32, np.int32, np.int32]


def test_each_sample_carries_the_tool_schemas_its_last_turn_was_given() -> None:
    # A turn records its tools only when they changed: None means "as the turn before".
    search = {"type": "function", "function": {"name": "search", "parameters": {}}}
    t0 = TurnCompleted(run="r", session="s", turn=0, prompt_ids=[1], completion_ids=[2],
                       logprobs=[-0.1], tools=[search])  # fmt: skip
    t1 = TurnCompleted(run="r", session="s", turn=1, prefix_len=2, prompt_ids=[3],
                       completion_ids=[4], logprobs=[-0.2])  # fmt: skip
    t2 = TurnCompleted(run="r", session="s", turn=2, prefix_len=4, prompt_ids=[5],
                       completion_ids=[6], logprobs=[-0.3], tools=[])  # fmt: skip
    close = SessionClosed(run="r", session="s", num_turns=3)

    [whole] = fold([t0, t1]).trajectories
    assert whole.tools == [search]
    per_turn = fold([t2, t1, t0, close], FoldOptions(per_turn=True)).trajectories
    assert [t.tools for t in per_turn] == [[search], [search], []]


def test_a_sample_holding_a_raw_turn_says_so_and_no_other_does() -> None:
    """Issue 19: a turn recorded with the model's raw log-probs (``logprobs_kind: "raw"``, the
    gateway's --allow-raw-logprobs) marks every sample it is part of; samples without one carry
    no new key, so they fold to the bytes they always did."""
    specs = append_only(3)
    raw_middle = [
        dataclasses.replace(spec, extra={"logprobs_kind": "raw"}) if i == 1 else spec
        for i, spec in enumerate(specs)
    ]
    [whole] = fold(session_events(raw_middle)).trajectories
    assert whole.metadata["logprobs_kind"] == "raw"
    per_turn = fold(session_events(raw_middle), FoldOptions(per_turn=True)).trajectories
    assert [t.metadata.get("logprobs_kind") for t in per_turn] == [None, "raw", None]

    explicit = [dataclasses.replace(s, extra={"logprobs_kind": "sampled"}) for s in specs]
    [plain] = fold(session_events(specs)).trajectories
    [sampled] = fold(session_events(explicit)).trajectories
    assert "logprobs_kind" not in plain.metadata
    assert CODEC.encode(sampled) == CODEC.encode(plain)


# -- per-token versions (issue 37) ---------------------------------------------------------------


def test_a_turn_continued_across_a_weight_update_folds_one_span_per_version() -> None:
    """A generation aborted for a weight update and continued carries each token's version
    (``version_spans``): the fold splits its generated tokens into one span per version, and
    a token whose version is unknown gets UNKNOWN_VERSION (-2); an older turn without the field
    folds as before, at its weight_version."""
    first = TurnSpec(prompt=[1, 2, 3], completion=[4, 5], weight_version=2)
    second = TurnSpec(
        prompt=[1, 2, 3, 4, 5, 6],
        completion=[7, 8, 9, 10, 11],
        weight_version=2,
        extra={"version_spans": [(2, 2), (3, 1), (None, 2)]},
    )
    result = fold([*session_events([first, second])])
    (sample,) = result.trajectories
    generated = sample.loss_mask == 1
    assert sample.versions[generated].tolist() == [2, 2, 2, 2, 3, -2, -2]
    assert sample.versions[~generated].tolist() == [-1] * 4
    assert sample.min_weight_version == UNKNOWN_VERSION and sample.fold_version == FOLD_VERSION
    # The wire form keeps it: spans split at each version, decoded back the same.
    compact = sample.compact()
    assert compact.span_versions is not None
    assert compact.span_versions.tolist() == [2, 2, 3, -2]  # turn 0's span, then turn 1's three
    assert compact.expand().versions.tolist() == sample.versions.tolist()


@pytest.mark.parametrize(
    ("spans", "problem"),
    [
        ([(2, 2), (3, 2)], "cover 4 tokens, the completion has 5"),
        ([(2, 0), (3, 5)], "a count is at least 1"),
        ([(-2, 5)], "non-negative int32 or null"),
    ],
)
def test_version_spans_that_do_not_fit_the_completion_are_refused(
    spans: list[tuple[int | None, int]], problem: str
) -> None:
    spec = TurnSpec(prompt=[1], completion=[4, 5, 6, 7, 8], extra={"version_spans": spans})
    with pytest.raises(ValueError, match=problem):
        turn_events([spec])


def test_each_turns_sampling_is_in_the_metadata_from_fold_v7() -> None:
    """Issue 38: a trainer recomputes each token's distribution from its turn's temperature and
    top_p, so the fold records them per turn (and top_k / min_p at their neutral values)."""
    recorded = [
        {"temperature": 0.7, "top_p": 0.9, "max_tokens": 16},
        {"temperature": 0.0, "top_p": 1.0},  # greedy
        {"temperature": 1.0},  # before top_p was recorded: the API's default
    ]
    events = [
        msgspec.structs.replace(e, sampling=recorded[e.turn]) if isinstance(e, TurnCompleted) else e
        for e in session_events(append_only(3))
    ]
    [sample] = fold(events).trajectories
    assert sample.fold_version == FOLD_VERSION >= 7
    assert sample.metadata["sampling"] == [
        {"temperature": 0.7, "top_p": 0.9, "top_k": 0, "min_p": 0.0},
        {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0},
        {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0},
    ]
    assert sample.metadata["temperatures"] == [0.0, 0.7, 1.0]  # for readers of older rows
    per_turn = fold(events, FoldOptions(per_turn=True)).trajectories
    assert [t.metadata["sampling"][0]["temperature"] for t in per_turn] == [0.7, 0.0, 1.0]
    # Events that recorded no sampling say nothing: left to the trainer's setting, as before.
    [unrecorded] = fold(session_events(append_only(3))).trajectories
    assert "sampling" not in unrecorded.metadata and "temperatures" not in unrecorded.metadata
