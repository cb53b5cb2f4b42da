"""The shard writer against a real nats-server: shards, rotation, dead letters, exactly once."""

from __future__ import annotations

import asyncio
import collections
import errno
import os
import random
import signal
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path

import duckdb
import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from consumers.config import ShardWriterSettings
from consumers.shard_writer import ShardWriter
from eventlog import JetStreamPublisher, provision
from schemas.codec import Codec
from schemas.dead_letter import decode_dead_letter
from schemas.events import TrajectoryReady
from schemas.shards import (
    TRAJECTORY_SCHEMA,
    ShardMetadata,
    table_to_trajectories,
)
from shardstore import FileShardStore, open_shards_dataset
from shardstore import store as shard_store
from tests.conftest import Log
from tests.helpers.sessions import TurnSpec, turn_events
from tests.helpers.trajectories import folded, many
from tests.helpers.waiting import eventually

pytestmark = pytest.mark.integration

FAST = ShardWriterSettings(
    batch=16, max_rows=10, max_age_s=0.3, fetch_timeout_s=0.2, ack_wait_s=1.0
)


@pytest.fixture
async def publisher(log: Log) -> AsyncIterator[JetStreamPublisher]:
    pub = await JetStreamPublisher(log.nc).start()
    yield pub
    await pub.close()


class Running:
    """A writer running in this process until ``stop()``."""

    def __init__(self, writer: ShardWriter) -> None:
        self.writer = writer
        self._stop = asyncio.Event()
        self.task = asyncio.create_task(writer.run(self._stop))

    async def stop(self) -> None:
        self._stop.set()
        await self.task

    async def until(self, condition: Callable[[ShardWriter], bool], what: str) -> None:
        def done() -> bool:
            if self.task.done():
                self.task.result()  # raise what stopped it
            return condition(self.writer)

        await eventually(done, 20.0, what)


def start(log: Log, pub: JetStreamPublisher, root: Path, settings: ShardWriterSettings) -> Running:
    return Running(ShardWriter(log.js, pub, FileShardStore(str(root)), settings))


def shard_ids(root: Path) -> list[str]:
    if not root.exists():
        return []
    ids: list[str] = (
        open_shards_dataset(str(root)).to_table(["trajectory_id"]).column(0).to_pylist()
    )
    return ids


def shard_files(root: Path) -> list[Path]:
    return sorted(root.glob("run=*/part-*.parquet"))


async def test_shards_read_back_with_pyarrow_and_duckdb_typed_and_each_trajectory_once(
    log: Log, publisher: JetStreamPublisher, tmp_path: Path
) -> None:
    runs = ("run-a", "0042", "run-c")  # a numeric-looking run must stay a string
    trajectories = many(45, runs)
    receipts = await publisher.publish_many(trajectories)
    writer = start(log, publisher, tmp_path, FAST)
    await writer.until(lambda w: w.stats.rows_written == 45, "45 trajectories in shards")
    await writer.stop()

    dataset = open_shards_dataset(str(tmp_path))
    table = dataset.to_table()
    assert table.schema.equals(TRAJECTORY_SCHEMA)
    ids = table.column("trajectory_id").to_pylist()
    assert sorted(ids) == sorted(t.trajectory_id for t in trajectories)
    assert len(set(ids)) == len(ids)
    by_id = {t.trajectory_id: t for t in trajectories}
    seq_of = {t.trajectory_id: r.seq for t, r in zip(trajectories, receipts, strict=True)}
    for seq, back in table_to_trajectories(table):
        original = by_id[back.trajectory_id]
        assert seq == seq_of[back.trajectory_id]
        assert back.input_ids.tolist() == original.input_ids.tolist()
        assert back.logprobs.tolist() == original.logprobs.tolist()
        assert (back.reward, back.turn_rewards) == (original.reward, original.turn_rewards)
    only_0042 = dataset.to_table(filter=pa.compute.field("run") == "0042")
    assert set(only_0042.column("run").to_pylist()) == {"0042"}
    assert only_0042.num_rows == 15

    files = shard_files(tmp_path)
    assert all(f.parent.name == f"run={pq.read_table(f).column('run')[0]}" for f in files)
    for f in files:
        meta = ShardMetadata.from_metadata(pq.read_metadata(f).metadata)
        seqs = pq.read_table(f, columns=["traj_seq"]).column(0).to_pylist()
        assert (meta.first_seq, meta.last_seq, meta.rows) == (min(seqs), max(seqs), len(seqs))
        assert meta.rows <= FAST.max_rows and meta.stream == "TRAJ"
        assert pq.read_metadata(f).row_group(0).column(6).compression == "ZSTD"

    glob = f"{tmp_path}/run=*/*.parquet"
    con = duckdb.connect()
    types = dict(
        con.sql(
            f"describe select * from read_parquet('{glob}', hive_partitioning=false)"
        ).fetchall()[i][:2]
        for i in range(len(TRAJECTORY_SCHEMA))
    )
    assert types["input_ids"] == "INTEGER[]" and types["loss_mask"] == "TINYINT[]"
    assert types["logprobs"] == "FLOAT[]" and types["reward"] == "DOUBLE"
    assert types["created_at"] == "TIMESTAMP WITH TIME ZONE" and types["traj_seq"] == "BIGINT"
    per_run = con.sql(
        f"select run, count(*), count(distinct trajectory_id), sum(len(input_ids)) "
        f"from read_parquet('{glob}', hive_partitioning=true, hive_types={{'run': VARCHAR}}) "
        f"group by run order by run"
    ).fetchall()
    tokens = collections.Counter()
    for t in trajectories:
        tokens[t.run] += len(t.input_ids)
    assert per_run == [(run, 15, 15, tokens[run]) for run in sorted(runs)]


async def test_a_shard_is_cut_by_age(
    log: Log, publisher: JetStreamPublisher, tmp_path: Path
) -> None:
    settings = FAST.model_copy(update={"max_rows": 1000, "max_age_s": 0.5})
    writer = start(log, publisher, tmp_path, settings)
    await publisher.publish_many([folded("r", f"s{i}") for i in range(3)])
    await writer.until(lambda w: w.stats.rows_written == 3, "3 rows in a shard, by age")
    await publisher.publish_many([folded("r", f"t{i}") for i in range(2)])
    await writer.until(lambda w: w.stats.rows_written == 5, "a second shard, by age")
    await writer.stop()
    assert sum(pq.read_metadata(f).num_rows for f in shard_files(tmp_path)) == 5
    assert len(shard_files(tmp_path)) >= 2


async def test_a_shard_is_cut_at_max_rows_and_the_rest_flushed_on_stop(
    log: Log, publisher: JetStreamPublisher, tmp_path: Path
) -> None:
    settings = FAST.model_copy(update={"max_rows": 4, "max_age_s": 60.0})
    writer = start(log, publisher, tmp_path, settings)
    await publisher.publish_many([folded("r", f"s{i}") for i in range(9)])
    await writer.until(lambda w: w.stats.rows_written == 8, "two full shards")
    await writer.stop()
    sizes = [pq.read_metadata(f).num_rows for f in shard_files(tmp_path)]
    assert sizes == [4, 4, 1]  # named by first sequence, so in order
    # Acks are sent, not awaited: the server may count the last one a moment after stop().
    for _ in range(100):
        info = await log.js.consumer_info("TRAJ", settings.durable)
        if info.num_ack_pending == 0:
            break
        await asyncio.sleep(0.05)
    assert info.num_ack_pending == 0


async def test_a_byte_limit_cuts_shards_too(
    log: Log, publisher: JetStreamPublisher, tmp_path: Path
) -> None:
    settings = FAST.model_copy(update={"max_rows": 1000, "max_bytes": 1, "max_age_s": 60.0})
    writer = start(log, publisher, tmp_path, settings)
    await publisher.publish_many([folded("r", f"s{i}") for i in range(3)])
    await writer.until(lambda w: w.stats.rows_written == 3, "3 rows")
    await writer.stop()
    assert [pq.read_metadata(f).num_rows for f in shard_files(tmp_path)] == [1, 1, 1]


async def test_undecodable_messages_are_dead_lettered_and_the_rest_written(
    log: Log, publisher: JetStreamPublisher, tmp_path: Path
) -> None:
    good = [folded("run-a", f"s{i}") for i in range(5)]
    await publisher.publish_many(good[:2])
    junk = await publisher.publish_raw("ts.traj.run-a", b"\xc1 not msgpack", "junk-1")
    [turn] = turn_events([TurnSpec([1], [2])], run="run-a")
    wrong_type = await publisher.publish_raw(
        "ts.traj.run-a", publisher.codec.encode(turn), "wrong-type-1"
    )
    await publisher.publish_many(good[2:])
    writer = start(log, publisher, tmp_path, FAST)
    await writer.until(lambda w: w.stats.rows_written == 5, "the good 5 written")
    await writer.until(lambda w: sum(w.loop.stats.dead_letters.values()) == 2, "2 dead letters")
    await writer.stop()

    assert sorted(shard_ids(tmp_path)) == sorted(t.trajectory_id for t in good)
    letters = [decode_dead_letter((await log.js.get_msg("DLQ", seq)).data) for seq in (1, 2)]
    assert {(lt.source, lt.reason, lt.run) for lt in letters} == {
        ("shard-writer", "undecodable", "run-a")
    }
    assert {lt.seq for lt in letters} == {junk.seq, wrong_type.seq}
    assert {lt.payload for lt in letters} >= {b"\xc1 not msgpack"}
    assert any("TurnCompleted" in lt.error for lt in letters)
    info = await log.js.consumer_info("TRAJ", FAST.durable)
    assert info.num_ack_pending == 0 and info.num_pending == 0


def raw_fields(trajectory: TrajectoryReady) -> dict[str, object]:
    """``trajectory``'s TRAJ message as a plain msgpack map, arrays kept as ext values."""
    raw: dict[str, object] = msgspec.msgpack.decode(
        Codec().encode(trajectory),
        ext_hook=lambda code, data: msgspec.msgpack.Ext(code, bytes(data)),
    )
    return raw


def per_token_message(trajectory: TrajectoryReady) -> bytes:
    """``trajectory`` as TRAJ messages were before the compact form: every array per token."""
    fields = msgspec.structs.asdict(trajectory)
    codes = {"<i4": 1, "<f4": 2, "|i1": 3}
    return msgspec.msgpack.encode(
        {
            "type": "TrajectoryReady",
            **{
                k: msgspec.msgpack.Ext(codes[v.dtype.str], v.tobytes())
                if isinstance(v, np.ndarray)
                else v
                for k, v in fields.items()
            },
        }
    )


async def test_old_per_token_messages_and_compact_ones_share_a_shard_and_bad_spans_are_refused(
    log: Log, publisher: JetStreamPublisher, tmp_path: Path
) -> None:
    """A TRAJ stream written before the compact form still drains into shards, next to new
    messages; a compact message whose spans do not fit its tokens is dead-lettered where it is
    decoded, and the shard is written without it."""
    new = [folded("run-a", f"s{i}") for i in range(3)]
    old = [folded("run-a", f"old{i}") for i in range(2)]
    await publisher.publish_many(new[:1])
    for t in old:
        await publisher.publish_raw("ts.traj.run-a", per_token_message(t), t.trajectory_id)
    bad = folded("run-a", "bad")
    n = len(bad.input_ids)
    bad_data = msgspec.msgpack.encode(
        raw_fields(bad) | {"spans": msgspec.msgpack.Ext(1, np.array([0, n + 5], "<i4").tobytes())}
    )
    receipt = await publisher.publish_raw("ts.traj.run-a", bad_data, "bad-spans-1")
    await publisher.publish_many(new[1:])
    writer = start(log, publisher, tmp_path, FAST)
    await writer.until(lambda w: w.stats.rows_written == 5, "the 5 good ones written")
    await writer.until(lambda w: sum(w.loop.stats.dead_letters.values()) == 1, "1 dead letter")
    await writer.stop()

    letter = decode_dead_letter((await log.js.get_msg("DLQ", 1)).data)
    assert (letter.reason, letter.seq, letter.payload) == ("undecodable", receipt.seq, bad_data)
    assert "spans" in letter.error
    want = {t.trajectory_id: t for t in [*new, *old]}
    table = pa.concat_tables(pq.read_table(f) for f in shard_files(tmp_path))
    for _, back in table_to_trajectories(table):
        t = want.pop(back.trajectory_id)
        for name in ("input_ids", "loss_mask", "logprobs", "versions", "turn_ends"):
            assert getattr(back, name).tobytes() == getattr(t, name).tobytes(), name
    assert not want


def with_created_at(trajectory: TrajectoryReady, created_at: float) -> bytes:
    """``trajectory``'s TRAJ message bytes with ``created_at`` put in at the msgpack level.

    1e300 s decodes (a float) but is no timestamp[us]: the row cannot be converted.
    """
    codec = Codec()
    raw = msgspec.msgpack.decode(
        codec.encode(trajectory), ext_hook=lambda code, data: msgspec.msgpack.Ext(code, bytes(data))
    )
    data = msgspec.msgpack.encode({**raw, "created_at": created_at})
    assert codec.decode(data).trajectory_id == trajectory.trajectory_id  # it does decode
    return data


async def test_a_row_that_decodes_but_cannot_be_converted_is_dead_lettered_and_the_rest_written(
    log: Log, publisher: JetStreamPublisher, tmp_path: Path
) -> None:
    good = [folded("run-a", f"s{i}") for i in range(5)]
    await publisher.publish_many(good[:2])
    bad = folded("run-a", "bad")
    bad_data = with_created_at(bad, 1e300)
    receipt = await publisher.publish_raw("ts.traj.run-a", bad_data, "bad-1")
    await publisher.publish_many(good[2:])
    writer = start(log, publisher, tmp_path, FAST)
    await writer.until(lambda w: w.stats.rows_written == 5, "the good 5 written")
    await writer.until(
        lambda w: sum(w.loop.stats.dead_letters.values()) == 1, "the bad one dead-lettered"
    )
    await writer.stop()

    ids = shard_ids(tmp_path)
    assert sorted(ids) == sorted(t.trajectory_id for t in good)  # each exactly once
    letter = decode_dead_letter((await log.js.get_msg("DLQ", 1)).data)
    assert (letter.source, letter.reason, letter.run) == ("shard-writer", "unwritable_row", "run-a")
    assert (letter.seq, letter.payload) == (receipt.seq, bad_data)
    assert bad.trajectory_id in letter.error and "created_at" in letter.error
    info = await log.js.consumer_info("TRAJ", FAST.durable)
    assert info.num_ack_pending == 0 and info.num_pending == 0

    # A restarted writer, given a shard's worth of nothing but an unwritable row, lives on too.
    again = folded("run-a", "bad-again")
    await publisher.publish_raw("ts.traj.run-a", with_created_at(again, 1e300), "bad-2")
    writer = start(log, publisher, tmp_path, FAST)
    await writer.until(
        lambda w: sum(w.loop.stats.dead_letters.values()) == 1, "the second bad one dead-lettered"
    )
    late = folded("run-a", "late")
    await publisher.publish_many([late])
    await writer.until(lambda w: w.stats.rows_written == 1, "a good one after it")
    await writer.stop()
    assert sorted(shard_ids(tmp_path)) == sorted(t.trajectory_id for t in [*good, late])
    letter = decode_dead_letter((await log.js.get_msg("DLQ", 2)).data)
    assert letter.reason == "unwritable_row" and again.trajectory_id in letter.error


async def test_a_directory_fsync_failing_after_the_rename_commits_the_shard_once(
    log: Log,
    publisher: JetStreamPublisher,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Some filesystems (FUSE, network mounts) refuse fsync on a directory; no real one at hand
    # does, so the store's fsync is patched: it fails for the directory, after the rename.
    fsync = shard_store._fsync

    def refusing_directories(path: str) -> None:
        if os.path.isdir(path):
            raise OSError(errno.EINVAL, "Invalid argument", path)
        fsync(path)

    monkeypatch.setattr(shard_store, "_fsync", refusing_directories)
    trajectories = [folded("r", f"s{i}") for i in range(5)]
    await publisher.publish_many(trajectories)
    writer = start(log, publisher, tmp_path, FAST)
    await writer.until(lambda w: w.stats.rows_written == 5, "5 rows committed")
    await writer.stop()

    [shard] = shard_files(tmp_path)
    assert sorted(shard_ids(tmp_path)) == sorted(t.trajectory_id for t in trajectories)
    assert writer.writer.stats.write_retries == 0
    assert any(shard.name in r.getMessage() and "fsync" in r.getMessage() for r in caplog.records)
    info = await log.js.consumer_info("TRAJ", FAST.durable)
    assert info.num_ack_pending == 0 and info.num_pending == 0


class HeldStore(FileShardStore):
    """Holds each shard write (in the writer's thread) until ``release`` is set."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.release = threading.Event()
        self.writing = threading.Event()

    def write(self, table, metadata):  # type: ignore[no-untyped-def]
        self.writing.set()
        assert self.release.wait(20.0), "the test never released the write"
        return super().write(table, metadata)


async def test_fetching_goes_on_while_a_shard_is_written_and_nothing_is_acked_before_its_commit(
    log: Log, publisher: JetStreamPublisher, tmp_path: Path
) -> None:
    settings = FAST.model_copy(update={"ack_wait_s": 120.0})  # shards cut by age (0.3 s)
    store = HeldStore(str(tmp_path))
    writer = Running(ShardWriter(log.js, publisher, store, settings))
    first = [folded("r", f"a{i}") for i in range(4)]
    await publisher.publish_many(first)
    await eventually(store.writing.is_set, 20.0, "the first shard being written")
    more = [folded("r", f"b{i}") for i in range(3)]
    await publisher.publish_many(more)

    async def delivered(n: int) -> bool:
        info = await log.js.consumer_info("TRAJ", settings.durable)
        return info.num_ack_pending == n and info.num_pending == 0

    # The three later ones were fetched and buffered while the first shard was held: nothing
    # acked, not even the four being written.
    for _ in range(200):
        if await delivered(7) and len(writer.writer._by_seq) == 7:
            break
        await asyncio.sleep(0.05)
    assert await delivered(7) and len(writer.writer._by_seq) == 7
    assert writer.writer.stats.rows_written == 0 and not shard_files(tmp_path)

    store.release.set()
    await writer.until(lambda w: w.stats.rows_written == 7, "every shard committed")
    await writer.stop()
    assert sorted(shard_ids(tmp_path)) == sorted(t.trajectory_id for t in [*first, *more])
    assert len(shard_files(tmp_path)) >= 2
    for _ in range(100):
        if await delivered(0):
            break
        await asyncio.sleep(0.05)
    assert await delivered(0)


class CrashAfterCommit(BaseException):
    """The writer 'dies' after the shard is committed and before any ack."""


class CrashingStore(FileShardStore):
    def write(self, table, metadata):  # type: ignore[no-untyped-def]
        super().write(table, metadata)
        raise CrashAfterCommit


async def test_a_restart_skips_what_committed_shards_hold(
    log: Log, publisher: JetStreamPublisher, tmp_path: Path
) -> None:
    trajectories = many(12, ("run-a", "run-b"))
    await publisher.publish_many(trajectories)
    crashing = ShardWriter(log.js, publisher, CrashingStore(str(tmp_path)), FAST)
    with pytest.raises(CrashAfterCommit):
        await crashing.run(asyncio.Event())
    committed = shard_ids(tmp_path)
    assert len(committed) >= 1
    info = await log.js.consumer_info("TRAJ", FAST.durable)
    assert info.ack_floor.stream_seq == 0  # nothing was acked: all of it comes again

    writer = start(log, publisher, tmp_path, FAST)
    await writer.until(lambda w: w.stats.rows_written == 12 - len(committed), "the rest")
    await writer.until(lambda w: w.stats.duplicates_skipped >= len(committed), "skips")
    await writer.stop()

    ids = shard_ids(tmp_path)
    assert sorted(ids) == sorted(t.trajectory_id for t in trajectories)
    assert writer.writer.stats.rows_written == 12 - len(committed)


async def test_shards_of_an_earlier_traj_stream_do_not_hide_the_new_one(
    log: Log, publisher: JetStreamPublisher, tmp_path: Path
) -> None:
    first = [folded("r", f"old{i}") for i in range(3)]
    await publisher.publish_many(first)
    writer = start(log, publisher, tmp_path, FAST)
    await writer.until(lambda w: w.stats.rows_written == 3, "the first stream's 3")
    await writer.stop()
    await log.js.delete_stream("TRAJ")  # made again: sequences start at 1 again
    await provision(log.js, log.settings)

    second = [folded("r", f"new{i}") for i in range(3)]
    await publisher.publish_many(second)
    writer = start(log, publisher, tmp_path, FAST)
    await writer.until(lambda w: w.stats.rows_written == 3, "the new stream's 3")
    await writer.stop()

    assert sorted(shard_ids(tmp_path)) == sorted(t.trajectory_id for t in first + second)


# -- SIGKILL ---------------------------------------------------------------------------------

LAUNCHER = (
    "import logging, sys; logging.basicConfig(level='INFO', format='%(asctime)s %(message)s');"
    "from pydantic_settings import CliApp;"
    "from turnstream.services.shard_writer import ShardWriterCommand;"
    "CliApp.run(ShardWriterCommand, cli_args=sys.argv[1:])"
)


def spawn_writer(url: str, data_dir: Path, log_file: Path) -> subprocess.Popen[bytes]:
    args = {
        "--log.url": url,
        "--data-dir": str(data_dir),
        "--shards.max-rows": "15",
        "--shards.max-age-s": "0.3",
        "--shards.ack-wait-s": "1.5",
        "--shards.fetch-timeout-s": "0.2",
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith("TURNSTREAM_")}
    with log_file.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-c", LAUNCHER, *(x for kv in args.items() for x in kv)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )


async def produce(publisher: JetStreamPublisher, batches: Sequence[list[TrajectoryReady]]) -> None:
    for batch in batches:
        await publisher.publish_many(batch)
        await asyncio.sleep(0.15)


def tail(logs: Sequence[Path]) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in logs if p.exists())


async def test_sigkill_at_random_points_loses_and_duplicates_nothing(
    log: Log, publisher: JetStreamPublisher, tmp_path: Path
) -> None:
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    trajectories = many(600, ("run-a", "run-b", "run-c"))
    expected = {t.trajectory_id for t in trajectories}
    producer = asyncio.create_task(
        produce(publisher, [trajectories[i : i + 20] for i in range(0, 600, 20)])
    )
    root = tmp_path / "shards"
    logs = [tmp_path / f"writer-{i}.log" for i in range(7)]
    try:
        for output in logs[:-1]:
            # Killed anywhere: starting up, reading the shards back, buffering, mid-write.
            proc = spawn_writer(log.server.url, tmp_path, output)
            await asyncio.sleep(rng.uniform(0.3, 2.5))
            proc.send_signal(signal.SIGKILL)
            await asyncio.to_thread(proc.wait)
        await producer
        proc = spawn_writer(log.server.url, tmp_path, logs[-1])
        try:
            # Recovered (its signal handlers are set), then everything gets in.
            await eventually(lambda: "ack floor" in logs[-1].read_text(), 30.0, "last writer up")
            await eventually(
                lambda: len(set(shard_ids(root))) == len(expected), 40.0, "every trajectory"
            )
        finally:
            proc.send_signal(signal.SIGTERM)
            returncode = await asyncio.to_thread(proc.wait, 30)
    except BaseException:
        producer.cancel()
        print(f"seed {seed}; writer output:\n{tail(logs)}")
        raise

    counts = collections.Counter(shard_ids(root))
    twice = {i: n for i, n in counts.items() if n > 1}
    assert not twice, f"seed {seed}: written more than once: {sorted(twice)[:10]}"
    assert set(counts) == expected, f"seed {seed}: lost {sorted(expected - set(counts))[:10]}"
    assert returncode == 0, tail(logs[-1:])
    assert "shard writer stopped" in logs[-1].read_text()
    assert not list(root.glob("run=*/.*.tmp"))
