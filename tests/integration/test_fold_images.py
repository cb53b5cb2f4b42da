"""The fold worker on a real nats-server with the log's image store: a trajectory naming an
image the store lacks, or holds altered, is not published, and the turn that named it is
dead-lettered with the reason; the session's other trajectories, and other sessions, go on."""

from __future__ import annotations

import asyncio

import pytest

from consumers import FoldWorker
from eventlog import JetStreamImageStore, JetStreamPublisher
from schemas.events import SessionClosed, SessionEvent, TurnCompleted
from schemas.images import ImageRef, content_digest
from tests.conftest import Log
from tests.helpers.streams import dead_letters, trajectories

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


async def test_trajectories_naming_missing_or_altered_images_are_dead_lettered(log: Log) -> None:
    store = await JetStreamImageStore.open(log.nc, log.settings)
    await store.put(KEPT)
    await store.put(CHANGED)
    raw = await log.js.object_store(log.settings.names.images_bucket)
    await raw.put(content_digest(CHANGED), b"other bytes")  # behind the store's back
    publisher = await JetStreamPublisher(log.nc).start()
    await publisher.publish_many(
        session("whole", KEPT, KEPT)
        + session("missing", KEPT, ABSENT)
        + session("altered", CHANGED, KEPT)
    )
    worker = FoldWorker(log.js, publisher, images=store)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    for _ in range(400):
        if worker.stats.sessions_folded == 3:
            break
        await asyncio.sleep(0.05)
    stop.set()
    await task
    await publisher.close()

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
