"""The whole consumer pipeline as real processes: events -> fold workers -> TRAJ -> shards.

`turnstream worker` (x2, reapers included) and `turnstream shard-writer` run as subprocesses
against a real nats-server; the sessions are published as the gateway would publish them.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import duckdb
import numpy as np
import pytest

from eventlog import JetStreamPublisher
from schemas.events import TrajectoryReady
from schemas.shards import TRAJECTORY_SCHEMA
from tests.conftest import Log
from tests.helpers.services import WORKER_FLAGS, WRITER_FLAGS, Service, shard_table_rows
from tests.helpers.workload import PlannedSession, plan_sessions

pytestmark = pytest.mark.integration


def services(log: Log, data_dir: Path, workers: int = 2) -> list[Service]:
    url = log.server.url
    return [
        *(Service("worker", url, data_dir, *WORKER_FLAGS) for _ in range(workers)),
        Service("shard-writer", url, data_dir, *WRITER_FLAGS),
    ]


def expected_by_id(planned: list[PlannedSession]) -> dict[str, TrajectoryReady]:
    return {t.trajectory_id: t for p in planned for t in p.expected()}


async def until_all_in_shards(
    root: Path, expected: int, procs: list[Service], within: float
) -> list[dict[str, object]]:
    deadline = time.monotonic() + within
    rows: list[dict[str, object]] = []
    while time.monotonic() < deadline:
        rows = shard_table_rows(root)
        if len(rows) >= expected:
            return rows
        for p in procs:
            assert p.running, f"{p.command} exited:\n{p.output()}"
        await asyncio.sleep(0.3)
    logs = "\n".join(f"--- {p.command}\n{p.output()}" for p in procs)
    raise AssertionError(f"{len(rows)} of {expected} trajectories in shards\n{logs}")


def check_rows(
    rows: list[dict[str, object]], want: dict[str, TrajectoryReady], context: str = ""
) -> None:
    """Each expected trajectory in exactly one row, every field as folded; a failure names the
    trajectories and fields that differ (and ``context``, e.g. the seed)."""
    ids = Counter(str(r["trajectory_id"]) for r in rows)
    assert [tid for tid, n in ids.items() if n > 1] == [], f"{context}: in two shard rows"
    assert set(ids) == set(want), (
        f"{context}: missing {sorted(set(want) - set(ids))[:5]}, "
        f"unexpected {sorted(set(ids) - set(want))[:5]}"
    )
    wrong: list[str] = []
    for row in rows:
        t = want[str(row["trajectory_id"])]
        fields = {
            "input_ids": t.input_ids.tolist(),
            "loss_mask": t.loss_mask.tolist(),
            "logprobs": t.logprobs.tolist(),
            "versions": t.versions.tolist(),
            "turn_ends": t.turn_ends.tolist(),
            "reward": t.reward,
            "turn_rewards": t.turn_rewards,
            "status": t.status,
            "num_turns": t.num_turns,
            "segment": t.segment,
            "group": t.group,
            "prompt_len": t.prompt_len,
        }
        got = {**row, "logprobs": np.asarray(row["logprobs"], dtype=np.float32).tolist()}
        wrong += [
            f"{t.trajectory_id} {name}: {_difference(got[name], value)}"
            for name, value in fields.items()
            if got[name] != value
        ]
    assert wrong == [], f"{context}: {len(wrong)} fields differ; the first: {wrong[:5]}"


def _difference(got: object, want: object) -> str:
    if isinstance(got, list) and isinstance(want, list):
        at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
        where = f"first difference at {at}" if at is not None else "one is a prefix"
        return f"length {len(got)} (want {len(want)}), {where}"
    return f"{got!r} (want {want!r})"


async def publish_sessions(log: Log, planned: list[PlannedSession], pace_s: float = 0.0) -> None:
    pub = await JetStreamPublisher(log.nc).start()
    for start in range(0, len(planned), 25):
        await pub.publish_many([e for p in planned[start : start + 25] for e in p.events])
        await asyncio.sleep(pace_s)
    await pub.close()


@pytest.fixture
def stack(log: Log, tmp_path: Path) -> Iterator[list[Service]]:
    procs = services(log, tmp_path / "data")
    yield procs
    for p in procs:
        p.kill()


async def test_500_sessions_become_their_trajectories_in_shards_exactly_once(
    log: Log, tmp_path: Path, stack: list[Service]
) -> None:
    planned = plan_sessions(500, seed=11)
    want = expected_by_id(planned)
    assert sum(p.reaped for p in planned) > 10 and sum(p.per_turn for p in planned) > 10
    assert sum(p.forks > 0 for p in planned) > 10
    await publish_sessions(log, planned)
    for p in stack:
        p.start()

    root = tmp_path / "data" / "shards"
    rows = await until_all_in_shards(root, len(want), stack, within=120)
    check_rows(rows, want)
    reaped = {p.session for p in planned if p.reaped}
    assert {r["session"] for r in rows if r["status"] == "timeout"} == reaped
    codes = [p.stop() for p in stack]  # SIGTERM: finish, flush, exit cleanly
    assert codes == [0, 0, 0], "\n".join(p.output() for p in stack)

    assert [(f.name, str(f.type)) for f in TRAJECTORY_SCHEMA] == [
        (name, str(type_)) for name, type_ in zip(*_schema_of(root), strict=True)
    ]
    con = duckdb.connect()
    total, distinct, forks = con.execute(
        f"select count(*), count(distinct trajectory_id), count(*) filter (where segment > 0) "
        f"from read_parquet('{root}/run=*/*.parquet', hive_partitioning=false)"
    ).fetchone() or (0, 0, 0)
    assert total == distinct == len(want)
    assert forks == sum(1 for t in want.values() if t.segment > 0)


def _schema_of(root: Path) -> tuple[list[str], list[object]]:
    from shardstore import open_shards_dataset

    schema = open_shards_dataset(str(root)).schema
    return schema.names, list(schema.types)


async def test_killing_workers_and_the_shard_writer_loses_and_duplicates_nothing(
    log: Log, tmp_path: Path, stack: list[Service]
) -> None:
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    planned = plan_sessions(500, seed=seed % 1000)
    want = expected_by_id(planned)
    for p in stack:
        p.start()
    publishing = asyncio.create_task(publish_sessions(log, planned, pace_s=0.4))
    kills = Counter[str]()
    # Until both kinds died at least once: with 2 workers and 1 writer, 7 random kills missed
    # the writer about 1 run in 17 (seen in CI, seed 525972977).
    while (
        not publishing.done()
        or sum(kills.values()) < 6
        or not (kills["worker"] and kills["shard-writer"])
    ):
        await asyncio.sleep(rng.uniform(0.3, 1.5))
        victim = rng.choice(stack)
        victim.kill()
        kills[victim.command] += 1
        await asyncio.sleep(rng.uniform(0.0, 0.5))
        victim.start()
    await publishing

    root = tmp_path / "data" / "shards"
    rows = await until_all_in_shards(root, len(want), stack, within=150)
    await asyncio.sleep(2.0)  # anything written twice would show up by now
    rows = shard_table_rows(root)
    assert kills["worker"] >= 1 and kills["shard-writer"] >= 1, f"seed {seed}: kills {kills}"
    check_rows(rows, want, f"seed {seed}, kills {dict(kills)}")
    codes = [p.stop() for p in stack]
    assert codes == [0, 0, 0], f"seed {seed}: " + "\n".join(p.output() for p in stack)


async def test_a_nats_server_crash_mid_flow_loses_and_duplicates_nothing(
    log: Log, tmp_path: Path, stack: list[Service]
) -> None:
    planned = plan_sessions(200, seed=23)
    want = expected_by_id(planned)
    for p in stack:
        p.start()
    await publish_sessions(log, planned[:100])
    root = tmp_path / "data" / "shards"
    # Every service connected and the pipeline busy with the first half (services start slowly
    # on a loaded machine: a crash before they connect would test nothing).
    for _ in range(300):
        started = all(_ready_line(p) in _flat(p.log_path) for p in stack)
        if started and shard_table_rows(root):
            break
        await asyncio.sleep(0.1)
    else:
        raise AssertionError("\n".join(p.output() for p in stack))
    log.server.kill()  # SIGKILL: what JetStream acknowledged must survive
    await asyncio.sleep(1.0)
    log.server.restart()
    await publish_sessions(log, planned[100:])  # the test's own connection reconnects too

    rows = await until_all_in_shards(root, len(want), stack, within=150)
    await asyncio.sleep(2.0)  # anything written twice would show up by now
    check_rows(shard_table_rows(root), want)
    assert rows
    # Each service lost its connection mid-flow: the crash hit them all.
    assert all("disconnected from" in _flat(p.log_path) for p in stack), [p.output() for p in stack]
    codes = [p.stop() for p in stack]
    assert codes == [0, 0, 0], "\n".join(p.output() for p in stack)


def _ready_line(service: Service) -> str:
    return "fold worker on" if service.command == "worker" else "shard writer on"


def _flat(log_path: Path) -> str:
    """A service's log with rich's line wrapping undone (words joined by single spaces)."""
    return " ".join(log_path.read_text().split()) if log_path.exists() else ""


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a /metrics page, by (name, sorted labels)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def test_worker_and_shard_writer_serve_prometheus_metrics(log: Log, tmp_path: Path) -> None:
    from eventlog.server import free_ports

    planned = plan_sessions(30, seed=5)
    want = expected_by_id(planned)
    await publish_sessions(log, planned)
    await log.js.publish(  # bytes that are no close: one dead letter, reason undecodable
        "ts.ev.run-1.junk.close", b"\xc1", headers={"Nats-Msg-Id": "junk"}
    )
    worker_port, writer_port = free_ports(2)
    data = tmp_path / "data"
    procs = [
        Service("worker", log.server.url, data, *WORKER_FLAGS, "--metrics-port", str(worker_port)),
        Service(
            "shard-writer", log.server.url, data, *WRITER_FLAGS, "--metrics-port", str(writer_port)
        ),
    ]
    try:
        for p in procs:
            p.start()
        await until_all_in_shards(data / "shards", len(want), procs, within=120)
        worker, writer = _scrape(worker_port), _scrape(writer_port)
    finally:
        for p in procs:
            p.kill()
    closes = len(planned)  # each session is closed, by its agent or by the reaper
    assert worker[("turnstream_consumer_messages_total", (("consumer", "fold"),))] >= closes
    assert worker[("turnstream_consumer_messages_total", (("consumer", "reaper"),))] > closes
    dead = (
        "turnstream_consumer_dead_letters_total",
        (("consumer", "fold"), ("reason", "undecodable")),
    )
    assert worker[dead] == 1
    assert worker[("turnstream_consumer_handle_seconds_count", (("consumer", "fold"),))] >= closes
    assert ("turnstream_consumer_pending", (("consumer", "fold"),)) in worker
    assert writer[("turnstream_shard_commits_total", ())] >= 1
    assert writer[("turnstream_shard_rows_total", ())] == len(want)
    assert writer[("turnstream_consumer_messages_total", (("consumer", "shard-writer"),))] >= len(
        want
    )
