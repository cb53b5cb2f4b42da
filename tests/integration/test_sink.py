"""The trainer sink on a real nats-server: live commit semantics, offline shards, replay."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import threading
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from tensordict import TensorDict
from torch.utils.data import DataLoader

from consumers import FoldWorker, fold
from eventlog import JetStreamPublisher, connect
from schemas.errors import EventLogUnavailable
from schemas.events import SessionEvent, TrajectoryReady
from schemas.shards import trajectories_to_table
from tests.conftest import FAST_LOG, Log
from tests.helpers.sessions import append_only, session_events
from tests.helpers.streams import message_count, trajectories
from trainer_sink.config import AssemblySettings, BatchingSettings, LiveSourceSettings
from trainer_sink.errors import BatchCommitted, BatchError
from trainer_sink.sink import Batch, SinkDataset, SyncSink, TrainerSink
from trainer_sink.sources import LiveSource, OfflineSource, ReplaySource, ShardFilter

pytestmark = pytest.mark.integration


def sessions(n: int) -> list[list[SessionEvent]]:
    return [
        session_events(
            append_only(1 + i % 4), session=f"s{i:03d}", group=f"g{i // 4}", final_reward=i % 2
        )
        for i in range(n)
    ]


async def fold_into_traj(log: Log, planned: list[list[SessionEvent]]) -> None:
    """Publish the sessions and run a fold worker until TRAJ holds all their trajectories, in
    the order its concurrent folds finish (not necessarily the sessions' order)."""
    stored = await message_count(log.js, "TRAJ")
    pub = await JetStreamPublisher(log.nc).start()
    await pub.publish_many([e for s in planned for e in s])
    worker = FoldWorker(log.js, pub)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    for _ in range(600):
        if worker.stats.sessions_folded >= len(planned):
            break
        await asyncio.sleep(0.05)
    stop.set()
    await task
    await pub.close()
    assert await message_count(log.js, "TRAJ") == stored + len(planned)


@contextlib.asynccontextmanager
async def live_sink(
    log: Log,
    batching: BatchingSettings,
    ack_wait_s: float = 2.0,
    assembly: AssemblySettings | None = None,
    **source: Any,
) -> AsyncIterator[TrainerSink]:
    """A sink on its own connection; ``source``: LiveSourceSettings fields to change."""
    nc = await connect(log.server.url, FAST_LOG, name="trainer")
    pub = await JetStreamPublisher(nc).start()
    fields: dict[str, Any] = {"durable": "trainer", "fetch_batch": 32, **source}
    settings = LiveSourceSettings(ack_wait_s=ack_wait_s, **fields)
    sink = TrainerSink(LiveSource(nc.jetstream(), pub, settings), batching, assembly, wait_s=0.3)
    try:
        yield sink
    finally:
        await sink.close()
        await pub.close()
        with contextlib.suppress(OSError):
            await nc.close()


async def take(sink: TrainerSink, n: int, *, commit: bool) -> list[Batch]:
    batches = []
    async for batch in sink:
        batches.append(batch)
        if commit:
            await sink.commit(batch)
        if len(batches) == n:
            break
    return batches


async def test_an_uncommitted_batch_comes_again_after_a_crash_and_a_committed_one_never(
    log: Log,
) -> None:
    await fold_into_traj(log, sessions(200))
    batching = BatchingSettings(policy="count", batch_size=20)

    # A trainer takes two batches and dies before committing them.
    nc = await connect(log.server.url, FAST_LOG, name="doomed")
    pub = await JetStreamPublisher(nc).start()
    doomed = TrainerSink(
        LiveSource(nc.jetstream(), pub, LiveSourceSettings(durable="trainer", ack_wait_s=2.0)),
        batching,
        wait_s=0.3,
    )
    lost = await take(doomed, 2, commit=False)
    lost_ids = {tid for batch in lost for tid in batch.trajectory_ids}
    assert len(lost_ids) == 40
    await nc.close()  # no commit, no goodbye: a crash as the server sees it

    async with live_sink(log, batching) as sink:
        batches = await take(sink, 10, commit=True)
    seen = Counter(tid for batch in batches for tid in batch.trajectory_ids)
    assert set(seen.values()) == {1} and len(seen) == 200
    assert lost_ids <= set(seen)  # the uncommitted ones came again
    for batch in batches:
        assert batch.tensors.batch_size[0] == 20
        assert batch.tensors["responses"].dtype.is_floating_point is False

    async with live_sink(log, batching) as sink:
        assert await asyncio.wait_for(_next_or_none(sink), timeout=4.0) is None
    info = await log.js.consumer_info("TRAJ", "trainer")
    assert info.num_ack_pending == 0 and info.num_pending == 0


async def _next_or_none(sink: TrainerSink) -> Batch | None:
    try:
        async with asyncio.timeout(3.0):
            return await anext(sink)
    except TimeoutError:
        return None


async def test_a_released_batch_is_delivered_again_at_once(log: Log) -> None:
    await fold_into_traj(log, sessions(12))
    async with live_sink(log, BatchingSettings(batch_size=6), ack_wait_s=60.0) as sink:
        [first] = await take(sink, 1, commit=False)
        await sink.release(first)
        again = await take(sink, 2, commit=True)
    assert set(first.trajectory_ids) <= {t for b in again for t in b.trajectory_ids}


async def test_closing_the_sink_hands_back_what_it_holds_for_the_next_trainer_at_once(
    log: Log,
) -> None:
    """A trainer that stops (not a crash) leaves nothing waiting out the 10-minute ack wait: its
    uncommitted batch, and the members of a group still incomplete, come to the next one now."""
    await fold_into_traj(log, sessions(6))  # g0: four sessions, g1: two (incomplete)
    batching = BatchingSettings(policy="groups", group_size=4, batch_size=1)
    async with live_sink(log, batching, ack_wait_s=600.0) as sink:
        [held] = await take(sink, 1, commit=False)
        while sink.batcher.pending < 2:  # g1's two members are in the batcher
            assert await asyncio.wait_for(_next_or_none(sink), timeout=10) is None
    count = BatchingSettings(policy="count", batch_size=6)
    async with live_sink(log, count, ack_wait_s=600.0) as sink:
        [again] = await asyncio.wait_for(take(sink, 1, commit=True), timeout=10)
    assert set(held.trajectory_ids) < set(again.trajectory_ids)
    assert len(set(again.trajectory_ids)) == 6


async def test_grpo_groups_on_the_live_feed_wait_for_every_member(log: Log) -> None:
    await fold_into_traj(log, sessions(16))  # groups g0..g3 of four sessions each
    batching = BatchingSettings(policy="groups", group_size=4, batch_size=1)
    async with live_sink(log, batching) as sink:
        batches = await take(sink, 4, commit=True)
    for batch in batches:
        uids = set(batch.tensors["uid"])
        assert len(uids) == 1 and batch.tensors.batch_size[0] == 4


def _write_shard(path: Path, trajectories: list[TrajectoryReady]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    table = trajectories_to_table(list(enumerate(trajectories, start=1)))
    pq.write_table(table, path)


async def test_offline_shards_with_filters_become_the_same_batches(tmp_path: Path) -> None:
    trajectories = [t for s in sessions(30) for t in fold(s).trajectories]
    other_run = [
        t
        for i in range(4)
        for t in fold(session_events(append_only(2), run="other", session=f"o{i}")).trajectories
    ]
    _write_shard(tmp_path / "run=run-1" / "part-a.parquet", trajectories)
    _write_shard(tmp_path / "run=other" / "part-b.parquet", other_run)

    rewarded = ShardFilter(runs=["run-1"], min_reward=1.0)
    sink = TrainerSink(OfflineSource(str(tmp_path), rewarded), BatchingSettings(batch_size=4))
    batches = [batch async for batch in sink]
    got = [tid for batch in batches for tid in batch.trajectory_ids]
    want = [t.trajectory_id for t in trajectories if t.reward == 1.0]
    assert sorted(got) == sorted(want) and len(got) == 15
    assert [b.tensors.batch_size[0] for b in batches] == [4, 4, 4, 3]  # the last one partial
    everything = TrainerSink(OfflineSource(str(tmp_path)), BatchingSettings(batch_size=100))
    assert sum([len(b.trajectory_ids) async for b in everything]) == 34


async def test_a_training_loop_gets_batches_in_reused_memory_equal_to_fresh_ones(
    tmp_path: Path,
) -> None:
    """Each batch trained on and dropped: the ones after the second are written into the
    memory of the ones before (trainer_sink.buffers), and hold what fresh memory would."""
    trajectories = [t for s in sessions(30) for t in fold(s).trajectories]
    _write_shard(tmp_path / "run=run-1" / "part-a.parquet", trajectories)

    async def loop(reuse: bool) -> tuple[list[dict[str, list[Any]]], TrainerSink]:
        settings = AssemblySettings(reuse_memory=reuse)
        sink = TrainerSink(OfflineSource(str(tmp_path)), BatchingSettings(batch_size=4), settings)
        seen = []
        async for batch in sink:  # the loop's variable holds a batch while the next is made
            seen.append({k: batch.tensors[k].tolist() for k in ("input_ids", "rm_scores")})
        return seen, sink

    reused, sink = await loop(True)
    fresh, _ = await loop(False)
    assert reused == fresh and len(reused) == 8
    assert sink._buffers is not None and sink._buffers.reused >= 8 * 5


async def test_replay_reads_a_traj_sequence_range(log: Log) -> None:
    await fold_into_traj(log, sessions(10))
    sink = TrainerSink(ReplaySource(log.js, 3, 7), BatchingSettings(batch_size=10))
    [batch] = [b async for b in sink]
    in_range = [t for seq, t in enumerate(await trajectories(log.js), start=1) if 3 <= seq <= 7]
    assert batch.trajectory_ids == [t.trajectory_id for t in in_range]
    with pytest.raises(ValueError, match="replay range"):
        ReplaySource(log.js, 5, 4)


def _as_is(batch: TensorDict) -> TensorDict:
    return batch


async def test_the_sync_iterator_and_the_dataset_commit_like_the_async_sink(log: Log) -> None:
    await fold_into_traj(log, sessions(20))
    url = log.server.url

    def make(durable: str) -> Callable[[], Awaitable[TrainerSink]]:
        async def make_sink() -> TrainerSink:
            settings = LiveSourceSettings(durable=durable, ack_wait_s=2.0)
            source = await LiveSource.connect(url, settings, log_settings=FAST_LOG)
            return TrainerSink(source, BatchingSettings(batch_size=5), wait_s=0.3)

        return make_sink

    def train_sync() -> list[str]:
        seen = []
        with SyncSink(make("sync")) as sink:
            for batch in sink:
                seen += batch.trajectory_ids
                sink.commit(batch)
                if len(seen) == 20:
                    break
        return seen

    def train_with_a_dataloader() -> list[str]:
        loader = DataLoader(SinkDataset(make("loader")), batch_size=None, collate_fn=_as_is)
        seen = []
        for tensors in loader:
            seen += list(tensors["trajectory_id"])
            if len(seen) == 20:
                break
        return seen

    assert len(set(await asyncio.to_thread(train_sync))) == 20
    assert len(set(await asyncio.to_thread(train_with_a_dataloader))) == 20
    sync_info = await log.js.consumer_info("TRAJ", "sync")
    assert sync_info.num_ack_pending == 0 and sync_info.num_pending == 0
    # The dataloader committed every batch it moved past; the last one it yielded was not
    # followed by another request, so it is committed by the iterator's end or redelivered.
    loader_info = await log.js.consumer_info("TRAJ", "loader")
    assert loader_info.num_pending == 0 and loader_info.num_ack_pending <= 5


async def test_offline_filters_on_weight_version_and_time(tmp_path: Path) -> None:
    trajectories = [t for s in sessions(12) for t in fold(s).trajectories]  # 1-4 turns each
    _write_shard(tmp_path / "run=run-1" / "part-a.parquet", trajectories)

    async def ids(where: ShardFilter) -> set[str]:
        sink = TrainerSink(OfflineSource(str(tmp_path), where), BatchingSettings(batch_size=50))
        return {tid async for batch in sink for tid in batch.trajectory_ids}

    early = await ids(ShardFilter(max_weight_version=1))  # turn t is made by version t
    assert early == {t.trajectory_id for t in trajectories if t.max_weight_version <= 1}
    assert 0 < len(early) < len(trajectories)
    late = await ids(ShardFilter(min_weight_version=1))
    assert late == {t.trajectory_id for t in trajectories if t.min_weight_version >= 1} == set()
    epoch = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)  # the test events are made at time 0
    assert await ids(ShardFilter(until=epoch)) == {t.trajectory_id for t in trajectories}
    assert await ids(ShardFilter(since=epoch + dt.timedelta(seconds=1))) == set()


# -- flow control: the live window (max_ack_pending) must never wedge the sink -----------------


async def publish_trajectories(log: Log, samples: list[TrajectoryReady]) -> None:
    """Straight into TRAJ, in this order (as fold workers finishing at different times would)."""
    pub = await JetStreamPublisher(log.nc).start()
    for sample in samples:
        await pub.publish(sample)
    await pub.close()


def interleaved_groups(groups: int, size: int) -> list[TrajectoryReady]:
    """``groups`` complete GRPO groups whose members arrive a0 b0 c0 a1 b1 c1 ..."""
    by_group = [
        [
            fold(session_events(append_only(1), session=f"s{g}-{m}", group=f"g{g}")).trajectories[0]
            for m in range(size)
        ]
        for g in range(groups)
    ]
    return [member for members in zip(*by_group, strict=True) for member in members]


async def test_a_token_budget_larger_than_the_window_holds_still_makes_batches(
    log: Log,
) -> None:
    await fold_into_traj(log, sessions(24))
    batching = BatchingSettings(policy="tokens", token_budget=100_000)
    async with live_sink(log, batching, max_ack_pending=8, fetch_batch=8) as sink:
        # 8 held are far under the budget, and no 9th comes before a commit: a batch of 8.
        batches = await asyncio.wait_for(take_all(sink, 24), 30)
    assert [b.tensors.batch_size[0] for b in batches] == [8, 8, 8]


async def take_all(sink: TrainerSink, n: int) -> list[Batch]:
    """Committed batches until ``n`` trajectories were seen."""
    batches: list[Batch] = []
    async for batch in sink:
        batches.append(batch)
        await sink.commit(batch)
        if sum(len(b.trajectory_ids) for b in batches) >= n:
            break
    return batches


async def test_groups_interleaved_past_the_window_are_warned_of_and_released(
    log: Log, caplog: pytest.LogCaptureFixture
) -> None:
    await publish_trajectories(log, interleaved_groups(3, 4))  # a0 b0 c0 a1 ... c3
    batching = BatchingSettings(
        policy="groups",
        group_size=4,
        batch_size=1,
        group_timeout_s=1.0,
        incomplete_groups="release",
    )
    with caplog.at_level("WARNING", logger="trainer_sink.sink"):
        async with live_sink(log, batching, max_ack_pending=8, fetch_batch=8) as sink:
            batches = await asyncio.wait_for(take_all(sink, 12), 30)
    assert any("the live window is full" in r.getMessage() for r in caplog.records)
    seen = Counter(t for b in batches for t in b.trajectory_ids)
    assert len(seen) == 12 and set(seen.values()) == {1}  # released in parts, none lost


async def test_samples_that_do_not_fit_the_settings_are_handed_back_not_stranded(
    log: Log,
) -> None:
    await fold_into_traj(log, sessions(4))
    strict = AssemblySettings(max_response_len=1, truncate=False)
    async with live_sink(log, BatchingSettings(batch_size=4), 60.0, strict) as sink:
        with pytest.raises(BatchError, match="max_response_len"):
            await take(sink, 1, commit=True)
    # Handed back: delivered again at once, not after the 60 s ack wait.
    async with live_sink(log, BatchingSettings(batch_size=4), 60.0) as sink:
        [batch] = await asyncio.wait_for(take(sink, 1, commit=True), 10)
    assert len(batch.trajectory_ids) == 4


async def test_a_commit_the_log_did_not_confirm_can_be_made_again(log: Log) -> None:
    await fold_into_traj(log, sessions(4))
    async with live_sink(log, BatchingSettings(batch_size=4), ack_timeout_s=0.5) as sink:
        [batch] = await take(sink, 1, commit=False)
        log.server.pause()  # SIGSTOP: the acks get no answer
        try:
            with pytest.raises(EventLogUnavailable, match="commit again"):
                await sink.commit(batch)
        finally:
            log.server.resume()
        await sink.commit(batch)  # the retry is confirmed
        with pytest.raises(BatchCommitted):
            await sink.commit(batch)
    info = await log.js.consumer_info("TRAJ", "trainer")
    assert info.num_ack_pending == 0 and info.num_pending == 0


async def test_a_recorded_commit_stands_when_the_server_confirms_no_ack(log: Log) -> None:
    # After a nats-server restart the server answered no ack of a delivery it had delivered
    # again (the soak, 2026-11-26): the trainer retried that commit until it gave up. The record
    # is the commit, so the commit returns; the redelivery is acked on arrival, never handed out.
    await fold_into_traj(log, sessions(4))
    async with live_sink(log, BatchingSettings(batch_size=4), ack_wait_s=1.0) as sink:
        [batch] = await take(sink, 1, commit=False)
        source = sink.source
        assert isinstance(source, LiveSource)
        real_ack = source.loop.ack

        calls: list[float | None] = []

        async def unanswered(deliveries: Any, *, confirm_s: float | None = None) -> None:
            # Test double for the server's silence: the acks are sent nowhere (lost), the
            # deliveries no longer kept alive, as the loop's own ack does first.
            calls.append(confirm_s)
            source.loop.drop(deliveries)
            if confirm_s is not None:
                raise EventLogUnavailable("no answer")

        source.loop.ack = unanswered  # type: ignore[method-assign]
        try:
            await sink.commit(batch)
        finally:
            source.loop.ack = real_ack  # type: ignore[method-assign]
        assert source.stats.ack_unconfirmed == 4
        assert calls[0] is not None and calls[1:] == [None] * 3  # waited for one answer only
        with pytest.raises(BatchCommitted):
            await sink.commit(batch)
        handed: list[object] = []
        deadline = asyncio.get_running_loop().time() + 10.0
        while source.stats.already_committed < 4:
            assert asyncio.get_running_loop().time() < deadline, source.stats
            handed += await source.receive(8, 0.5) or []
        assert handed == []
    info = await log.js.consumer_info("TRAJ", "trainer")
    assert info.num_pending == 0


async def test_the_dataset_commits_before_it_fetches_so_one_batch_may_fill_the_window(
    log: Log,
) -> None:
    await fold_into_traj(log, sessions(20))
    url = log.server.url

    async def make_sink() -> TrainerSink:
        settings = LiveSourceSettings(durable="tight", max_ack_pending=5, fetch_batch=5)
        source = await LiveSource.connect(url, settings, log_settings=FAST_LOG)
        return TrainerSink(source, BatchingSettings(batch_size=5), wait_s=0.3)

    seen: list[str] = []

    def train() -> None:
        for tensors in SinkDataset(make_sink):
            seen.extend(tensors["trajectory_id"])
            if len(seen) == 20:
                break

    # A daemon thread: were the dataset to wedge, the test fails instead of hanging the run.
    trainer = threading.Thread(target=train, daemon=True)
    trainer.start()
    await asyncio.to_thread(trainer.join, 30)
    assert not trainer.is_alive(), f"the dataset wedged after {len(seen)} trajectories"
    assert len(set(seen)) == 20


class _AcksForgotten(LiveSource):
    """Test double: the commit's acks never reach the consumer's state, as when nats-server is
    SIGKILLed within milliseconds of confirming them (measured by the chaos soak: the server
    writes consumer state asynchronously). The server itself stays real."""

    async def ack(self, items: Any) -> None:
        assert self._ledger is not None
        await self._ledger.record([i.seq for i in items])
        self.loop.drop(i.handle for i in items)  # no ack: redelivered after ack_wait_s


async def test_a_committed_batch_whose_acks_the_server_forgot_is_never_delivered_again(
    log: Log,
) -> None:
    await fold_into_traj(log, sessions(4))
    nc = await connect(log.server.url, FAST_LOG, name="sink")
    pub = await JetStreamPublisher(nc).start()
    settings = LiveSourceSettings(durable="forgetful", ack_wait_s=1.0)
    try:
        source = await _AcksForgotten(nc.jetstream(), pub, settings).start()
        sink = TrainerSink(source, BatchingSettings(batch_size=4), wait_s=0.3)
        [batch] = await take(sink, 1, commit=True)
        assert len(batch.trajectory_ids) == 4
        # A new source on the same durable (a restarted trainer) reads the commit back.
        again = await LiveSource(nc.jetstream(), pub, settings).start()
        got: list[object] = []
        deadline = asyncio.get_running_loop().time() + 5.0
        while again.stats.already_committed < 4:
            assert asyncio.get_running_loop().time() < deadline, again.stats
            got += await again.receive(8, 0.5) or []
        assert got == []  # redelivered by the server, never handed to the trainer
        await again.close()
        await sink.close()
        # Those acks are not confirmed (a lost one means one more redelivery, dropped again):
        # the server applies them in its own time.
        deadline = asyncio.get_running_loop().time() + 5.0
        while True:
            info = await log.js.consumer_info("TRAJ", "forgetful")
            if info.num_ack_pending == 0 and info.num_pending == 0:
                break
            assert asyncio.get_running_loop().time() < deadline, info
            await asyncio.sleep(0.05)
    finally:
        await pub.close()
        await nc.close()
