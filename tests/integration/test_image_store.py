"""The log's image store against a real nats-server: stored once, read back checked, a missing
or altered object named for what it is, the bucket provisioned with the events' retention.

What is behind the store's back is done with nats-py's own object store API, as another client
would: ``raw`` is that bucket.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from nats.js import api as js_api
from nats.js.object_store import ObjectStore

from eventlog import (
    ImageAltered,
    ImageMissing,
    ImageRetention,
    JetStreamImageStore,
    LogSettings,
    LogStoreFull,
    StreamNames,
    connect,
    provision,
)
from eventlog.connection import close_connection
from eventlog.server import NatsServer, free_ports
from schemas.errors import EventLogUnavailable
from schemas.images import content_digest
from tests.conftest import FAST_LOG, Log

pytestmark = pytest.mark.integration

SCREENSHOT = os.urandom(300 * 1024)  # three chunks of nats-py's 128 KiB
DIGEST = content_digest(SCREENSHOT)


async def _images(log: Log, read_timeout_s: float = 30.0) -> JetStreamImageStore:
    return await JetStreamImageStore.open(log.nc, log.settings, read_timeout_s)


async def _raw(log: Log) -> ObjectStore:
    return await log.js.object_store(log.settings.names.images_bucket)


async def _stream(log: Log) -> js_api.StreamInfo:
    return await log.js.stream_info(f"OBJ_{log.settings.names.images_bucket}")


async def test_an_image_put_twice_is_stored_once_and_read_back_whole(log: Log) -> None:
    images = await _images(log)
    assert await images.put(SCREENSHOT) == DIGEST
    once = (await _stream(log)).state
    assert await images.put(SCREENSHOT) == DIGEST  # the next turn resends the screenshot
    twice = (await _stream(log)).state
    assert (twice.bytes, twice.last_seq) == (once.bytes, once.last_seq)  # nothing uploaded
    assert once.messages == 4  # three chunks and the object's record
    assert await images.get(DIGEST) == SCREENSHOT
    assert await images.has(DIGEST)
    info = await images.info(DIGEST)
    assert info is not None and (info.digest, info.size) == (DIGEST, len(SCREENSHOT))


async def test_a_missing_image_is_its_own_error_naming_the_digest(log: Log) -> None:
    images = await _images(log)
    absent = content_digest(b"never stored")
    with pytest.raises(ImageMissing) as missing:
        await images.get(absent)
    assert missing.value.digest == absent and absent in str(missing.value)
    assert missing.value.permanent and missing.value.reason == "image_missing"
    assert not await images.has(absent) and await images.info(absent) is None
    with pytest.raises(ValueError, match="not an image digest"):  # a caller's bug, not the log's
        await images.get("sha256:" + absent)


async def test_an_object_altered_behind_the_stores_back_is_caught_and_a_put_repairs_it(
    log: Log,
) -> None:
    images = await _images(log)
    await images.put(SCREENSHOT)
    await (await _raw(log)).put(DIGEST, b"another picture")  # same name, other bytes
    with pytest.raises(ImageAltered) as altered:
        await images.get(DIGEST)
    assert DIGEST in str(altered.value) and content_digest(b"another picture") in str(altered.value)
    assert altered.value.permanent and altered.value.reason == "image_altered"
    await images.put(SCREENSHOT)  # the gateway's next put of the real bytes stores them again
    assert await images.get(DIGEST) == SCREENSHOT


async def test_an_object_whose_chunks_are_gone_is_missing_not_a_hang(log: Log) -> None:
    images = await _images(log, read_timeout_s=1.0)
    await images.put(SCREENSHOT)
    stored = await (await _raw(log)).get_info(DIGEST)
    bucket = log.settings.names.images_bucket
    await log.js.purge_stream(f"OBJ_{bucket}", subject=f"$O.{bucket}.C.{stored.nuid}")
    with pytest.raises(ImageMissing, match="0 of its 3 chunks are left"):
        await images.get(DIGEST)


async def test_an_image_older_than_the_refresh_age_is_uploaded_again_once(log: Log) -> None:
    opened = await _images(log)
    await opened.put(SCREENSHOT)
    before = (await _stream(log)).state
    # Every stored object counts as old: the put re-uploads, and the old chunks go.
    old = JetStreamImageStore(
        log.nc, await _raw(log), opened.bucket, ImageRetention(ttl_s=60.0, refresh_after_s=0.0)
    )
    await old.put(SCREENSHOT)
    after = (await _stream(log)).state
    assert after.last_seq == before.last_seq + 4  # uploaded again ...
    assert (after.messages, after.bytes) == (before.messages, before.bytes)  # ... and kept once
    assert await opened.get(DIGEST) == SCREENSHOT


async def test_the_digests_listed_are_the_images_stored(log: Log) -> None:
    images = await _images(log)
    assert await images.digests() == []
    stored = sorted([await images.put(SCREENSHOT), await images.put(b"a small icon")])
    await (await _raw(log)).put("notes.txt", b"not an image of ours")
    assert await images.digests() == stored


async def test_a_full_bucket_refuses_an_image_as_the_store_being_full(log: Log) -> None:
    capped = log.settings.model_copy(update={"images_max_bytes": 256 * 1024})
    await provision(log.js, capped)
    images = await _images(log)
    with pytest.raises(LogStoreFull, match="images-max-bytes"):
        await images.put(SCREENSHOT)
    assert not await images.has(DIGEST)
    assert (await _stream(log)).state.messages == 0  # its first chunks purged


async def test_the_bucket_follows_the_events_retention_and_the_replicas(log: Log) -> None:
    info = await _stream(log)
    config = info.config
    assert config.max_age == 2 * log.settings.events_max_age_s
    assert config.storage == js_api.StorageType.FILE
    assert config.num_replicas == log.settings.replicas
    assert config.description and "SHA-256" in config.description
    shorter = log.settings.model_copy(update={"events_max_age_s": 3600.0})
    actions = {a.name: a for a in await provision(log.js, shorter)}
    assert actions["ts_images"].action == "updated"
    assert actions["ts_images"].changed == ("max_age",)
    assert (await _stream(log)).config.max_age == 7200.0
    again = {a.name: a for a in await provision(log.js, shorter)}
    assert again["ts_images"].action == "unchanged"
    forever = shorter.model_copy(update={"events_max_age_s": 0.0})
    await provision(log.js, forever)
    assert not (await _stream(log)).config.max_age  # events kept forever: images too


async def test_opening_an_unprovisioned_image_bucket_says_to_provision(log: Log) -> None:
    elsewhere = log.settings.model_copy(
        update={"names": StreamNames(images_bucket="not_provisioned")}
    )
    with pytest.raises(EventLogUnavailable, match="provision"):
        await JetStreamImageStore.open(log.nc, elsewhere)


async def test_concurrent_puts_of_one_new_image_upload_it_once(log: Log) -> None:
    images = await _images(log)  # a GRPO group's samples start from one screenshot at once
    assert set(await asyncio.gather(*(images.put(SCREENSHOT) for _ in range(4)))) == {DIGEST}
    assert (await _stream(log)).state.last_seq == 4  # three chunks and a record: once
    assert await images.get(DIGEST) == SCREENSHOT


def test_retention_outlives_every_event_naming_an_image() -> None:
    """An image put just before an event is kept at least the event's age past that put."""
    for events_age in (60.0, 86_400.0, 30 * 86_400.0):
        r = ImageRetention.following(events_age)
        assert r.ttl_s is not None and r.refresh_after_s is not None
        assert r.ttl_s - r.refresh_after_s >= events_age
    assert LogSettings().images_max_bytes == -1


# -- on a cluster -------------------------------------------------------------------------------


@contextlib.contextmanager
def _cluster(root: Path, size: int = 3) -> Iterator[list[NatsServer]]:
    """``size`` local nats-servers routed into one JetStream cluster (a few seconds to elect)."""
    routes = free_ports(size)
    nodes = []
    for i, route in enumerate(routes):
        peers = ", ".join(f'"nats://127.0.0.1:{p}"' for p in routes if p != route)
        config = (
            f'server_name: "node-{i}"\n'
            f'cluster {{ name: "images", listen: "127.0.0.1:{route}", routes: [{peers}] }}'
        )
        nodes.append(NatsServer(root / f"node-{i}", extra_config=config))
    try:
        for node in nodes:
            node.start()
        yield nodes
    finally:
        for node in nodes:
            node.stop()


async def test_on_a_cluster_an_image_is_replicated_and_read_after_its_leader_dies(
    tmp_path: Path,
) -> None:
    settings = FAST_LOG.model_copy(update={"replicas": 3})
    with _cluster(tmp_path) as nodes:
        nc = await connect(",".join(n.url for n in nodes), settings, name="test")
        try:
            await provision(nc.jetstream(), settings)  # asks again until a leader is elected
            images = await JetStreamImageStore.open(nc, settings, read_timeout_s=2.0)
            digest = await images.put(SCREENSHOT)
            info = await nc.jetstream().stream_info("OBJ_ts_images")
            assert info.config.num_replicas == 3 and info.cluster is not None
            assert len(info.cluster.replicas or []) == 2
            [leader] = [n for n in nodes if n.store_dir.name == info.cluster.leader]
            leader.kill()
            deadline = time.monotonic() + 30
            while True:  # the other two elect a leader; until then the log does not answer
                try:
                    assert await images.get(digest) == SCREENSHOT
                    break
                except EventLogUnavailable:
                    assert time.monotonic() < deadline, "no new leader within 30 s"
                    await asyncio.sleep(0.2)
        finally:
            await close_connection(nc)
