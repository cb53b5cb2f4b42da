"""``turnstream record`` (issue 11, point 1) against a real nats-server, as a real process."""

from __future__ import annotations

import datetime as dt
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from consumers.recording import RecordingDamaged, read_recording
from tests.conftest import Log
from tests.helpers.sessions import append_only, session_events
from tests.helpers.streams import publish_events, stream_payloads

pytestmark = pytest.mark.integration


def record(log: Log, run: str, output: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "turnstream.cli", "record", "--log.url", log.server.url,
         "--run", run, "-o", str(output), *extra],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


async def test_a_run_is_recorded_whole_in_stream_order_and_checked(
    log: Log, tmp_path: Path
) -> None:
    mine = [e for i in range(5) for e in session_events(append_only(3), session=f"s{i}")]
    other = session_events(append_only(2), run="other-run", session="x")
    await publish_events(log.nc, mine[:7] + other + mine[7:])
    output = tmp_path / "run-1.parquet"

    done = record(log, "run-1", output)

    assert done.returncode == 0, done.stderr
    assert f"recorded {len(mine)} events of run run-1" in done.stderr
    recording = read_recording(output)
    stored = [
        (seq, subject, data) for seq, subject, data in await stream_payloads(log.js, "EVENTS")
    ]
    want = [row for row in stored if row[1].startswith("ts.ev.run-1.")]
    assert [(e.seq, e.subject, e.data) for e in recording.events] == want
    assert all(e.msg_id for e in recording.events) and recording.events[0].stored_at > 0
    meta = recording.meta
    assert (meta.stream, meta.run, meta.count) == ("EVENTS", "run-1", len(mine))
    assert (meta.first_seq, meta.last_seq) == (want[0][0], want[-1][0])
    # Any Parquet tool lists it; the footer says what it is.
    assert pq.read_schema(output).metadata[b"turnstream.recording.run"] == b"run-1"

    # One altered byte in one event: refused, naming the checksum.
    table = pq.read_table(output)
    datas = table.column("data").to_pylist()
    datas[3] = datas[3][:-1] + bytes([datas[3][-1] ^ 1])
    damaged = table.set_column(4, "data", pa.array(datas, pa.binary()))
    pq.write_table(damaged.replace_schema_metadata(table.schema.metadata), tmp_path / "bad.parquet")
    with pytest.raises(RecordingDamaged, match="SHA-256 does not match"):
        read_recording(tmp_path / "bad.parquet")
    pq.write_table(pa.table({"x": [1]}), tmp_path / "alien.parquet")
    with pytest.raises(RecordingDamaged, match="no turnstream recording footer"):
        read_recording(tmp_path / "alien.parquet")


async def test_recording_a_run_with_no_events_says_so(log: Log, tmp_path: Path) -> None:
    done = record(log, "nobody", tmp_path / "nobody.parquet")
    assert done.returncode != 0
    assert "run nobody has no events in EVENTS" in done.stderr
    assert not (tmp_path / "nobody.parquet").exists()


async def test_since_and_until_bound_the_recording_by_stored_time(log: Log, tmp_path: Path) -> None:
    events = [e for i in range(4) for e in session_events(append_only(2), session=f"t{i}")]
    for event in events:  # one publish each: distinct stored times
        await publish_events(log.nc, [event])
    whole = tmp_path / "whole.parquet"
    assert record(log, "run-1", whole).returncode == 0
    every = read_recording(whole).events
    middle = every[len(every) // 3 : 2 * len(every) // 3]
    # The server stores nanoseconds; clients (and the recording) see them rounded to a
    # microsecond, so the bounds get one microsecond of slack (publishes are ms apart).
    since = dt.datetime.fromtimestamp(middle[0].stored_at - 1e-6, dt.UTC)
    until = dt.datetime.fromtimestamp(middle[-1].stored_at + 1e-6, dt.UTC)
    part = tmp_path / "part.parquet"
    done = record(log, "run-1", part, "--since", since.isoformat(), "--until", until.isoformat())
    assert done.returncode == 0, done.stderr
    assert [e.seq for e in read_recording(part).events] == [e.seq for e in middle]
