"""Batching policies: count, token budget, GRPO groups with timeout, staleness, duplicates."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from consumers import fold
from schemas.events import TrajectoryReady
from tests.helpers.sessions import TurnSpec, session_events
from trainer_sink.batching import Batcher, Decision, Sample
from trainer_sink.config import BatchingSettings


def trajectory(
    session: str,
    *,
    group: str = "g",
    run: str = "r",
    segment: int = 0,
    length: int = 4,
    reward: float | None = 1.0,
    version: int = 0,
    metadata: dict[str, Any] | None = None,
) -> TrajectoryReady:
    """A sample of ``length`` tokens: the first half prompt, the rest generated at ``version``."""
    prompt_len = length // 2
    generated = length - prompt_len
    return TrajectoryReady(
        run=run,
        session=session,
        trajectory_id=f"{run}/{session}/{segment}",
        group=group,
        segment=segment,
        status="completed",
        input_ids=np.arange(length, dtype=np.int32),
        loss_mask=np.array([0] * prompt_len + [1] * generated, dtype=np.int8),
        logprobs=np.array([0.0] * prompt_len + [-0.5] * generated, dtype=np.float32),
        versions=np.array([-1] * prompt_len + [version] * generated, dtype=np.int32),
        prompt_len=prompt_len,
        turn_ends=np.array([length], dtype=np.int32),
        turn_rewards=[None],
        reward=reward,
        num_turns=1,
        finish_reason="stop",
        messages=[],
        metadata={"forks": 0} if metadata is None else metadata,
        fold_version=1,
    )


def sample(session: str, **kwargs: Any) -> Sample[str]:
    built = trajectory(session, **kwargs)
    return Sample(built, handle=f"msg:{built.trajectory_id}")


def sessions(batch: list[Sample[str]]) -> list[str]:
    return [s.trajectory.session for s in batch]


def ids(batch: list[Sample[str]]) -> list[str]:
    return [s.trajectory.trajectory_id for s in batch]


def deadline(batcher: Batcher[str]) -> float | None:
    return batcher.deadline  # read through a call: each read is fresh (for mypy's narrowing)


def drops(decision: Decision[str]) -> list[tuple[str, str]]:
    return [(d.sample.trajectory.trajectory_id, d.reason) for d in decision.dropped]


def feed(batcher: Batcher[str], samples: list[Sample[str]], now: float = 0.0) -> Decision[str]:
    """Add all at ``now``; the union of the decisions."""
    out: Decision[str] = Decision()
    for item in samples:
        decision = batcher.add(item, now)
        out.batches.extend(decision.batches)
        out.dropped.extend(decision.dropped)
    return out


GROUPS = BatchingSettings(policy="groups", group_size=3, batch_size=1, group_timeout_s=300)


# -- count


@pytest.mark.parametrize(
    ("count", "batch_size", "batched", "flushed"),
    [
        (6, 3, [3, 3], []),
        (7, 3, [3, 3], [1]),
        (2, 3, [], [2]),
        (3, 1, [1, 1, 1], []),
        (0, 2, [], []),
    ],
)
def test_count_batches_in_arrival_order(
    count: int, batch_size: int, batched: list[int], flushed: list[int]
) -> None:
    batcher = Batcher[str](BatchingSettings(policy="count", batch_size=batch_size))
    items = [sample(f"s{i}") for i in range(count)]
    decision = feed(batcher, items)
    end = batcher.flush(now=1.0)
    assert [len(b) for b in decision.batches] == batched
    assert [len(b) for b in end.batches] == flushed
    assert [s.handle for b in decision.batches + end.batches for s in b] == [
        s.handle for s in items
    ]
    assert batcher.pending == 0 and batcher.stats.samples == count


# -- token budget


def test_token_batches_close_when_the_next_would_not_fit_or_exactly_full() -> None:
    batcher = Batcher[str](BatchingSettings(policy="tokens", token_budget=9))
    lengths = [3, 3, 3, 5, 9, 10, 2, 1]
    decision = feed(batcher, [sample(f"s{i}", length=n) for i, n in enumerate(lengths)])
    end = batcher.flush(now=0.0)
    assert [sessions(b) for b in decision.batches] == [["s0", "s1", "s2"], ["s3"], ["s4"]]
    assert [sessions(b) for b in end.batches] == [["s6", "s7"]]
    assert drops(decision) == [("r/s5/0", "over_budget")]  # 10 tokens never fit in 9
    assert batcher.stats.dropped == Counter(over_budget=1)


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), max_size=40),
    budget=st.integers(1, 64),
)
def test_token_batches_never_exceed_the_budget(lengths: list[int], budget: int) -> None:
    batcher = Batcher[str](BatchingSettings(policy="tokens", token_budget=budget))
    items = [sample(f"s{i}", length=n) for i, n in enumerate(lengths)]
    decision = feed(batcher, items)
    end = batcher.flush(now=0.0)
    batches = decision.batches + end.batches
    totals = [sum(len(s.trajectory.input_ids) for s in b) for b in batches]
    assert all(0 < total <= budget for total in totals)
    # Nothing lost, nothing reordered: over-budget samples dropped, all others batched in order.
    fits = [n <= budget for n in lengths]
    kept = [s.handle for s, f in zip(items, fits, strict=True) if f]
    assert [s.handle for b in batches for s in b] == kept
    too_long = [s.trajectory.trajectory_id for s, f in zip(items, fits, strict=True) if not f]
    assert drops(decision) == [(i, "over_budget") for i in too_long]
    # Greedy: a batch was closed only because its successor's first sample did not fit.
    for total, successor in zip(totals, batches[1:], strict=False):
        assert total + len(successor[0].trajectory.input_ids) > budget


# -- GRPO groups


def test_a_batch_is_batch_size_complete_groups_each_together_in_arrival_order() -> None:
    batcher = Batcher[str](GROUPS.model_copy(update={"group_size": 2, "batch_size": 2}))
    arrivals = [sample("a1", group="A"), sample("b1", group="B"), sample("b2", group="B")]
    assert feed(batcher, arrivals).batches == []  # B complete, waits for a second group
    [batch] = batcher.add(sample("a2", group="A"), now=1.0).batches
    assert sessions(batch) == ["b1", "b2", "a1", "a2"]  # groups in completion order
    assert batcher.stats.groups == 2 and batcher.stats.batches == 1


@pytest.mark.parametrize("rule", ["drop", "release"])
def test_a_group_missing_a_member_is_handled_at_its_timeout(rule: str) -> None:
    batcher = Batcher[str](GROUPS.model_copy(update={"incomplete_groups": rule}))
    assert feed(batcher, [sample("a")], now=10.0).batches == []
    assert feed(batcher, [sample("b")], now=200.0).batches == []
    assert deadline(batcher) == 310.0  # from the first member's arrival, not the last
    before = batcher.tick(now=309.9)
    assert before.batches == [] and before.dropped == [] and batcher.pending == 2
    at = batcher.tick(now=310.0)
    if rule == "drop":
        assert at.batches == []
        assert drops(at) == [("r/a/0", "incomplete_group"), ("r/b/0", "incomplete_group")]
        assert batcher.stats.dropped == Counter(incomplete_group=2)
        assert batcher.stats.dropped_groups == Counter(incomplete_group=1)
    else:
        assert [sessions(b) for b in at.batches] == [["a", "b"]] and at.dropped == []
        assert batcher.stats.incomplete_groups_released == 1 and batcher.stats.groups == 1
    assert batcher.pending == 0 and deadline(batcher) is None
    # The missing member, arriving after all, starts a new group: it does not rejoin the old one.
    late = batcher.add(sample("c"), now=311.0)
    assert late.batches == [] and late.dropped == [] and deadline(batcher) == 611.0


def test_an_arrival_times_out_due_groups_before_it_is_taken() -> None:
    batcher = Batcher[str](GROUPS)
    batcher.add(sample("a", group="old"), now=0.0)
    decision = batcher.add(sample("x", group="new"), now=400.0)
    assert drops(decision) == [("r/a/0", "incomplete_group")]
    assert batcher.pending == 1


def test_sessions_of_several_segments_count_once_and_travel_whole() -> None:
    batcher = Batcher[str](GROUPS.model_copy(update={"group_size": 2}))
    forked = {"forks": 1}  # the fold cut session a into 2 samples
    decision = feed(
        batcher,
        [
            sample("a", segment=0, metadata=forked),
            sample("b"),
            sample("a", segment=1, metadata=forked),
        ],
    )
    [batch] = decision.batches
    assert ids(batch) == ["r/a/0", "r/b/0", "r/a/1"]
    # A segment arriving after its group left (a per-turn fold under-announces) is dropped.
    late = batcher.add(sample("b", segment=1), now=1.0)
    assert drops(late) == [("r/b/1", "late_member")]


def test_a_folded_session_with_a_fork_fills_its_group_only_when_both_segments_arrive() -> None:
    rewrite = [
        TurnSpec(prompt=[1, 2, 3], completion=[4, 5]),
        TurnSpec(prompt=[7], completion=[8]),  # does not extend [1, 2, 3, 4, 5]: a fork
    ]
    events = session_events(rewrite, session="forked", group="p", final_reward=1.0)
    first, second = fold(events).trajectories
    assert first.expected_segments == second.expected_segments == 2
    batcher = Batcher[str](GROUPS.model_copy(update={"group_size": 2}))
    other = sample("other", run="run-1", group="p", reward=0.0)
    decision = feed(batcher, [Sample(first, "m1"), other])
    assert decision.batches == []
    [batch] = batcher.add(Sample(second, "m2"), now=0.0).batches
    assert sessions(batch) == ["forked", "other", "forked"]


def test_sessions_beyond_group_size_start_the_next_group_of_that_key() -> None:
    batcher = Batcher[str](GROUPS.model_copy(update={"group_size": 2}))
    decision = feed(batcher, [sample(s) for s in "abcd"])
    assert [sessions(b) for b in decision.batches] == [["a", "b"], ["c", "d"]]


def test_groups_are_keyed_by_run_and_group() -> None:
    batcher = Batcher[str](GROUPS.model_copy(update={"group_size": 2}))
    decision = feed(batcher, [sample("a", run="r1"), sample("b", run="r2"), sample("c", run="r1")])
    assert [sessions(b) for b in decision.batches] == [["a", "c"]]


def uids(batch: list[Sample[str]]) -> list[str]:
    return [s.uid for s in batch]


@pytest.mark.parametrize("policy", ["groups", "count", "tokens"])
def test_each_group_instance_has_its_own_uid_across_runs_and_reused_keys(policy: str) -> None:
    """Two runs name their groups alike, and one run sends prompt g again (a later epoch): three
    instances of two sessions each, three uids, in every policy."""
    settings = GROUPS.model_copy(
        update={"policy": policy, "group_size": 2, "batch_size": 4, "token_budget": 16}
    )
    arrivals = [
        sample("a", run="r1"),
        sample("b", run="r2"),
        sample("c", run="r1"),
        sample("d", run="r2"),
        sample("e", run="r1"),  # g again in r1: the first instance of (r1, g) is full
        sample("f", run="r1"),
    ]

    def released() -> list[tuple[str, str]]:
        batcher = Batcher[str](settings)
        batches = feed(batcher, arrivals).batches + batcher.flush(now=1.0).batches
        return [(s.trajectory.session, s.uid) for b in batches for s in b]

    assert dict(released()) == {
        "a": "r1/g/a.0",
        "c": "r1/g/a.0",
        "b": "r2/g/b.0",
        "d": "r2/g/b.0",
        "e": "r1/g/e.0",
        "f": "r1/g/e.0",
    }
    # Deterministic for a given order: another batcher (a restarted sink) names them alike.
    assert released() == released()


def test_a_sessions_segments_share_its_instance_uid_in_count_batches() -> None:
    batcher = Batcher[str](BatchingSettings(policy="count", batch_size=3, group_size=2))
    two = {"segments": 2}
    decision = feed(
        batcher,
        [sample("a", segment=1, metadata=two), sample("b"), sample("a", segment=0, metadata=two)],
    )
    [batch] = decision.batches
    assert uids(batch) == ["r/g/a.1"] * 3


def test_after_a_restart_the_remaining_sessions_form_new_instances() -> None:
    """A sink that committed the first instance of g and restarted sees only the sessions
    that were not committed: its instances are named after other first members."""
    settings = GROUPS.model_copy(update={"group_size": 2, "batch_size": 1})
    first = Batcher[str](settings)
    [committed] = feed(first, [sample("a"), sample("b")]).batches
    restarted = Batcher[str](settings)
    [later] = feed(restarted, [sample("c"), sample("d")]).batches
    assert set(uids(committed)) == {"r/g/a.0"} and set(uids(later)) == {"r/g/c.0"}


@pytest.mark.parametrize(
    ("rewards", "dropped"),
    [
        ([1.0, 1.0, 1.0], True),
        ([0.0, 0.0, 0.0], True),
        ([1.0, 0.0, 1.0], False),
        ([None, 0.0, None], True),  # a missing reward counts as 0.0, as in rm_scores
        ([None, 1.0, None], False),
    ],
)
def test_groups_with_equal_rewards_are_dropped_when_asked(
    rewards: list[float | None], dropped: bool
) -> None:
    for drop_uniform in (True, False):
        batcher = Batcher[str](GROUPS.model_copy(update={"drop_uniform_groups": drop_uniform}))
        decision = feed(batcher, [sample(f"s{i}", reward=r) for i, r in enumerate(rewards)])
        if dropped and drop_uniform:
            assert decision.batches == []
            assert {reason for _, reason in drops(decision)} == {"uniform_group"}
            assert batcher.stats.dropped_groups == Counter(uniform_group=1)
        else:
            assert [len(b) for b in decision.batches] == [3] and decision.dropped == []


def test_a_session_reward_is_read_from_whichever_segment_carries_it() -> None:
    # final_reward_scope="last": only a session's last segment has the reward.
    batcher = Batcher[str](GROUPS.model_copy(update={"group_size": 2, "drop_uniform_groups": True}))
    forked = {"forks": 1}
    decision = feed(
        batcher,
        [
            sample("a", segment=0, reward=None, metadata=forked),
            sample("a", segment=1, reward=1.0, metadata=forked),
            sample("b", reward=1.0),
        ],
    )
    assert drops(decision) == [(i, "uniform_group") for i in ("r/a/0", "r/a/1", "r/b/0")]


# -- staleness


@pytest.mark.parametrize(
    ("generated_at", "trainer", "stale"),
    [
        (3, 5, False),  # 2 behind: at the bound
        (2, 5, True),  # 3 behind
        (2, None, False),  # the trainer's version not known yet
        (-1, 5, False),  # generated tokens without a version
        (-2, 5, True),  # a token of unknown version (issue 37): it cannot be bounded
        (-2, None, True),  # ... whatever the trainer's version
    ],
)
@pytest.mark.parametrize("policy", ["count", "tokens"])
def test_stale_samples_are_dropped_or_flagged_on_arrival(
    generated_at: int, trainer: int | None, stale: bool, policy: str
) -> None:
    base = BatchingSettings(policy=policy, batch_size=1, token_budget=4, max_staleness=2)
    for rule in ("drop", "flag"):
        batcher = Batcher[str](base.model_copy(update={"stale": rule}))
        batcher.trainer_version = trainer
        decision = batcher.add(sample("a", version=generated_at), now=0.0)
        if stale and rule == "drop":
            assert decision.batches == [] and drops(decision) == [("r/a/0", "stale")]
            assert batcher.stats.dropped == Counter(stale=1)
        else:
            [[released]] = decision.batches
            assert released.stale is stale
            assert batcher.stats.flagged_stale == int(stale)


def test_the_oldest_generated_token_decides_staleness() -> None:
    built = trajectory("a", length=4, version=5)
    built.versions[2] = 1  # one early turn generated under version 1
    assert built.min_weight_version == 1
    batcher = Batcher[str](BatchingSettings(policy="count", batch_size=1, max_staleness=2))
    batcher.trainer_version = 5
    assert drops(batcher.add(Sample(built, "m"), now=0.0)) == [("r/a/0", "stale")]


def test_a_group_is_judged_stale_when_ready_and_dropped_whole() -> None:
    batcher = Batcher[str](GROUPS.model_copy(update={"group_size": 2, "max_staleness": 1}))
    batcher.trainer_version = 0
    batcher.add(sample("a", version=0), now=0.0)
    batcher.trainer_version = 2  # the trainer moved on while the group waited
    decision = batcher.add(sample("b", version=2), now=1.0)
    assert drops(decision) == [("r/a/0", "stale"), ("r/b/0", "stale")]
    assert batcher.stats.dropped_groups == Counter(stale=1)


def test_flagged_groups_flag_only_their_stale_samples() -> None:
    update = {"group_size": 2, "max_staleness": 1, "stale": "flag"}
    batcher = Batcher[str](GROUPS.model_copy(update=update))
    batcher.trainer_version = 2
    [batch] = feed(batcher, [sample("a", version=0), sample("b", version=2)]).batches
    assert [s.stale for s in batch] == [True, False]
    assert batcher.stats.flagged_stale == 1


# -- duplicates


@pytest.mark.parametrize("policy", ["count", "groups"])
def test_a_redelivered_trajectory_is_dropped_while_pending_and_after_release(policy: str) -> None:
    # count: 2 samples a batch; groups: 1 group of 2 a batch
    update = {"policy": policy, "batch_size": 2 if policy == "count" else 1, "group_size": 2}
    batcher = Batcher[str](GROUPS.model_copy(update=update))
    pending = feed(batcher, [sample("a"), sample("a")])
    assert drops(pending) == [("r/a/0", "duplicate")] and batcher.pending == 1
    [batch] = batcher.add(sample("b"), now=0.0).batches
    assert sessions(batch) == ["a", "b"]
    after = feed(batcher, [sample("b"), sample("a")])
    assert after.batches == [] and drops(after) == [("r/b/0", "duplicate"), ("r/a/0", "duplicate")]
    assert batcher.stats.dropped == Counter(duplicate=3) and batcher.pending == 0


def test_the_memory_of_released_ids_is_bounded_by_dedup_window() -> None:
    batcher = Batcher[str](BatchingSettings(policy="count", batch_size=1, dedup_window=2))
    feed(batcher, [sample(s) for s in "abc"])  # a is forgotten: only b and c are remembered
    assert drops(feed(batcher, [sample("b")])) == [("r/b/0", "duplicate")]
    assert [sessions(b) for b in feed(batcher, [sample("a")]).batches] == [["a"]]


def test_held_ids_are_known_beyond_dedup_window() -> None:
    batcher = Batcher[str](GROUPS.model_copy(update={"dedup_window": 1}))
    others = [sample(f"s{i}", group=f"x{i // 3}") for i in range(6)]
    assert len(feed(batcher, [sample("held"), *others]).batches) == 2  # 6 ids through a window of 1
    assert drops(batcher.add(sample("held"), now=1.0)) == [("r/held/0", "duplicate")]


def test_forget_lets_a_handed_back_batch_come_again() -> None:
    batcher = Batcher[str](GROUPS.model_copy(update={"group_size": 2}))
    [batch] = feed(batcher, [sample("a"), sample("b")]).batches
    batcher.forget(batch)
    assert [sessions(b) for b in feed(batcher, batch).batches] == [["a", "b"]]


# -- flush


@pytest.mark.parametrize(
    ("rule", "released"), [("drop", [["a", "b"]]), ("release", [["a", "b"], ["c"]])]
)
def test_flush_releases_partial_batches_and_settles_incomplete_groups(
    rule: str, released: list[list[str]]
) -> None:
    update = {"group_size": 2, "batch_size": 3, "incomplete_groups": rule}
    batcher = Batcher[str](GROUPS.model_copy(update=update))
    assert feed(batcher, [sample("a"), sample("b"), sample("c", group="h")]).batches == []
    end = batcher.flush(now=1.0)
    assert [sessions(b) for b in end.batches] == [[s for group in released for s in group]]
    assert drops(end) == ([("r/c/0", "incomplete_group")] if rule == "drop" else [])
    assert batcher.pending == 0 and batcher.deadline is None
    assert batcher.flush(now=2.0) == Decision()


# -- every sample accounted for


@st.composite
def arrivals(draw: st.DrawFn) -> list[tuple[float, Sample[str]]]:
    """Sessions of a few groups, some never arriving, some redelivered, at rising times."""
    items: list[Sample[str]] = []
    for g in range(draw(st.integers(1, 5))):
        for s in range(draw(st.integers(0, 3))):  # at most one group per key here
            segments = draw(st.integers(1, 2))
            reward = draw(st.sampled_from([0.0, 1.0]))
            items += [
                sample(f"g{g}s{s}", group=f"g{g}", segment=k, reward=reward,
                       metadata={"forks": segments - 1})
                for k in range(segments)
            ]  # fmt: skip
    items = draw(st.permutations(items))
    items += draw(st.lists(st.sampled_from(items), max_size=4)) if items else []
    gaps = draw(st.lists(st.sampled_from([0.0, 1.0, 150.0]), min_size=len(items)))
    times = [sum(gaps[: i + 1]) for i in range(len(items))]
    return list(zip(times, items, strict=False))


@settings(max_examples=150, deadline=None)
@given(
    timeline=arrivals(),
    rule=st.sampled_from(["drop", "release"]),
    uniform=st.booleans(),
    batch_size=st.integers(1, 3),
)
def test_every_sample_is_batched_once_or_dropped_and_groups_never_overfill(
    timeline: list[tuple[float, Sample[str]]], rule: str, uniform: bool, batch_size: int
) -> None:
    update = {
        "group_size": 3,
        "batch_size": batch_size,
        "incomplete_groups": rule,
        "drop_uniform_groups": uniform,
    }
    batcher = Batcher[str](GROUPS.model_copy(update=update))
    out: Decision[str] = Decision()
    for now, item in timeline:
        decision = batcher.add(item, now)
        out.batches.extend(decision.batches)
        out.dropped.extend(decision.dropped)
    end = batcher.flush(now=timeline[-1][0] if timeline else 0.0)
    batches, dropped = out.batches + end.batches, out.dropped + end.dropped

    released = [s.trajectory.trajectory_id for b in batches for s in b]
    kept_out = [d.sample.trajectory.trajectory_id for d in dropped if d.reason != "duplicate"]
    distinct = {item.trajectory.trajectory_id for _, item in timeline}
    assert len(released) == len(set(released))  # never twice
    assert sorted(released + kept_out) == sorted(distinct)  # each once: batched or dropped
    assert sum(d.reason == "duplicate" for d in dropped) == len(timeline) - len(distinct)
    assert batcher.pending == 0
    position: dict[str, int] = {}
    for i, (_, item) in enumerate(timeline):
        # a redelivery is dropped: the first arrival counts
        position.setdefault(item.trajectory.trajectory_id, i)
    uids: set[str] = set()
    for batch in batches:
        chunks: dict[str, list[Sample[str]]] = {}
        for s in batch:
            chunks.setdefault(s.uid, []).append(s)
        assert not uids & chunks.keys()  # an instance is released once
        uids |= chunks.keys()
        for chunk in chunks.values():
            assert len({s.trajectory.group for s in chunk}) == 1
            members = {s.trajectory.session for s in chunk}
            assert len(members) <= 3
            if rule == "drop":
                assert len(members) == 3
            if uniform:
                assert len({s.trajectory.reward for s in chunk}) > 1
            order = [position[s.trajectory.trajectory_id] for s in chunk]
            assert order == sorted(order)
