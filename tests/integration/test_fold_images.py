"""The fold worker on a real nats-server with the log's image store: a trajectory naming an
image the store lacks, or holds altered, is not published, and the turn that named it is
dead-lettered with the reason; the session's other trajectories, and other sessions, go on.
And a real image session through it all: the store, the fold, TRAJ, a live sink reading the
images back from the store (a Ray actor's spec) into verl's multi_modal_inputs."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from consumers import FoldWorker
from eventlog import JetStreamImageStore, JetStreamPublisher
from gateway.model.tiny_vl import ensure_tiny_vl_model
from schemas.events import SessionClosed, SessionEvent, TurnCompleted
from schemas.images import ImageRef, content_digest
from tests.conftest import Log
from tests.helpers.streams import dead_letters, trajectories
from tests.helpers.vision_turns import vision_session
from trainer_sink import (
    BatchingSettings,
    ImagesSpec,
    LiveSourceSettings,
    LiveSpec,
    SinkSpec,
    non_tensor_values,
)

pytestmark = pytest.mark.integration

PAD = 9
KEPT, ABSENT, CHANGED = b"kept screenshot", b"never stored", b"stored, then changed"


def session(name: str, first: bytes, retry: bytes) -> list[SessionEvent]:
    """Turn 0 shows ``first``; turn 1 retries turn 0's prompt with ``retry`` (a second chain)."""

    def ref(data: bytes, offset: int) -> ImageRef:
        return ImageRef(content_digest(data), offset, 2, 28, 28, "image/png", (1, 2, 4))

    def turn(index: int, image: ImageRef, **fields: object) -> TurnCompleted:
        return TurnCompleted(
            run="r",
            session=name,
            turn=index,
            completion_ids=[5],
            logprobs=[-0.5],
            images=[image],
            **fields,  # type: ignore[arg-type]
        )

    return [
        turn(0, ref(first, 1), prompt_ids=[1, PAD, PAD, 2]),
        turn(1, ref(retry, 5), parent_turn=0, prefix_len=4, prompt_ids=[3, PAD, PAD, 4]),
        SessionClosed(run="r", session=name, num_turns=2),
    ]


async def fold_all(log: Log, events: list[SessionEvent], store: JetStreamImageStore) -> FoldWorker:
    publisher = await JetStreamPublisher(log.nc).start()
    await publisher.publish_many(events)
    worker = FoldWorker(log.js, publisher, images=store)
    closes = sum(isinstance(e, SessionClosed) for e in events)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    for _ in range(400):
        if worker.stats.sessions_folded == closes:
            break
        await asyncio.sleep(0.05)
    stop.set()
    await task
    await publisher.close()
    return worker


async def test_trajectories_naming_missing_or_altered_images_are_dead_lettered(log: Log) -> None:
    store = await JetStreamImageStore.open(log.nc, log.settings)
    await store.put(KEPT)
    await store.put(CHANGED)
    raw = await log.js.object_store(log.settings.names.images_bucket)
    await raw.put(content_digest(CHANGED), b"other bytes")  # behind the store's back
    worker = await fold_all(
        log,
        session("whole", KEPT, KEPT)
        + session("missing", KEPT, ABSENT)
        + session("altered", CHANGED, KEPT),
        store,
    )

    published = {t.trajectory_id: t for t in await trajectories(log.js)}
    # "missing": its first chain is whole, its retry names the absent image. "altered": both
    # chains share turn 0's prompt, whose image was changed: nothing of it is published.
    assert sorted(published) == ["r/missing/0", "r/whole/0", "r/whole/1"]
    assert [r.sha256 for r in published["r/whole/1"].images] == [content_digest(KEPT)] * 2
    letters = sorted(await dead_letters(log.js), key=lambda letter: letter.session or "")
    assert [(x.session, x.reason, x.subject) for x in letters] == [
        ("altered", "image_altered", "ts.ev.r.altered.turn"),
        ("missing", "image_missing", "ts.ev.r.missing.turn"),
    ]
    assert content_digest(ABSENT) in letters[1].error and "r/missing/1" in letters[1].error
    assert "r/altered/0, r/altered/1" in letters[0].error
    assert worker.stats.without_images == 3


async def test_a_live_sink_reads_an_image_sessions_images_from_the_logs_store(
    log: Log, tmp_path: Path
) -> None:
    model_dir = ensure_tiny_vl_model(tmp_path / "models")
    seen = await vision_session(model_dir)
    store = await JetStreamImageStore.open(log.nc, log.settings)
    for data in seen.images.values():
        await store.put(data)
    await fold_all(log, seen.events, store)
    spec = SinkSpec(
        LiveSpec(log.server.url, LiveSourceSettings(durable="vision"), log.settings),
        BatchingSettings(policy="count", batch_size=1),
        images=ImagesSpec(str(model_dir)),
    )
    sink = await spec.open()
    try:
        batch = await anext(sink)
        await sink.commit(batch)
    finally:
        await sink.close()
    [inputs] = non_tensor_values(batch.tensors, "multi_modal_inputs")
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 8], [1, 6, 4]]
    assert batch.tensors["position_ids"].shape[:2] == (1, 4)
