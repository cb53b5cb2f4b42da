"""The sink as a Ray actor, and the shards through Ray Data, on a local Ray runtime.

One runtime for the module (starting Ray takes seconds). The actor must hand out exactly the
batches a plain ``TrainerSink`` makes from the same data, tensors equal after the trip through
Ray's object store, and its ``commit`` must acknowledge on the live feed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tensordict import TensorDict

from consumers import fold
from schemas.events import TrajectoryReady
from schemas.shards import trajectories_to_table
from shardstore import open_shards_dataset
from tests.conftest import FAST_LOG, Log
from tests.helpers.sessions import append_only, session_events
from tests.integration.test_sink import fold_into_traj, live_sink, sessions
from trainer_sink import (
    AssemblySettings,
    BatchCommitted,
    BatchingSettings,
    LiveSourceSettings,
    OfflineSource,
    ShardFilter,
    TrainerSink,
    non_tensor_values,
)
from trainer_sink.ray_actor import LiveSpec, OfflineSpec, SinkSpec, sink_actor

pytestmark = pytest.mark.integration

RUN_LIKE_A_NUMBER = "0042"  # would read as the int 42 under an inferred partitioning


@pytest.fixture(scope="module")
def ray_runtime() -> Iterator[Any]:
    import ray  # a dev dependency; imported here so collecting other tests does not load it

    ray.init(num_cpus=2, include_dashboard=False, ignore_reinit_error=True, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two runs in the shard writer's layout, and an unfinished shard that nobody may read."""
    root = tmp_path_factory.mktemp("shards")
    by_run = {
        "run-1": [t for s in sessions(14) for t in fold(s).trajectories],
        RUN_LIKE_A_NUMBER: [
            t
            for i in range(6)
            for t in fold(
                session_events(
                    append_only(1 + i % 3),
                    run=RUN_LIKE_A_NUMBER,
                    session=f"n{i}",
                    group="n",
                    final_reward=float(i % 2 == 0),
                )
            ).trajectories
        ],
    }
    for run, trajectories in by_run.items():
        _write_shard(
            root / f"run={run}" / "part-000000000001-000000000099-ab.parquet", trajectories
        )
    (
        root / f"run={RUN_LIKE_A_NUMBER}" / ".part-000000000100-000000000120-cd.parquet.tmp"
    ).write_bytes(b"half a shard")
    return root


def _write_shard(path: Path, trajectories: list[TrajectoryReady]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(trajectories_to_table(list(enumerate(trajectories, start=1))), path)


def assert_same_tensors(got: TensorDict, want: TensorDict) -> None:
    keys = sorted(map(str, want.keys()))  # not `in want`: that iterates the batch
    assert sorted(got.keys()) == keys and got.batch_size == want.batch_size
    for key in keys:
        a, b = got.get(key), want.get(key)
        if not isinstance(b, torch.Tensor):
            assert non_tensor_values(got, key) == non_tensor_values(want, key), key
        elif b.is_nested:
            assert a.is_nested and a.dtype == b.dtype, key
            for x, y in zip(a.unbind(), b.unbind(), strict=True):
                _assert_equal(x, y, key)
        else:
            _assert_equal(a, b, key)


def _assert_equal(a: torch.Tensor, b: torch.Tensor, key: str) -> None:
    """Equal, NaN where NaN (the per-token sampling of rows that recorded none)."""
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=key)


def test_ray_data_reads_the_shards_as_pyarrow_does(ray_runtime: Any, shards: Path) -> None:
    from ray.data.datasource import Partitioning, PartitionStyle, PathPartitionFilter

    want = open_shards_dataset(str(shards)).to_table().sort_by("trajectory_id")
    assert want.num_rows == 20

    def read(**kwargs: Any) -> pa.Table:
        dataset = ray_runtime.data.read_parquet(str(shards), **kwargs)
        return pa.concat_tables(ray_runtime.get(dataset.to_arrow_refs())).sort_by("trajectory_id")

    # Ray's default hive partitioning keeps partition values as strings; stating the type and
    # ignoring the paths altogether read the same.
    for got in (
        read(),
        read(partitioning=Partitioning(PartitionStyle.HIVE, field_types={"run": str})),
        read(partitioning=None),
    ):
        assert got.column("run").type == pa.string()
        assert set(got.column("run").to_pylist()) == {"run-1", RUN_LIKE_A_NUMBER}
        for name in want.column_names:  # the .tmp shard was skipped: same rows, same values
            assert got.column(name).to_pylist() == want.column(name).to_pylist(), name

    one_run = read(
        partition_filter=PathPartitionFilter.of(lambda run: run["run"] == RUN_LIKE_A_NUMBER)
    )
    assert set(one_run.column("run").to_pylist()) == {RUN_LIKE_A_NUMBER}
    assert one_run.num_rows == 6


async def test_the_actor_over_shards_returns_the_plain_sinks_batches(
    ray_runtime: Any, shards: Path
) -> None:
    where = ShardFilter(min_reward=1.0)  # the filter reaches the actor's source
    batching = BatchingSettings(batch_size=3)
    jagged = AssemblySettings(layout="jagged")  # nested tensors must cross Ray as well
    plain = TrainerSink(OfflineSource(str(shards), where), batching, jagged)
    want = [batch async for batch in plain]
    assert [b.tensors.batch_size[0] for b in want] == [3, 3, 3, 1]  # 7 + 3 rewarded rows

    actor = sink_actor(SinkSpec(OfflineSpec(str(shards), where), batching, jagged))
    got: list[TensorDict] = []
    while (item := await actor.next_batch.remote()) is not None:
        token, tensors = item
        got.append(tensors)
        await actor.commit.remote(token)
    assert [list(t["trajectory_id"]) for t in got] == [b.trajectory_ids for b in want]
    for tensors, batch in zip(got, want, strict=True):
        assert_same_tensors(tensors, batch.tensors)

    assert await actor.next_batch.remote() is None  # stays at the end
    stats = await actor.stats.remote()
    assert stats.exhausted and stats.held == 0 and stats.sink.committed == 4
    with pytest.raises(BatchCommitted):
        await actor.commit.remote(token)  # the last token, once more
    await actor.close.remote()
    ray_runtime.kill(actor)


async def test_the_actor_over_the_live_feed_returns_the_plain_sinks_batches_and_commits(
    ray_runtime: Any, log: Log
) -> None:
    await fold_into_traj(log, sessions(24))
    batching = BatchingSettings(batch_size=6)
    async with live_sink(log, batching) as plain:  # durable "trainer"
        want = []
        async for batch in plain:
            want.append(batch)
            await plain.commit(batch)
            if len(want) == 4:
                break

    settings = LiveSourceSettings(durable="ray", ack_wait_s=30.0)
    spec = SinkSpec(LiveSpec(log.server.url, settings, FAST_LOG), batching, wait_s=0.3)
    actor = sink_actor(spec, num_cpus=0)
    got = [await actor.next_batch.remote(timeout_s=20.0) for _ in range(4)]
    assert all(item is not None for item in got)
    held = [item for item in got if item is not None]
    assert [list(t["trajectory_id"]) for _, t in held] == [b.trajectory_ids for b in want]
    for (_, tensors), batch in zip(held, want, strict=True):
        assert_same_tensors(tensors, batch.tensors)

    info = await log.js.consumer_info("TRAJ", "ray")
    assert info.num_ack_pending == 24  # delivered, held by the actor, not acknowledged yet

    # A released batch is delivered again at once, under a new token.
    released_token, released = held.pop()
    await actor.release.remote(released_token)
    again = await actor.next_batch.remote(timeout_s=20.0)
    assert again is not None and again[0] != released_token
    assert sorted(again[1]["trajectory_id"]) == sorted(released["trajectory_id"])

    for token, _ in [*held, again]:
        await actor.commit.remote(token)
    info = await log.js.consumer_info("TRAJ", "ray")
    assert info.num_ack_pending == 0 and info.num_pending == 0

    # Nothing more on the feed: a bounded wait comes back empty, the source not exhausted.
    assert await actor.next_batch.remote(timeout_s=0.5) is None
    assert not (await actor.stats.remote()).exhausted
    await actor.close.remote()
    ray_runtime.kill(actor)
