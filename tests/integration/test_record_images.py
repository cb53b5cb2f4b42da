"""A recording carries its images (issue 39, point 2): ``turnstream record`` writes the images its
events name into the file, checked; ``turnstream replay`` puts them into the target log's store
before the events; replay into a fresh stack rebuilds events and images byte for byte. Real
nats-servers, real processes, real Parquet."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from consumers.recording import RecordingDamaged, read_recording
from eventlog import JetStreamImageStore
from schemas.events import SessionEvent
from schemas.images import content_digest
from tests.conftest import Log
from tests.helpers.image_sessions import png, put_images, with_images
from tests.helpers.sessions import RUN, append_only, session_events
from tests.helpers.streams import message_count, publish_events, stream_payloads
from tests.integration.test_fold_worker import running, until_trajectories
from tests.integration.test_replay import fold_all, fresh, run_cli, traj_by_id

pytestmark = pytest.mark.integration

__all__ = ["fresh"]  # the fixture, imported to be used here

SCREEN = [png(seed) for seed in range(3)]


def showing(session: str, shown: dict[int, bytes]) -> list[SessionEvent]:
    return with_images(session_events(append_only(3), session=session), shown)


async def record(log: Log, output: Path) -> str:
    done = await run_cli("record", "--log.url", log.server.url, "--run", RUN, "-o", str(output))
    assert done.returncode == 0, done.stderr
    return done.stderr


async def stored_at(log: Log, stream: str, seq: int) -> dt.datetime:
    msg = await log.js.get_msg(stream, seq=seq)
    assert msg.time is not None
    return dt.datetime.fromisoformat(str(msg.time)[:26].rstrip("Z") + "+00:00")


async def test_a_recording_holds_its_images_and_a_replay_rebuilds_them_byte_for_byte(
    log: Log, fresh: Log, tmp_path: Path
) -> None:
    # The screenshot is resent on a later turn and in another session: stored once, recorded once.
    events = showing("a", {0: SCREEN[0], 2: SCREEN[1]}) + showing("b", {1: SCREEN[0]})
    store = await JetStreamImageStore.open(log.nc, log.settings)
    await put_images(store, SCREEN)  # SCREEN[2] is named by no event: not recorded
    await publish_events(log.nc, events)
    folded = await fold_all(log, 2)
    recording = tmp_path / "run-1.parquet"

    said = await record(log, recording)

    assert "and 2 images to" in said
    recorded = read_recording(recording)
    assert recorded.images == {content_digest(d): d for d in SCREEN[:2]}  # in order of naming
    assert recorded.meta.format == 2 and recorded.meta.images_missing == ()
    table = pq.read_table(recording)  # one Parquet file: event rows, then image rows
    assert table.column("image").null_count == len(events) == recorded.meta.count
    assert table.column("image").to_pylist()[-2:] == list(recorded.images)

    async with running(fresh):
        done = await run_cli("replay", str(recording), "--log.url", fresh.server.url)
        assert done.returncode == 0, done.stderr
        await until_trajectories(fresh, 2)

    assert "2 images put first (0 already held)" in done.stderr
    assert await traj_by_id(fresh) == folded  # the same trajectories, byte for byte
    again = await JetStreamImageStore.open(fresh.nc, fresh.settings)
    assert await again.digests() == sorted(recorded.images)
    for digest, data in recorded.images.items():
        assert await again.get(digest) == data
    replayed = [(s, d) for _, s, d in await stream_payloads(fresh.js, "EVENTS")]
    assert replayed == [(e.subject, e.data) for e in recorded.events]
    # The images were stored before the first event (the server's clock orders the two streams).
    objects = await fresh.js.stream_info(f"OBJ_{fresh.settings.names.images_bucket}")
    first_event = (await fresh.js.stream_info("EVENTS")).state.first_seq
    assert await stored_at(
        fresh, f"OBJ_{fresh.settings.names.images_bucket}", objects.state.last_seq
    ) <= await stored_at(fresh, "EVENTS", first_event)

    # Twice: nothing new, and the images are counted as held.
    twice = await run_cli("replay", str(recording), "--log.url", fresh.server.url)
    assert twice.returncode == 0, twice.stderr
    assert "2 images put first (2 already held)" in twice.stderr
    assert (await fresh.js.stream_info(f"OBJ_{fresh.settings.names.images_bucket}")).state == (
        objects.state
    )
    # Into a new run: the same images (named by their bytes), events rewritten.
    moved = await run_cli("replay", str(recording), "--log.url", fresh.server.url, "--run", "r2")
    assert moved.returncode == 0, moved.stderr
    assert await message_count(fresh.js, "EVENTS") == 2 * len(events)


async def test_an_image_the_store_lost_is_named_not_silently_left_out(
    log: Log, fresh: Log, tmp_path: Path
) -> None:
    events = showing("a", {0: SCREEN[0], 1: SCREEN[1]})
    store = await JetStreamImageStore.open(log.nc, log.settings)
    await put_images(store, SCREEN[:1])  # SCREEN[1] never stored (or expired)
    await publish_events(log.nc, events)
    recording = tmp_path / "run-1.parquet"

    said = await record(log, recording)

    lost = content_digest(SCREEN[1])
    assert "1 image(s) that events of run" in said and f"sha256:{lost}" in said
    assert "and 1 images, 1 missing from the store (not recorded)" in said
    recorded = read_recording(recording)
    assert list(recorded.images) == [content_digest(SCREEN[0])]
    assert recorded.meta.images_missing == (lost,)

    done = await run_cli("replay", str(recording), "--log.url", fresh.server.url)
    assert done.returncode == 0, done.stderr
    assert "1 images put first (0 already held), 1 missing" in done.stderr
    assert f"first: sha256:{lost}" in done.stderr


async def test_an_altered_image_row_or_a_dropped_one_is_refused(log: Log, tmp_path: Path) -> None:
    store = await JetStreamImageStore.open(log.nc, log.settings)
    await put_images(store, SCREEN[:2])
    await publish_events(log.nc, showing("a", {0: SCREEN[0], 1: SCREEN[1]}))
    recording = tmp_path / "run-1.parquet"
    await record(log, recording)
    table = pq.read_table(recording)
    datas = table.column("data").to_pylist()
    datas[-1] = datas[-1][:-1] + bytes([datas[-1][-1] ^ 1])
    altered = table.set_column(4, "data", pa.array(datas, pa.binary()))
    pq.write_table(altered.replace_schema_metadata(table.schema.metadata), tmp_path / "bad.parquet")
    with pytest.raises(RecordingDamaged, match="images' SHA-256 does not match"):
        read_recording(tmp_path / "bad.parquet")
    dropped = table.slice(0, table.num_rows - 1).replace_schema_metadata(table.schema.metadata)
    pq.write_table(dropped, tmp_path / "short.parquet")
    with pytest.raises(RecordingDamaged, match="holds 1 distinct images; its footer says 2"):
        read_recording(tmp_path / "short.parquet")


def test_a_format_1_recording_is_still_read(tmp_path: Path) -> None:
    """Written as this project wrote recordings before issue 39: no image column, format 1."""
    from consumers.recording import _FORMAT_1_SCHEMA, digest

    datas = [b"one", b"two"]
    table = pa.table(
        {
            "seq": [1, 2],
            "subject": [f"ts.ev.{RUN}.s.open", f"ts.ev.{RUN}.s.close"],
            "stored_at": pa.array([1_000_000, 2_000_000], pa.int64()).cast(
                pa.timestamp("us", tz="UTC")
            ),
            "msg_id": ["a", "b"],
            "data": datas,
        },
        schema=_FORMAT_1_SCHEMA,
    )
    footer = {"format": 1, "stream": "EVENTS", "run": RUN, "first_seq": 1, "last_seq": 2}
    footer |= {"count": 2, "sha256": digest(datas), "since": "", "until": ""}
    old = tmp_path / "old.parquet"
    pq.write_table(
        table.replace_schema_metadata(
            {f"turnstream.recording.{k}": str(v) for k, v in footer.items()}
        ),
        old,
    )
    recording = read_recording(old)
    assert [e.data for e in recording.events] == datas
    assert recording.images == {} and recording.meta.format == 1
