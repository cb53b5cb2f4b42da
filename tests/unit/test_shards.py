"""The shard schema and conversions, the committed-sequence set, the file shard store."""

from __future__ import annotations

import datetime as dt
import itertools
from pathlib import Path

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from consumers import fold
from eventlog.seqset import SeqSet
from schemas.events import TrajectoryReady
from schemas.images import ImageRef
from schemas.shards import (
    IMAGE_TYPE,
    TRAJECTORY_SCHEMA,
    ShardMetadata,
    shard_row,
    table_to_trajectories,
    trajectories_to_table,
)
from shardstore import FileShardStore, ShardUnreadable, ShardWriteFailed, open_shards_dataset
from tests.helpers.sessions import session_events, turn_specs
from tests.helpers.trajectories import folded

EXPECTED_TYPES = {
    "trajectory_id": pa.string(),
    "run": pa.string(),
    "session": pa.string(),
    "group": pa.string(),
    "segment": pa.int32(),
    "status": pa.string(),
    "input_ids": pa.list_(pa.int32()),
    "loss_mask": pa.list_(pa.int8()),
    "logprobs": pa.list_(pa.float32()),
    "versions": pa.list_(pa.int32()),
    "prompt_len": pa.int32(),
    "response_len": pa.int32(),
    "turn_ends": pa.list_(pa.int32()),
    "reward": pa.float64(),
    "turn_rewards": pa.list_(pa.float64()),
    "min_weight_version": pa.int32(),
    "max_weight_version": pa.int32(),
    "num_turns": pa.int32(),
    "finish_reason": pa.string(),
    "messages": pa.string(),
    "metadata": pa.string(),
    "tools": pa.string(),
    "images": pa.list_(IMAGE_TYPE),
    "created_at": pa.timestamp("us", tz="UTC"),
    "fold_version": pa.int32(),
    "traj_seq": pa.int64(),
}


def empty_trajectory(session: str = "empty") -> TrajectoryReady:
    return TrajectoryReady(
        run="r",
        session=session,
        trajectory_id=f"r/{session}/0",
        group="g",
        segment=0,
        status="aborted",
        input_ids=[],
        loss_mask=[],
        logprobs=[],
        versions=[],
        prompt_len=0,
        turn_ends=[],
        turn_rewards=[],
        reward=None,
        num_turns=0,
        finish_reason="",
        messages=[],
        metadata={},
        fold_version=1,
    )


def same(a: TrajectoryReady, b: TrajectoryReady) -> None:
    for name in ("input_ids", "loss_mask", "logprobs", "versions", "turn_ends"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.tolist() == y.tolist(), name
    for name in (
        "trajectory_id",
        "run",
        "session",
        "group",
        "segment",
        "status",
        "prompt_len",
        "turn_rewards",
        "reward",
        "num_turns",
        "finish_reason",
        "messages",
        "metadata",
        "tools",
        "fold_version",
        "images",
    ):
        assert getattr(a, name) == getattr(b, name), name
    assert a.created_at == pytest.approx(b.created_at, abs=1e-6)


def test_every_column_has_the_specified_type_and_nullability() -> None:
    assert {f.name: f.type for f in TRAJECTORY_SCHEMA} == EXPECTED_TYPES
    assert [f.name for f in TRAJECTORY_SCHEMA if f.nullable] == ["reward", "images"]
    assert [f.name for f in IMAGE_TYPE] == [
        "sha256",
        "offset",
        "length",
        "width",
        "height",
        "mime",
        "grid",
    ]


def test_a_table_holds_the_trajectory_values_column_by_column() -> None:
    t = folded("run-a", "s1", turns=2, final_reward=None, turn_reward=0.25)
    table = trajectories_to_table([(42, t)])
    assert table.schema.equals(TRAJECTORY_SCHEMA)
    row = table.to_pylist()[0]
    assert row["input_ids"] == t.input_ids.tolist()
    assert row["loss_mask"] == t.loss_mask.tolist()
    assert row["versions"] == t.versions.tolist()
    assert row["logprobs"] == pytest.approx(t.logprobs.tolist())
    assert row["turn_ends"] == t.turn_ends.tolist()
    assert row["reward"] is None
    assert row["turn_rewards"] == [0.25, None]
    assert row["response_len"] == t.response_len == len(t.input_ids) - t.prompt_len
    assert (row["min_weight_version"], row["max_weight_version"]) == (0, 1)
    assert row["created_at"] == dt.datetime(2023, 11, 14, 22, 13, 20, 250000, tzinfo=dt.UTC)
    assert row["traj_seq"] == 42
    assert row["messages"].startswith('[{"role":"user"')


def test_empty_arrays_keep_the_offsets_of_their_neighbours() -> None:
    a, b = folded("r", "a", turns=2), folded("r", "b", turns=1)
    table = trajectories_to_table([(1, a), (2, empty_trajectory()), (3, b)])
    ids = table.column("input_ids").combine_chunks()
    assert ids.offsets.to_pylist() == [
        0,
        len(a.input_ids),
        len(a.input_ids),
        len(a.input_ids) + len(b.input_ids),
    ]
    assert table.column("input_ids").to_pylist()[1] == []
    assert table.column("turn_rewards").to_pylist()[1] == []


def test_an_empty_table_has_the_schema() -> None:
    table = trajectories_to_table([])
    assert table.num_rows == 0 and table.schema.equals(TRAJECTORY_SCHEMA)
    assert table_to_trajectories(table) == []


@settings(max_examples=40, deadline=None)
@given(st.lists(turn_specs(max_turns=4), min_size=1, max_size=4))
def test_any_folded_sessions_round_trip_through_a_table(sessions: list) -> None:  # type: ignore[type-arg]
    trajectories = [
        t
        for i, specs in enumerate(sessions)
        for t in fold(session_events(specs, session=f"s{i}", final_reward=float(i))).trajectories
    ]
    items = [(100 + i, t) for i, t in enumerate(trajectories)]
    back = table_to_trajectories(trajectories_to_table(items))
    assert [seq for seq, _ in back] == [seq for seq, _ in items]
    for (_, original), (_, read) in zip(items, back, strict=True):
        same(original, read)


def test_images_round_trip_and_a_shard_older_than_the_column_reads_as_no_images(
    tmp_path: Path,
) -> None:
    ref = ImageRef(
        "ab" * 32, offset=1, length=2, width=28, height=56, mime="image/png", grid=(1, 2, 4)
    )
    t = msgspec.structs.replace(folded("r", "s", turns=2), images=[ref])
    table = trajectories_to_table([(3, t)])
    assert table.column("images").to_pylist()[0] == [
        {
            "sha256": "ab" * 32,
            "offset": 1,
            "length": 2,
            "width": 28,
            "height": 56,
            "mime": "image/png",
            "grid": [1, 2, 4],
        }
    ]
    [(_, back)] = table_to_trajectories(table)
    assert back.images == [ref]
    # A shard written before the column existed: the dataset reads it null, the row no images.
    old = trajectories_to_table([(4, folded("r", "old"))]).drop_columns(["images"])
    (tmp_path / "run=r").mkdir()
    pq.write_table(old, tmp_path / "run=r" / "part-old.parquet")
    [(seq, read)] = table_to_trajectories(open_shards_dataset(str(tmp_path)).to_table())
    assert (seq, read.images) == (4, [])


def test_rows_hold_messages_as_json_and_let_go_of_the_objects() -> None:
    t = folded("r", "s")
    row = shard_row(5, t)
    assert row.trajectory.messages == [] and row.trajectory.metadata == {}
    assert row.trajectory.input_ids is t.input_ids  # no copy of the tokens
    assert row.nbytes > len(row.messages) + t.input_ids.nbytes


def test_metadata_round_trips_and_names_missing_keys() -> None:
    meta = ShardMetadata("r", "TRAJ", "2024-01-01T00:00:00+00:00", 3, 9, 4, (1, 2))
    assert ShardMetadata.from_metadata(meta.to_metadata()) == meta
    assert meta.to_metadata()[b"turnstream.traj_first_seq"] == b"3"
    with pytest.raises(ValueError, match="traj_last_seq"):
        ShardMetadata.from_metadata(
            {k: v for k, v in meta.to_metadata().items() if b"last" not in k}
        )


# -- SeqSet ---------------------------------------------------------------------------------


@given(st.lists(st.tuples(st.integers(0, 60), st.integers(0, 6)), max_size=30))
def test_a_seqset_holds_exactly_what_was_added_in_merged_intervals(
    ranges: list[tuple[int, int]],
) -> None:
    seqs, expected = SeqSet(), set()
    for lo, width in ranges:
        if width % 2:
            seqs.add_range(lo, lo + width)
        else:
            seqs.add_many(np.arange(lo, lo + width + 1))
        expected.update(range(lo, lo + width + 1))
    assert {s for s in range(-2, 80) if s in seqs} == expected
    assert len(seqs) == len(expected)
    intervals = seqs.intervals
    # Sorted, disjoint and not even adjacent: every interval is as merged as it can be.
    assert all(hi + 1 < lo for (_, hi), (lo, _) in itertools.pairwise(intervals))


# -- FileShardStore -------------------------------------------------------------------------


def write(store: FileShardStore, run: str, items: list[tuple[int, TrajectoryReady]]) -> str:
    table = trajectories_to_table(items)
    meta = ShardMetadata(run, "TRAJ", "c", items[0][0], items[-1][0], len(items), (1,))
    return store.write(table, meta).path


@pytest.mark.parametrize("as_uri", [False, True])
def test_a_store_commits_shards_that_read_back_with_their_ranges(
    tmp_path: Path, as_uri: bool
) -> None:
    root = tmp_path / "shards"
    store = FileShardStore(root.as_uri() if as_uri else str(root), compression_level=3)
    a = [(1, folded("r1", "a")), (4, folded("r1", "b"))]
    path = write(store, "r1", a)
    write(store, "0042", [(2, folded("0042", "c"))])

    assert path.startswith(f"{root}/run=r1/part-000000000001-000000000004-")
    [first, second] = store.committed()
    assert (first.run, first.first_seq, second.run, second.last_seq) == ("r1", 1, "0042", 2)
    assert store.read_seqs(first).tolist() == [1, 4]
    assert store.read_metadata(first).rows == 2
    footer = pq.read_metadata(path)
    assert footer.row_group(0).column(0).compression == "ZSTD"
    assert footer.metadata[b"turnstream.traj_last_seq"] == b"4"
    table = open_shards_dataset(str(root)).to_table()
    assert sorted(table.column("run").to_pylist()) == ["0042", "r1", "r1"]


def test_half_written_shards_are_invisible_and_removed(tmp_path: Path) -> None:
    store = FileShardStore(str(tmp_path))
    write(store, "r", [(1, folded("r", "a"))])
    partial = tmp_path / "run=r" / ".part-000000000002-000000000002-abcd.parquet.tmp"
    partial.write_bytes(b"PAR1 half a shard")

    assert [s.first_seq for s in store.committed()] == [1]
    assert open_shards_dataset(str(tmp_path)).count_rows() == 1
    assert store.remove_partial() == [str(partial)]
    assert not partial.exists()


def test_object_stores_get_the_final_key_directly(tmp_path: Path) -> None:
    mock = pafs._MockFileSystem()
    store = FileShardStore("bucket/shards", filesystem=mock)
    assert not store.rename_commits
    path = write(store, "r", [(7, folded("r", "a"))])
    assert path.startswith("bucket/shards/run=r/part-000000000007-")
    assert [s.path for s in store.committed()] == [path]
    assert open_shards_dataset("bucket/shards", filesystem=mock).count_rows() == 1


def test_a_corrupt_committed_shard_is_named_with_what_to_do(tmp_path: Path) -> None:
    store = FileShardStore(str(tmp_path))
    bad = tmp_path / "run=r" / "part-000000000001-000000000003-00ff.parquet"
    bad.parent.mkdir()
    bad.write_bytes(b"not parquet")
    [shard] = store.committed()
    with pytest.raises(ShardUnreadable, match=r"part-000000000001-000000000003-00ff.*move it out"):
        store.read_seqs(shard)


def test_an_unwritable_target_fails_naming_the_shard(tmp_path: Path) -> None:
    (tmp_path / "run=r").write_text("a file where the run directory should be")
    store = FileShardStore(str(tmp_path))
    with pytest.raises(ShardWriteFailed, match=r"run=r/part-000000000001.*redelivered"):
        write(store, "r", [(1, folded("r", "a"))])
    assert pafs.LocalFileSystem().get_file_info(str(tmp_path / "run=r")).is_file
