"""The pure decisions around the consumers: failure dispositions, session activity, fold options."""

from __future__ import annotations

import dataclasses

import pytest

from consumers import FoldError, FoldWorkerSettings, MissingTurns
from consumers.reaper import Observation, SessionActivity, forgettable, idle_sessions, observe
from consumers.worker import fold_options, republish_could_duplicate
from eventlog.config import ConsumerSettings
from eventlog.dispositions import (
    DeadLetterIt,
    Retry,
    RetryDeadLetter,
    disposition,
    reason_of,
    when_dead_letter_fails,
)
from eventlog.pull import ConsumerSpec
from schemas import (
    EventLogError,
    EventLogUnavailable,
    PayloadTooLarge,
    UndecodableEvent,
    UnsupportedSchemaVersion,
    UntrustedEvent,
)
from schemas.dead_letter import DeadLetter, decode_dead_letter, encode_dead_letter
from tests.helpers.sessions import opened

SETTINGS = FoldWorkerSettings(max_deliver=4, backoff_s=(1.0, 5.0, 30.0))
SPEC = ConsumerSpec.of(SETTINGS, stream="EVENTS", filter_subjects=["ts.ev.*.*.close"])
MISSING = MissingTurns("r", "s", [1], 3, "the close says num_turns=3")


@pytest.mark.parametrize(
    ("error", "delivery", "expected"),
    [
        (UndecodableEvent("junk"), 1, DeadLetterIt("undecodable")),
        (UnsupportedSchemaVersion(9, 1), 1, DeadLetterIt("unsupported_version")),
        (PayloadTooLarge("r/s/0", 10, 5), 1, DeadLetterIt("payload_too_large")),
        (FoldError("lies"), 1, DeadLetterIt("fold_error")),
        (MISSING, 1, Retry(1.0)),
        (MISSING, 3, Retry(30.0)),
        (MISSING, 4, DeadLetterIt("missing_turns")),
        (EventLogUnavailable("down"), 2, Retry(5.0)),
        (EventLogUnavailable("down"), 4, DeadLetterIt("log_unavailable")),
        (EventLogError("refused"), 1, Retry(1.0)),
        (RuntimeError("a bug"), 1, Retry(1.0)),
        (RuntimeError("a bug"), 9, DeadLetterIt("worker_error")),
    ],
)
def test_disposition_of_each_error(error: Exception, delivery: int, expected: object) -> None:
    assert disposition(error, delivery=delivery, spec=SPEC) == expected


@pytest.mark.parametrize(
    ("delivery", "attempt", "stopping", "expected"),
    [
        (1, 1, False, Retry(1.0)),  # a redelivery is coming: the whole message retries
        (3, 1, True, Retry(30.0)),
        (4, 1, False, RetryDeadLetter(1.0)),  # max_deliver: never nak, retry the letter
        (4, 3, False, RetryDeadLetter(30.0)),
        (4, 9, True, Retry(30.0)),  # stopping: the spare delivery will come
        (5, 2, True, RetryDeadLetter(5.0)),  # the consumer's last: the stop waits for the log
    ],
)
def test_a_refused_dead_letter_is_never_dropped_on_a_last_delivery(
    delivery: int, attempt: int, stopping: bool, expected: object
) -> None:
    assert SPEC.server_max_deliver == SETTINGS.max_deliver + 1
    decision = when_dead_letter_fails(
        delivery=delivery, attempt=attempt, stopping=stopping, spec=SPEC
    )
    assert decision == expected


def test_a_stopping_worker_hands_a_close_back_only_after_its_own_last_fetch() -> None:
    slow_fetch = dataclasses.replace(SPEC, fetch_timeout_s=60.0)
    decision = when_dead_letter_fails(delivery=4, attempt=1, stopping=True, spec=slow_fetch)
    assert decision == Retry(61.0)  # else its still-open fetch could take the close back


@pytest.mark.parametrize(
    ("delivery", "close_age_s", "expected"),
    [
        (1, 3600.0, False),  # no earlier delivery could have published
        (2, 10.0, False),  # a republish lands inside the window of any earlier publish
        (2, 59.9, False),
        (2, 60.0, True),  # less than half the window left for the fold, retries and skew
        (7, 3600.0, True),
    ],
)
def test_only_old_redelivered_closes_look_for_trajectories_already_in_traj(
    delivery: int, close_age_s: float, expected: bool
) -> None:
    decision = republish_could_duplicate(delivery=delivery, close_age_s=close_age_s, window_s=120.0)
    assert decision is expected


def test_a_consumer_that_never_gives_up_retries_everything_but_bad_input() -> None:
    """max_deliver=-1 (the shard writer, the live feed, the reaper's tracking): a transient error
    or a refused dead letter is retried however many deliveries it took; bad input and untrusted
    events are still dead-lettered at once."""
    forever = ConsumerSpec.of(
        ConsumerSettings(durable="shard-writer", max_deliver=-1, backoff_s=(1.0, 5.0)),
        stream="TRAJ",
        filter_subjects=["ts.traj.>"],
    )
    assert forever.server_max_deliver == -1
    assert disposition(EventLogUnavailable("down"), delivery=10**6, spec=forever) == Retry(5.0)
    assert disposition(RuntimeError("a bug"), delivery=50, spec=forever) == Retry(5.0)
    untrusted = UntrustedEvent("subject_mismatch", "not its subject")
    assert disposition(untrusted, delivery=1, spec=forever) == DeadLetterIt("subject_mismatch")
    refused = when_dead_letter_fails(delivery=10**6, attempt=3, stopping=True, spec=forever)
    assert refused == Retry(5.0)
    with pytest.raises(ValueError, match="max_deliver must be -1"):
        ConsumerSettings(durable="x", max_deliver=1)
    with pytest.raises(ValueError, match="max_deliver must be -1"):
        dataclasses.replace(forever, max_deliver=1)


def test_missing_turns_is_a_fold_error_with_its_own_reason() -> None:
    assert isinstance(MISSING, FoldError)
    assert reason_of(MISSING) == "missing_turns"


def test_the_last_backoff_repeats() -> None:
    assert SPEC.retry_delay_s(3) == SPEC.retry_delay_s(7) == 30.0


def test_fetch_batch_never_exceeds_max_ack_pending() -> None:
    settings = FoldWorkerSettings(batch=500, max_ack_pending=64, concurrency=8)
    assert ConsumerSpec.of(settings, stream="EVENTS", filter_subjects=["c"]).fetch_batch == 64


def test_a_dead_letter_is_cut_to_fit_the_payload_limit() -> None:
    letter = DeadLetter(
        source="fold",
        reason="undecodable",
        error="e" * 10_000,
        stream="EVENTS",
        subject="ts.ev.r.s.turn",
        seq=3,
        payload=b"x" * 100_000,
    )
    fitted = letter.fitted(8_000)
    encoded = encode_dead_letter(fitted)
    assert len(encoded) <= 8_000
    assert fitted.payload_truncated and fitted.payload == letter.payload[: len(fitted.payload)]
    assert decode_dead_letter(encoded) == fitted
    small = DeadLetter(source="f", reason="r", error="e", stream="S", subject="s", seq=1)
    assert small.fitted(8_000) is small
    with pytest.raises(UndecodableEvent):
        decode_dead_letter(b"\x00junk")


def obs(seq: int, kind: str, at: float, turn: int | None = None) -> Observation:
    return Observation(seq=seq, kind=kind, at=at, turn=turn)


def test_activity_merges_in_any_order_to_the_same_entry() -> None:
    seen = [
        obs(1, "open", 10.0),
        obs(2, "turn", 11.0, 0),
        obs(5, "turn", 15.0, 2),
        obs(3, "turn", 12.0, 1),
    ]
    forward = backward = None
    for o in seen:
        forward, _ = observe(forward, o)
    for o in reversed(seen):
        backward, _ = observe(backward, o)
    assert forward == backward == SessionActivity(last_at=15.0, turns=3)
    again, late = observe(forward, seen[2])  # a redelivery changes nothing
    assert again == forward and not late


def test_an_event_after_the_recorded_close_is_late() -> None:
    activity, _ = observe(None, obs(4, "close", 20.0))
    activity, late = observe(activity, obs(7, "reward", 30.0))
    assert late and activity.late == 1 and activity.close_seq == 4
    activity, late = observe(activity, obs(3, "turn", 19.0, 0))  # before the close in the log
    assert not late and activity.turns == 1


def test_only_open_sessions_idle_past_the_timeout_are_reaped() -> None:
    entries = [
        ("r.idle", SessionActivity(last_at=100.0, turns=2)),
        ("r.busy", SessionActivity(last_at=195.0, turns=1)),
        ("r.closed", SessionActivity(last_at=10.0, turns=1, close_seq=9)),
    ]
    assert [key for key, _ in idle_sessions(entries, now=200.0, idle_timeout_s=60.0)] == ["r.idle"]


def test_a_session_may_ask_for_per_turn_samples_and_bad_requests_are_fold_errors() -> None:
    assert fold_options(SETTINGS, opened(metadata={"fold": {"per_turn": True}})).per_turn
    assert not fold_options(SETTINGS, opened()).per_turn
    assert fold_options(SETTINGS, None).final_reward_scope == "all"
    for bad in ({"per_turn": "yes"}, {"final_reward_scope": "first"}, {"shuffle": True}, "x"):
        with pytest.raises(FoldError, match=r"metadata\.fold"):
            fold_options(SETTINGS, opened(metadata={"fold": bad}))


def test_only_sessions_closed_and_quiet_long_enough_are_forgotten() -> None:
    entries = [
        ("r.old", SessionActivity(last_at=10.0, turns=1, close_seq=4)),
        ("r.recent", SessionActivity(last_at=150.0, turns=1, close_seq=9)),
        ("r.open", SessionActivity(last_at=10.0, turns=1)),
    ]
    assert forgettable(entries, now=200.0, after_s=100.0) == ["r.old"]


def test_a_consumer_spec_is_the_one_place_nats_consumer_config_comes_from() -> None:
    """The server keeps one delivery more than the handler's tries (the spare delivery), one
    filter subject or several, and headers only when asked."""
    fold_worker = SPEC.config()
    assert (fold_worker.durable_name, fold_worker.max_deliver) == ("fold", 5)
    assert fold_worker.filter_subject == "ts.ev.*.*.close" and not fold_worker.filter_subjects
    assert fold_worker.ack_wait == SETTINGS.ack_wait_s and fold_worker.headers_only is None
    tracker = ConsumerSpec(
        "EVENTS", "reaper", ("ts.ev.a.>", "ts.ev.b.>"), 4096, 30.0, headers_only=True
    ).config()
    assert tracker.max_deliver == -1 and tracker.headers_only
    assert tracker.filter_subjects == ["ts.ev.a.>", "ts.ev.b.>"] and tracker.filter_subject is None
