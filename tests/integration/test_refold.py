"""``turnstream refold`` (issue 11, point 3): a run's stored events folded again as a real
process, against the trajectories the real fold worker made of the same events."""

from __future__ import annotations

import re

import msgspec
import pytest

from eventlog import JetStreamImageStore
from schemas.codec import Codec
from schemas.events import SessionEvent, TrajectoryReady, TurnCompleted
from schemas.images import content_digest, image_parts, part_digest
from schemas.routing import route
from tests.conftest import Log
from tests.helpers.image_sessions import png, put_images, with_images
from tests.helpers.sessions import RUN, append_only, reward, session_events
from tests.helpers.streams import message_count, publish_events, stream_payloads
from tests.helpers.waiting import eventually
from tests.integration.test_fold_worker import running, until_trajectories
from tests.integration.test_replay import run_cli

pytestmark = pytest.mark.integration

CODEC = Codec()
GOOD = 4
TURNS = 3
SHOWN = [png(5), png(6)]


async def publish_run(log: Log) -> tuple[list[SessionEvent], int]:
    """Run-1: good sessions with rewards, a per-turn one, one with a conflicting turn 0, one
    never closed, one whose close has no Msg-Id, one holding bytes that are no event. Returns
    its events and how many trajectories the worker folds from them."""
    good = [
        session_events(
            append_only(TURNS),
            session=f"good-{i}",
            final_reward=float(i),
            rewards=[reward(0.5, turn=1, session=f"good-{i}")],
        )
        for i in range(GOOD)
    ]
    good[0] = with_images(good[0], {0: SHOWN[0], 2: SHOWN[1]})  # a session that sees
    await put_images(await JetStreamImageStore.open(log.nc, log.settings), SHOWN)
    stepwise = session_events(
        append_only(4), session="stepwise", metadata={"fold": {"per_turn": True}}
    )
    events = [e for s in good for e in s] + stepwise
    await publish_events(log.nc, events)
    conflicted = session_events(append_only(2), session="conflicted")
    await publish_events(log.nc, conflicted[:-1])
    turn0 = next(e for e in conflicted if isinstance(e, TurnCompleted) and e.turn == 0)
    forged = msgspec.structs.replace(turn0, completion_ids=turn0.completion_ids[::-1].copy())
    await log.js.publish(
        route(forged).subject, CODEC.encode(forged), headers={"Nats-Msg-Id": "elsewhere"}
    )
    await publish_events(log.nc, conflicted[-1:])
    await publish_events(log.nc, session_events(append_only(2), session="open", close=False))
    anonymous = session_events(append_only(1), session="anonymous")
    await publish_events(log.nc, anonymous[:-1])
    await log.js.publish(route(anonymous[-1]).subject, CODEC.encode(anonymous[-1]))
    poisoned = session_events(append_only(1), session="poisoned")
    await publish_events(log.nc, poisoned[:-1])
    await log.js.publish(
        f"ts.ev.{RUN}.poisoned.reward", b"\xc1", headers={"Nats-Msg-Id": f"{RUN}.poisoned.r"}
    )
    await publish_events(log.nc, poisoned[-1:])
    return events + conflicted, GOOD + 4 + 1


async def raw_by_id(log: Log, run: str) -> dict[str, bytes]:
    """Run ``run``'s trajectories in TRAJ, as stored, by id."""
    return {
        CODEC.decode_trajectory(data, subject).trajectory_id: data
        for _, subject, data in await stream_payloads(log.js, "TRAJ")
        if subject == f"ts.traj.{run}"
    }


async def by_id(log: Log, run: str) -> dict[str, TrajectoryReady]:
    return {
        tid: CODEC.decode_trajectory(data, tid) for tid, data in (await raw_by_id(log, run)).items()
    }


async def test_a_refold_is_byte_identical_to_the_workers_fold_under_the_new_run(log: Log) -> None:
    _, n = await publish_run(log)
    async with running(log) as (worker, _):
        await until_trajectories(log, n)
        await eventually(lambda: worker.stats.sessions_folded == GOOD + 2, 10, "sessions folded")
    original = await raw_by_id(log, RUN)
    assert len(original) == n

    done = await run_cli("refold", "--log.url", log.server.url, "--run", RUN, "--into", "run-1b")

    assert done.returncode == 0, done.stderr
    assert f"{GOOD + 2} sessions folded, {n} trajectories published to TRAJ (ts.traj.run-1b)" in (
        done.stderr
    )
    assert "3 sessions skipped" in done.stderr
    assert re.search(r"open\s+│ not closed", done.stderr)
    assert re.search(r"anonymous\s+│ close dead-lettered by the fold \(no_msg_id\)", done.stderr)
    assert re.search(r"poisoned\s+│ dead-lettered by the fold \(undecodable\)", done.stderr)
    refolded = await raw_by_id(log, "run-1b")
    assert sorted(refolded) == sorted(tid.replace(f"{RUN}/", "run-1b/", 1) for tid in original)
    for tid, data in refolded.items():
        trajectory = CODEC.decode(data)
        assert isinstance(trajectory, TrajectoryReady) and trajectory.run == "run-1b"
        back = msgspec.structs.replace(
            trajectory, run=RUN, trajectory_id=tid.replace("run-1b/", f"{RUN}/", 1)
        )
        assert CODEC.encode(back) == original[back.trajectory_id]  # byte for byte
    seeing = CODEC.decode(refolded["run-1b/good-0/0"])  # its images where they were
    assert isinstance(seeing, TrajectoryReady)
    assert [part_digest(p) for p in image_parts(seeing.messages)] == [
        content_digest(d) for d in SHOWN
    ]
    conflicted = CODEC.decode(refolded["run-1b/conflicted/0"])
    assert isinstance(conflicted, TrajectoryReady)
    assert conflicted.metadata["conflicting_turns"] == 1
    # Msg-Id = trajectory id: what the shard writer and sinks deduplicate by.
    msg = await log.js.get_msg("TRAJ", subject="ts.traj.run-1b", direct=True)
    assert msg.headers is not None and msg.headers["Nats-Msg-Id"].startswith("run-1b/")

    # A run TRAJ already holds is refused: two folds would mix.
    before = await message_count(log.js, "TRAJ")
    again = await run_cli("refold", "--log.url", log.server.url, "--run", RUN, "--into", "run-1b")
    assert again.returncode == 1
    assert f"TRAJ already holds {n} trajectories of run run-1b" in again.stderr
    same = await run_cli("refold", "--log.url", log.server.url, "--run", RUN, "--into", RUN)
    assert same.returncode == 1 and "is the run being refolded" in same.stderr
    assert await message_count(log.js, "TRAJ") == before


async def test_per_turn_mode_gives_one_sample_per_turn_into_a_fresh_run(log: Log) -> None:
    await publish_run(log)

    done = await run_cli(
        "refold", "--log.url", log.server.url, "--run", RUN, "--mode", "per_turn",
        "--sessions", "good-0,good-2,open,nobody",
    )  # fmt: skip

    assert done.returncode == 0, done.stderr
    printed = re.search(r"refolding run run-1 into run (run-1-refold-\d+)", done.stderr)
    assert printed is not None, done.stderr
    into = printed.group(1)
    samples = await by_id(log, into)
    assert sorted(samples) == [f"{into}/good-{i}/{t}" for i in (0, 2) for t in range(TURNS)]
    assert all(s.num_turns == 1 and s.run == into for s in samples.values())
    assert [samples[f"{into}/good-0/{t}"].metadata["first_turn"] for t in range(TURNS)] == [0, 1, 2]
    assert "2 sessions folded, 6 trajectories" in done.stderr
    assert re.search(r"nobody\s+│ no events in run run-1", done.stderr)
    assert re.search(r"open\s+│ not closed", done.stderr)
    assert "2 sessions skipped" in done.stderr

    nothing = await run_cli("refold", "--log.url", log.server.url, "--run", "nobody-here")
    assert nothing.returncode == 1 and "run nobody-here has no sessions in EVENTS" in nothing.stderr
