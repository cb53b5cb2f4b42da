"""``turnstream demo`` learns, and its numbers are the log's and the shards' (issue 11, point 8).

One real ``turnstream demo --json`` process with a short config on a temporary data dir (the
tiny model taught its tool call there, a nats-server of its own, a few trainer steps); then the
summary it printed is checked against what it left behind: the Parquet shards, the reward
curve, and the EVENTS and TRAJ streams, read back by starting a nats-server on the demo's store.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
import pytest
from nats.js import JetStreamContext
from PIL import Image

from eventlog import connect, read_session
from eventlog.server import NatsServer
from schemas.codec import Codec
from schemas.events import SessionOpened, TrajectoryReady, TurnCompleted
from shardstore import FileShardStore, open_shards_dataset
from tests.conftest import FAST_LOG
from tests.helpers.streams import stream_payloads
from turnstream.demo.agents import WORD_TOOL_NAME, WORDS

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

RUN = "demo-e2e"
STEPS = 12
GROUP_SIZE = 6
GROUPS_PER_STEP = 4
# The demo's own learning settings, 12 steps instead of 30. Measured (2026-11-24): the reward of
# the last 5 steps beat the first 5 by +0.09, +0.12 and +0.14 with seeds 0, 1, 2; a faster
# setting (groups of 4, lr 3e-3) did not learn with seed 1 once the packages changed.
SHORT = (
    "--run", RUN, "--steps", str(STEPS), "--sink.group-size", str(GROUP_SIZE),
    "--sink.batch-size", str(GROUPS_PER_STEP), "--seed", "1",
)  # fmt: skip
KEYS = {
    "turns", "sessions", "trajectories", "forks", "shards", "batches", "steps",
    "reward_per_step", "logprob_max_abs_diff", "wall_s",
}  # fmt: skip


def demo(data_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "turnstream.cli", "demo", "--data-dir", str(data_dir), *args],
        capture_output=True, text=True, timeout=800, check=False,
        env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip


@dataclass(frozen=True)
class Demo:
    data_dir: Path
    summary: dict[str, Any]
    stderr: str

    @property
    def said(self) -> str:
        """What it printed on stderr, lines wrapped at the terminal's width joined again."""
        return " ".join(self.stderr.split())

    def rows(self) -> list[dict[str, Any]]:
        table = open_shards_dataset(str(self.data_dir / "shards")).to_table(
            filter=pc.field("run") == RUN
        )
        return table.to_pylist()


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory) -> Demo:
    data_dir = tmp_path_factory.mktemp("demo")
    result = demo(data_dir, "--json", *SHORT)
    assert result.returncode == 0, result.stderr[-4000:]
    return Demo(data_dir, json.loads(result.stdout), result.stderr)


@pytest.fixture
async def demo_log(ran: Demo) -> AsyncIterator[JetStreamContext]:
    """The demo's log again: a nats-server on the store the demo left in its data dir."""
    server = NatsServer(ran.data_dir / "nats").start()
    nc = await connect(server.url, FAST_LOG, name="test")
    try:
        yield nc.jetstream()
    finally:
        await nc.close()
        server.stop()


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def test_the_summary_says_what_ran_and_the_reward_rises(ran: Demo) -> None:
    s = ran.summary
    assert set(s) >= KEYS
    assert s["run"] == RUN  # --run honoured
    assert s["steps"] == s["batches"] == STEPS
    assert s["versions"] == list(range(1, STEPS + 1))
    assert s["samples_per_step"] == [GROUP_SIZE * GROUPS_PER_STEP] * STEPS
    rewards = s["reward_per_step"]
    assert len(rewards) == STEPS
    assert mean(rewards[-5:]) > mean(rewards[:5]) + 0.05, rewards
    # Every sample was drawn by the weights the trainer held: their log-probs agree.
    assert s["logprob_max_abs_diff"] is not None and s["logprob_max_abs_diff"] < 1e-3
    assert s["wall_s"] > 0
    assert "tiny untrained model" in ran.said and "write lowercase letters" in ran.said
    assert "HTTP Request" not in ran.said  # client libraries' per-request lines stay quiet
    assert f"the trainer published {s['versions']}" in ran.said


def test_the_numbers_agree_with_the_shards(ran: Demo) -> None:
    s = ran.summary
    rows = ran.rows()
    assert len(rows) == s["trajectories"]
    assert len({r["session"] for r in rows}) == s["sessions"]
    shards = FileShardStore(str(ran.data_dir / "shards")).committed()
    assert len(shards) == s["shards"] and all(sh.run == RUN for sh in shards)
    forks = {r["session"]: json.loads(r["metadata"])["forks"] for r in rows}
    assert sum(forks.values()) == s["forks"]
    tool_calls = sum(
        1
        for r in rows
        for m in json.loads(r["messages"])
        if m["role"] == "assistant" and m.get("tool_calls")
    )
    assert tool_calls == s["tool_call_turns"] > 0
    # Step n trained on exactly the samples version n - 1 wrote: its reward is theirs.
    by_version: dict[int, list[float]] = defaultdict(list)
    for r in rows:
        assert r["min_weight_version"] == r["max_weight_version"]
        by_version[r["max_weight_version"]].append(r["reward"])
    assert sorted(by_version) == list(range(STEPS))
    for version, step_reward in enumerate(s["reward_per_step"]):
        assert len(by_version[version]) == s["samples_per_step"][version]
        assert mean(by_version[version]) == pytest.approx(step_reward, abs=1e-5)


async def test_the_numbers_agree_with_the_streams(ran: Demo, demo_log: JetStreamContext) -> None:
    s = ran.summary
    codec = Codec()
    events = [codec.decode(data) for _, _, data in await stream_payloads(demo_log, "EVENTS")]
    mine = [e for e in events if e.run == RUN]
    assert sum(isinstance(e, TurnCompleted) for e in mine) == s["turns"]
    assert sum(isinstance(e, SessionOpened) for e in mine) == s["sessions"]
    trajectories = [codec.decode(d) for _, _, d in await stream_payloads(demo_log, "TRAJ")]
    assert all(isinstance(t, TrajectoryReady) and t.run == RUN for t in trajectories)
    assert len(trajectories) == s["trajectories"]


async def test_lookups_make_real_tool_calls_recorded_as_such(
    ran: Demo, demo_log: JetStreamContext
) -> None:
    called = [
        r
        for r in ran.rows()
        if json.loads(r["metadata"])["task"] == "lookup"
        and any(m.get("tool_calls") for m in json.loads(r["messages"]))
    ]
    assert called
    row = called[0]
    assert [t["function"]["name"] for t in json.loads(row["tools"])] == [WORD_TOOL_NAME]
    turns = [
        e for e in await read_session(demo_log, RUN, row["session"]) if isinstance(e, TurnCompleted)
    ]
    call, answer = turns
    assert call.finish_reason == "tool_calls"
    [recorded] = call.tool_calls
    assert recorded["function"]["name"] == WORD_TOOL_NAME
    assert json.loads(recorded["function"]["arguments"]) == {}
    assert call.tools is not None and call.tools[0]["function"]["name"] == WORD_TOOL_NAME
    # The agent ran the tool and sent its result back, answering that call.
    [result] = [m for m in answer.new_messages if m["role"] == "tool"]
    assert result["tool_call_id"] == recorded["id"] and result["content"] in WORDS
    assert answer.prefix_len == len(call.prompt_ids) + len(call.completion_ids)  # no fork


def test_the_reward_curve_is_a_png_in_the_data_dir(ran: Demo) -> None:
    png = ran.data_dir / f"demo-{RUN}-reward.png"
    assert ran.summary["png"] == str(png)
    assert f"reward curve: {png}" in ran.said
    with Image.open(png) as image:
        assert image.format == "PNG"
        assert image.size == (700, 400)


def test_a_run_already_used_is_refused(ran: Demo) -> None:
    again = demo(ran.data_dir, *SHORT)

    assert again.returncode == 1, again.stderr[-4000:]
    assert f"run {RUN} is already used in this log" in " ".join(again.stderr.split())
    assert again.stdout == ""
