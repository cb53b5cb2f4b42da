"""``turnstream replay`` (issue 11, point 2): a recording published again, as a real process,
into real nats-servers, folded by a real fold worker."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from consumers.recording import read_recording
from eventlog import connect, provision
from eventlog.server import NatsServer
from schemas.codec import Codec
from schemas.events import SessionEvent, TrajectoryReady, TurnCompleted
from schemas.routing import route
from tests.conftest import FAST_LOG, Log
from tests.helpers.sessions import RUN, append_only, reward, session_events
from tests.helpers.streams import message_count, publish_events, stream_payloads
from tests.integration.test_fold_worker import running, until_trajectories

pytestmark = pytest.mark.integration

CODEC = Codec()


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """A turnstream command as a real process; its messages unwrapped (rich wraps at COLUMNS)."""
    return subprocess.run(
        [sys.executable, "-m", "turnstream.cli", *args],
        capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, "COLUMNS": "1000"},
    )  # fmt: skip


async def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """A command as a real process, off the event loop (an in-process worker keeps running)."""
    return await asyncio.to_thread(cli, *args)


@pytest.fixture
async def fresh(tmp_path: Path) -> AsyncIterator[Log]:
    """A second, empty nats-server with its own store: the stack a recording is replayed into."""
    server = NatsServer(tmp_path / "fresh-nats").start()
    nc = await connect(server.url, FAST_LOG, name="fresh")
    js = nc.jetstream()
    await provision(js, FAST_LOG)
    try:
        yield Log(server, nc, js, FAST_LOG)
    finally:
        await nc.close()
        server.stop()


def workload() -> tuple[list[SessionEvent], int]:
    """A run's events (rewards, a per-turn session, a session left open) and how many
    trajectories the worker folds from them."""
    sessions = [
        session_events(
            append_only(3),
            session=f"good-{i}",
            final_reward=float(i),
            rewards=[reward(0.5, turn=1, session=f"good-{i}")],
        )
        for i in range(4)
    ]
    stepwise = session_events(
        append_only(4), session="stepwise", metadata={"fold": {"per_turn": True}}
    )
    left_open = session_events(append_only(2), session="left-open", close=False)
    return [e for s in sessions for e in s] + stepwise + left_open, 4 + 4


async def traj_by_id(log: Log) -> dict[str, bytes]:
    """Every trajectory in TRAJ, as stored, by its id."""
    found: dict[str, bytes] = {}
    for _, _, data in await stream_payloads(log.js, "TRAJ"):
        trajectory = CODEC.decode(data)
        assert isinstance(trajectory, TrajectoryReady)
        found[trajectory.trajectory_id] = data
    return found


async def fold_all(log: Log, n: int) -> dict[str, bytes]:
    async with running(log):
        await until_trajectories(log, n)
    return await traj_by_id(log)


async def test_a_replay_into_a_fresh_stack_folds_the_same_trajectories_and_twice_adds_nothing(
    log: Log, fresh: Log, tmp_path: Path
) -> None:
    # A different turn 0 stored under the same Msg-Id past the (here shortened) duplicate
    # window: the first one stored is folded, conflicting_turns counted; the replay keeps both.
    # The window is shortened before any Msg-Id is stored: nats-server forgets Msg-Ids on a timer
    # armed with the window in force at the first one (shortened later, CI once waited past 30 s).
    info = await log.js.stream_info("EVENTS")
    await log.js.update_stream(info.config.evolve(duplicate_window=0.2))
    events, n = workload()
    await publish_events(log.nc, events)
    conflicted = session_events(append_only(2), session="conflicted")
    await publish_events(log.nc, conflicted[:-1])
    turn0 = next(e for e in conflicted if isinstance(e, TurnCompleted) and e.turn == 0)
    forged = msgspec.structs.replace(turn0, completion_ids=turn0.completion_ids[::-1].copy())
    subject, msg_id = route(forged)
    # The timer fires late under load (CI once absorbed it after 0.5 s): publish until it is
    # stored (a duplicate ack stores nothing).
    for _ in range(100):
        await asyncio.sleep(0.3)
        ack = await log.js.publish(subject, CODEC.encode(forged), headers={"Nats-Msg-Id": msg_id})
        if not ack.duplicate:
            break
    else:
        raise AssertionError(f"Msg-Id {msg_id} still a duplicate 30 s past a 0.2 s window")
    # A message without a Msg-Id: no fold trusts it; the replay skips it.
    await log.js.publish(subject, CODEC.encode(forged))
    await publish_events(log.nc, conflicted[-1:])
    n += 1
    original = await fold_all(log, n)
    assert original[f"{RUN}/conflicted/0"] and len(original) == n
    recording = tmp_path / "run-1.parquet"
    assert (await run_cli("record", "--log.url", log.server.url, "--run", RUN, "-o",
                          str(recording))).returncode == 0  # fmt: skip

    async with running(fresh):
        done = await run_cli(
            "replay", str(recording), "--log.url", fresh.server.url, "--rate", "original"
        )
        assert done.returncode == 0, done.stderr
        await until_trajectories(fresh, n)
    recorded = read_recording(recording).events
    replayed = len(recorded) - 1
    assert f"into run {RUN}" in done.stderr
    assert f"{replayed} published, 0 duplicates absorbed" in done.stderr
    assert "1 without a Msg-Id (skipped)" in done.stderr
    # The fresh log holds the recorded events, in order, but the one without a Msg-Id.
    stored = [(s, d) for _, s, d in await stream_payloads(fresh.js, "EVENTS")]
    assert stored == [(e.subject, e.data) for e in recorded if e.msg_id]
    again = await traj_by_id(fresh)
    assert again == original  # byte for byte, conflicting_turns included
    folded = CODEC.decode(again[f"{RUN}/conflicted/0"])
    assert isinstance(folded, TrajectoryReady) and folded.metadata["conflicting_turns"] == 1

    # A second replay (and one into the log it was recorded from) stores nothing new.
    for target in (fresh, log):
        before = await message_count(target.js, "EVENTS")
        twice = await run_cli("replay", str(recording), "--log.url", target.server.url)
        assert twice.returncode == 0, twice.stderr
        assert f"0 published, 0 duplicates absorbed, {replayed} already stored" in twice.stderr
        assert await message_count(target.js, "EVENTS") == before
    assert await message_count(fresh.js, "TRAJ") == n


async def test_a_damaged_recording_is_refused_and_nothing_published(
    log: Log, fresh: Log, tmp_path: Path
) -> None:
    events, _ = workload()
    await publish_events(log.nc, events)
    recording = tmp_path / "run-1.parquet"
    assert (await run_cli("record", "--log.url", log.server.url, "--run", RUN, "-o",
                          str(recording))).returncode == 0  # fmt: skip
    table = pq.read_table(recording)
    datas = table.column("data").to_pylist()
    datas[5] = datas[5][:10] + bytes([datas[5][10] ^ 0x01]) + datas[5][11:]
    damaged = tmp_path / "damaged.parquet"
    pq.write_table(
        table.set_column(4, "data", pa.array(datas, pa.binary())).replace_schema_metadata(
            table.schema.metadata
        ),
        damaged,
    )

    done = await run_cli("replay", str(damaged), "--log.url", fresh.server.url)

    assert done.returncode == 1
    assert "SHA-256 does not match" in done.stderr and str(damaged) in done.stderr
    assert await message_count(fresh.js, "EVENTS") == 0
    missing = await run_cli("replay", str(tmp_path / "nope.parquet"), "--log.url", fresh.server.url)
    assert missing.returncode == 1 and "nope.parquet" in missing.stderr
    bad_rate = await run_cli("replay", str(recording), "--rate", "fast")
    assert bad_rate.returncode == 2 and "--rate takes max, original" in bad_rate.stderr


async def test_replay_into_a_new_run_lands_under_it_and_folds_the_same(
    log: Log, tmp_path: Path
) -> None:
    events, n = workload()
    await publish_events(log.nc, events)
    original = await fold_all(log, n)
    recording = tmp_path / "run-1.parquet"
    assert (await run_cli("record", "--log.url", log.server.url, "--run", RUN, "-o",
                          str(recording))).returncode == 0  # fmt: skip
    before = await stream_payloads(log.js, "EVENTS")

    async with running(log):
        done = await run_cli(
            "replay", str(recording), "--log.url", log.server.url, "--run", "run-2",
            "--rate", "2000",
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        await until_trajectories(log, 2 * n)
    assert "into run run-2" in done.stderr and f"{len(events)} published" in done.stderr

    # Every replayed event is run-2's: subject, Msg-Id, and the event itself.
    after = await stream_payloads(log.js, "EVENTS")
    assert after[: len(before)] == before
    new = after[len(before) :]
    assert len(new) == len(events)
    for (_, subject, data), event in zip(new, events, strict=True):
        moved = msgspec.structs.replace(event, run="run-2")
        assert (subject, data) == (route(moved).subject, CODEC.encode(moved))
    msg_ids = {e.msg_id for e in read_recording(recording).events}
    assert all(m and m.startswith(f"{RUN}.") for m in msg_ids)
    # Trajectories fold as they did, under the new run.
    refolded = {
        tid: data for tid, data in (await traj_by_id(log)).items() if tid.startswith("run-2/")
    }
    assert len(refolded) == n
    for tid, data in refolded.items():
        trajectory = CODEC.decode(data)
        assert isinstance(trajectory, TrajectoryReady) and trajectory.run == "run-2"
        back = msgspec.structs.replace(
            trajectory, run=RUN, trajectory_id=tid.replace("run-2/", f"{RUN}/", 1)
        )
        assert CODEC.encode(back) == original[back.trajectory_id]
    # Twice into the new run: nothing new.
    twice = await run_cli("replay", str(recording), "--log.url", log.server.url, "--run", "run-2")
    assert f"0 published, 0 duplicates absorbed, {len(events)} already stored" in twice.stderr


async def test_a_recording_with_undecodable_events_is_not_rewritten_into_a_new_run(
    log: Log, tmp_path: Path
) -> None:
    events, _ = workload()
    await publish_events(log.nc, events)
    await log.js.publish(
        f"ts.ev.{RUN}.junk.turn", b"\xc1 not msgpack", headers={"Nats-Msg-Id": f"{RUN}.junk.t"}
    )
    recording = tmp_path / "run-1.parquet"
    assert (await run_cli("record", "--log.url", log.server.url, "--run", RUN, "-o",
                          str(recording))).returncode == 0  # fmt: skip
    junk_seq = read_recording(recording).events[-1].seq
    before = await message_count(log.js, "EVENTS")

    done = await run_cli("replay", str(recording), "--log.url", log.server.url, "--run", "run-3")

    assert done.returncode == 1
    assert f"1 event(s) cannot be decoded (first: seq {junk_seq}" in done.stderr
    assert "nothing was published" in done.stderr
    assert await message_count(log.js, "EVENTS") == before
