"""TrajectoryReady on the wire: generated spans instead of per-token arrays, exact both ways.

The compact form (``CompactTrajectory``) carries token ids once, the generated runs as (start,
end) spans with one weight version each, and logprobs of generated tokens only. Messages of the
older per-token form still decode; a malformed compact sample is refused where it is decoded.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from schemas import spans as span_form
from schemas.codec import Codec
from schemas.errors import UndecodableEvent
from schemas.events import CompactTrajectory, TrajectoryReady
from schemas.shards import rows_to_table, shard_row, table_to_trajectories
from schemas.spans import span_positions

CODEC = Codec()
PROPERTY = settings(max_examples=150, deadline=None)


def trajectory(**overrides: Any) -> TrajectoryReady:
    fields: dict[str, Any] = {
        "run": "run-1",
        "session": "sess-1",
        "trajectory_id": "run-1/sess-1/0",
        "group": "g-7",
        "segment": 0,
        "status": "completed",
        "input_ids": [10, 11, 12, 13, 14, 15, 16],
        "loss_mask": [0, 0, 1, 1, 0, 1, 1],
        "logprobs": [0.0, 0.0, -0.5, -0.125, 0.0, -1.0, -2.0],
        "versions": [-1, -1, 3, 3, -1, 3, 4],
        "prompt_len": 2,
        "turn_ends": [4, 7],
        "turn_rewards": [None, 0.5],
        "reward": 1.0,
        "num_turns": 2,
        "finish_reason": "stop",
        "messages": [{"role": "user", "content": "hi"}],
        "metadata": {"task": "t"},
        "fold_version": 4,
    }
    return TrajectoryReady(**(fields | overrides))


def raw_map(data: bytes) -> dict[str, Any]:
    decoded: dict[str, Any] = msgspec.msgpack.decode(
        data, ext_hook=lambda code, payload: msgspec.msgpack.Ext(code, bytes(payload))
    )
    return decoded


def ext(values: list[int] | list[float], dtype: str) -> msgspec.msgpack.Ext:
    code = {"<i4": 1, "<f4": 2, "i1": 3}[dtype]
    return msgspec.msgpack.Ext(code, np.asarray(values, dtype).tobytes())


def legacy_message(t: TrajectoryReady) -> bytes:
    """``t`` as the codec wrote it before the compact form: every array per token."""
    fields = msgspec.structs.asdict(t)
    fields = {k: (ext_of(v) if isinstance(v, np.ndarray) else v) for k, v in fields.items()}
    return msgspec.msgpack.encode({"type": "TrajectoryReady", **fields})


def ext_of(array: np.ndarray) -> msgspec.msgpack.Ext:
    return ext(array.tolist(), array.dtype.str if array.dtype.itemsize > 1 else "i1")


def assert_same(got: TrajectoryReady, want: TrajectoryReady) -> None:
    a, b = msgspec.structs.asdict(got), msgspec.structs.asdict(want)
    assert a.keys() == b.keys()
    for name, value in b.items():
        if isinstance(value, np.ndarray):
            assert a[name].dtype == value.dtype, name
            assert a[name].tobytes() == value.tobytes(), name
        else:
            assert a[name] == value, name


# --- the compact form -----------------------------------------------------------------------


def test_the_wire_carries_spans_one_version_each_and_generated_logprobs_only() -> None:
    raw = raw_map(CODEC.encode(trajectory()))

    assert raw["spans"] == ext([2, 4, 5, 6, 6, 7], "<i4")  # version 3 then 4: two spans
    assert raw["span_versions"] == ext([3, 3, 4], "<i4")
    assert raw["gen_logprobs"] == ext([-0.5, -0.125, -1.0, -2.0], "<f4")
    assert raw["loss_mask"] is None and raw["logprobs"] is None and raw["versions"] is None
    assert raw["input_ids"] == ext(list(range(10, 17)), "<i4")
    assert raw["v"] == 1 and raw["type"] == "TrajectoryReady"


def test_the_compact_message_is_smaller_than_the_per_token_one() -> None:
    n, generated = 20_000, 5_000
    mask = np.zeros(n, np.int8)
    mask[n - generated :] = 1
    big = trajectory(
        input_ids=np.arange(n),
        loss_mask=mask,
        logprobs=np.where(mask == 1, -0.5, 0.0),
        versions=np.where(mask == 1, 2, -1),
        turn_ends=[n],
        turn_rewards=[None],
    )
    compact, legacy = len(CODEC.encode(big)), len(legacy_message(big))
    assert compact < 4 * n + 4 * generated + 1_000
    assert legacy > 13 * n
    assert_same(CODEC.decode(legacy_message(big)), CODEC.decode(CODEC.encode(big)))  # type: ignore[arg-type]


def test_a_message_of_the_older_per_token_form_still_decodes() -> None:
    t = trajectory()
    old = legacy_message(t)

    decoded = CODEC.decode(old)
    assert isinstance(decoded, TrajectoryReady)
    assert_same(decoded, t)
    compact = CODEC.decode_compact_trajectory(old, "ts.traj.run-1")
    assert compact.spans is None and compact.loss_mask is not None
    assert_same(compact.expand(), t)
    # and it is written again in the compact form
    assert raw_map(CODEC.encode(decoded))["spans"] is not None


@st.composite
def token_arrays(draw: st.DrawFn) -> dict[str, Any]:
    n = draw(st.integers(0, 60))
    mask = draw(hnp.arrays(np.int8, n, elements=st.sampled_from([0, 1])))
    versions = draw(hnp.arrays(np.int32, n, elements=st.integers(-3, 3)))
    logprobs = draw(
        hnp.arrays(np.float32, n, elements=st.floats(-20, 0, width=32, allow_subnormal=False))
    )
    if draw(st.booleans()):  # as the fold makes them: plain tokens are (0, 0.0, -1)
        versions = np.where(mask == 1, versions, -1).astype(np.int32)
        logprobs = np.where(mask == 1, logprobs, 0.0).astype(np.float32)
    if n and draw(st.booleans()):  # the odd values the spans cannot say
        i = draw(st.integers(0, n - 1))
        kind = draw(st.sampled_from(["mask", "negzero", "nan"]))
        if kind == "mask":
            mask[i] = 2
        elif kind == "negzero":
            mask[i], logprobs[i] = 0, -0.0
        else:
            logprobs[i] = np.nan
    ends = sorted(draw(st.lists(st.integers(0, n), max_size=3)))
    return {
        "input_ids": draw(hnp.arrays(np.int32, n, elements=st.integers(0, 2**31 - 1))),
        "loss_mask": mask,
        "versions": versions,
        "logprobs": logprobs,
        "prompt_len": draw(st.integers(0, n)),
        "turn_ends": ends,
        "turn_rewards": [None] * len(ends),
    }


@given(fields=token_arrays())
@PROPERTY
def test_any_sample_round_trips_exactly_in_whichever_form_fits(fields: dict[str, Any]) -> None:
    t = trajectory(**fields)
    data = CODEC.encode(t)

    decoded = CODEC.decode(data)
    assert isinstance(decoded, TrajectoryReady)
    assert_same(decoded, t)
    assert CODEC.encode(decoded) == data
    compact = t.compact()
    plain = t.loss_mask != 1
    fits = (
        not np.any(t.loss_mask[plain] != 0)
        and not np.any(t.versions[plain] != -1)
        and not np.any(t.logprobs.view(np.int32)[plain] != 0)
    )
    assert (compact.spans is not None) == fits
    assert (compact.min_weight_version, compact.max_weight_version) == (
        t.min_weight_version,
        t.max_weight_version,
    )
    assert compact.response_len == t.response_len


@given(items=st.lists(token_arrays(), min_size=1, max_size=6), legacy=st.data())
@PROPERTY
def test_the_shard_columns_of_compact_rows_are_the_per_token_arrays(
    items: list[dict[str, Any]], legacy: st.DataObject
) -> None:
    """The writer builds the token columns of a whole shard at once from the spans; a row of
    the older form (read from an old message) may sit in the same shard."""
    samples = [trajectory(**f, trajectory_id=f"run-1/s/{i}") for i, f in enumerate(items)]
    rows = []
    for seq, t in enumerate(samples, start=1):
        old = legacy.draw(st.booleans())
        wire = legacy_message(t) if old else CODEC.encode(t)
        rows.append(shard_row(seq, CODEC.decode_compact_trajectory(wire, "ts.traj.run-1")))

    table = rows_to_table(rows)

    for (seq, back), want in zip(table_to_trajectories(table), samples, strict=True):
        assert seq == samples.index(want) + 1
        assert_same(back, msgspec.structs.replace(want, created_at=back.created_at))
    assert table.column("loss_mask").type == pa.list_(pa.int8())


def test_span_positions_are_the_tokens_inside_the_spans_in_order() -> None:
    starts, ends = np.array([0, 4, 9], np.int32), np.array([2, 7, 10], np.int32)
    assert span_positions(starts, ends).tolist() == [0, 1, 4, 5, 6, 9]
    assert span_positions(starts[:0], ends[:0]).tolist() == []


@settings(max_examples=200, deadline=None)
@given(
    runs=st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, 3), st.sampled_from([-1, 0, 7])), max_size=8
    )
)
def test_the_folds_spans_are_the_runs_the_per_token_arrays_hold(
    runs: list[tuple[int, int, int]],
) -> None:
    """``merge_spans`` (the fold's completions, read then generated, possibly empty or touching)
    gives exactly the spans ``generated_runs`` finds in the per-token arrays made of them, so
    the fold's compact form is the one ``TrajectoryReady.compact`` makes."""
    read, generated, versions = (np.array([r[i] for r in runs], np.int64) for i in range(3))
    bounds = np.cumsum(np.stack([read, generated], axis=1).reshape(-1))
    starts, ends = bounds[0::2], bounds[1::2]
    spans, span_versions = span_form.merge_spans(starts, ends, versions.astype(np.int32))
    n = int(bounds[-1]) if len(bounds) else 0
    mask, _, per_token = span_form.token_arrays(
        n, spans, span_versions, np.zeros(int(generated.sum()), np.float32)
    )
    found, found_versions = span_form.generated_runs(mask == 1, per_token)
    assert spans.tolist() == found.tolist()
    assert span_versions.tolist() == found_versions.tolist()
    assert int(mask.sum()) == int(generated.sum())


# --- malformed compact samples are refused where they are decoded ---------------------------

BAD_SPANS = [
    pytest.param({"spans": ext([2, 4, 5], "<i4")}, "spans has 3 entries", id="odd"),
    pytest.param(
        {"spans": ext([2, 5, 4, 7], "<i4"), "span_versions": ext([3, 3], "<i4")},
        "sorted, disjoint",
        id="overlapping",
    ),
    pytest.param(
        {"spans": ext([2, 9], "<i4"), "span_versions": ext([3], "<i4")},
        "inside the 7 tokens",
        id="past-the-end",
    ),
    pytest.param(
        {"spans": ext([3, 3], "<i4"), "span_versions": ext([3], "<i4")},
        "non-empty",
        id="empty-span",
    ),
    pytest.param({"span_versions": ext([3], "<i4")}, "1 span_versions for 3 spans", id="versions"),
    pytest.param(
        {"gen_logprobs": ext([-1.0], "<f4")}, "gen_logprobs has 1 entries for 4", id="logprobs"
    ),
    pytest.param({"loss_mask": ext([0] * 7, "i1")}, "either spans", id="both-forms"),
    pytest.param({"spans": None}, "either spans", id="neither-form"),
    pytest.param({"spans": ext([1, 2], "<f4")}, "spans", id="float-spans"),
]


@pytest.mark.parametrize(("fields", "message"), BAD_SPANS)
def test_a_malformed_compact_sample_is_refused_naming_what_is_wrong(
    fields: dict[str, Any], message: str
) -> None:
    data = msgspec.msgpack.encode(raw_map(CODEC.encode(trajectory())) | fields)
    with pytest.raises(UndecodableEvent, match=message):
        CODEC.decode(data)
    with pytest.raises(UndecodableEvent, match=message):
        CODEC.decode_compact_trajectory(data, "ts.traj.run-1")


def test_the_compact_form_checks_what_consumers_index_with() -> None:
    with pytest.raises(ValueError, match="prompt_len 9 is outside its 7 tokens"):
        msgspec.structs.replace(trajectory().compact(), prompt_len=9).__post_init__()
    compact = trajectory().compact()
    assert isinstance(compact, CompactTrajectory)
    assert compact.n_generated == 4 and compact.n_tokens == 7
