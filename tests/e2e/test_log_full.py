"""A full JetStream store (issue 38): the gateway answers 503 with Retry-After, stores nothing
it did not acknowledge, and serves again once space returns.

Two ways a store fills, one after the other on one real nats-server and one real gateway:
JetStream's own limit (``max_file_store`` reached: "insufficient resources", err_code 10023;
space returns when the limit is raised and the server reloads), and the disk itself (a tmpfs of
its own under the store, shrunk to what it holds: the next write fails with ENOSPC; nats-server
keeps that stream's write error until it restarts, so the supervisor that ``turnstream up``
runs around its server restarts it once the store has room again: the test makes room and
nothing else). The disk needs root to mount; elsewhere that half is skipped and says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from eventlog import connect, read_session
from eventlog.server import NatsServer
from eventlog.server.supervisor import supervise
from schemas import TurnCompleted
from tests.helpers.gateway_process import GatewayProcess
from tests.helpers.small_disk import SmallDisk

pytestmark = pytest.mark.integration

MiB = 1024 * 1024
FAST_PUBLISH = ("--publisher.ack-timeout-s", "1", "--publisher.max-attempts", "2")


def ask(n: int) -> dict[str, Any]:
    """Each request its own question: the same request again is a retry, answered with the
    turn it stored (the gateway's idempotence), not a new turn."""
    return {"model": "tiny", "messages": [{"role": "user", "content": f"hi {n}"}], "max_tokens": 4}


def test_a_full_store_answers_503_with_retry_after_and_serves_again_when_space_returns(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    disk = SmallDisk(tmp_path / "nats", 64 * MiB)
    real_disk = disk.mount()
    server = NatsServer(tmp_path / "nats", max_file_store=4 * MiB)
    try:
        server.start()
        gateway = GatewayProcess(server.url, tiny_model_dir, tmp_path / "gateway", *FAST_PUBLISH)
        try:
            session = gateway.session()
            chat = f"{session['base_url']}/chat/completions"
            answered = [_served(chat, 0)]  # acknowledged before the store filled

            # JetStream's limit reached: a clear 503, told when to come back.
            asyncio.run(_fill_to_the_limit(server.url))
            refused = httpx.post(chat, json=ask(1), timeout=30)
            assert refused.status_code == 503, refused.text
            assert refused.headers["retry-after"] == "5"
            error = refused.json()["error"]
            assert error["code"] == "log_unavailable"
            assert "store is full" in error["message"] and "max_file_store" in error["message"]
            server.max_file_store = 1024 * MiB
            server.reload()
            answered.append(_served(chat, 2))

            # The disk itself full.
            if real_disk:
                with _supervised(server):
                    _refused_until_room(disk, chat, answered)
        finally:
            gateway.stop()
        # Nothing answered is lost, nothing refused was stored.
        turns = asyncio.run(_turns(server.url, str(session["session_id"])))
        assert [t.turn for t in turns] == list(range(len(answered)))
        assert [t.text for t in turns] == [a["choices"][0]["message"]["content"] for a in answered]
    finally:
        server.stop()
        disk.unmount()
    if not real_disk:
        pytest.skip(f"JetStream's limit checked; a full disk needs a tmpfs: {disk.why_not}")


def _refused_until_room(disk: SmallDisk, chat: str, answered: list[dict[str, Any]]) -> None:
    disk.fill()
    # A turn or two may still fit in the last page of the store's open files.
    for n in range(3, 23):
        refused = httpx.post(chat, json=ask(n), timeout=30)
        if refused.status_code != 200:
            break
        answered.append(refused.json())
    assert refused.status_code == 503, refused.text
    assert refused.headers["retry-after"] == "1"
    disk.make_room()  # and nothing else: the supervisor restarts the stuck server
    answered.append(_served(chat, 23))


@contextlib.contextmanager
def _supervised(server: NatsServer) -> Iterator[None]:
    """``eventlog.server.supervisor.supervise`` around ``server``, as ``turnstream up`` runs it,
    on a thread of its own (the test's calls block)."""
    loop = asyncio.new_event_loop()
    task = loop.create_task(supervise(server, poll_s=0.1, min_free_bytes=MiB))

    def run() -> None:
        with contextlib.suppress(asyncio.CancelledError):
            loop.run_until_complete(task)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        loop.call_soon_threadsafe(task.cancel)
        thread.join(30)
        loop.close()
    assert task.cancelled(), task.exception()


def _served(url: str, n: int, within_s: float = 60.0) -> dict[str, Any]:
    """Question ``n``'s turn, once the gateway serves again (503s meanwhile: it reconnects)."""
    deadline = time.monotonic() + within_s
    while True:
        reply = httpx.post(url, json=ask(n), timeout=30)
        if reply.status_code != 503 or time.monotonic() > deadline:
            assert reply.status_code == 200, reply.text
            return dict(reply.json())
        time.sleep(0.5)


async def _fill_to_the_limit(url: str) -> None:
    """Publish to a stream of the test's own until JetStream has no room left, not even for
    a small message (a turn is a few kB)."""
    nc = await connect(url)
    try:
        js = nc.jetstream()
        await js.add_stream(name="FILLER", subjects=["filler"])
        for size in (256 * 1024, 16 * 1024, 1024, 64):
            for _ in range(200):
                ack = await nc.request("filler", b"x" * size, timeout=5)
                if b"insufficient resources" in ack.data:
                    break
            else:
                raise AssertionError("JetStream never refused for want of storage")
    finally:
        await nc.close()


async def _turns(url: str, session: str) -> list[TurnCompleted]:
    nc = await connect(url)
    try:
        events = await read_session(nc.jetstream(), "e2e", session)
    finally:
        await nc.close()
    return sorted((e for e in events if isinstance(e, TurnCompleted)), key=lambda e: e.turn)
