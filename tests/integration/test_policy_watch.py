"""PolicyUpdated through the log: a trainer puts a version in ``ts_policy``, the gateway's local
backend loads that checkpoint, with a real nats-server and the real tiny model."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from eventlog import Bucket
from gateway.backends.interface import Prompt, SamplingParams
from gateway.backends.local import LocalBackend
from gateway.backends.policy_watch import watch_policy
from gateway.model import ensure_tiny_model
from tests.conftest import Log
from tests.helpers.waiting import eventually

pytestmark = pytest.mark.integration

PROMPT = [257, *b"user\nhi", 258, 10, 257, *b"assistant\n"]
GREEDY = SamplingParams(max_tokens=12, temperature=0)


@pytest.fixture(scope="module")
def other_weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("other"), seed=1)


@pytest.fixture
async def backend(tiny_model_dir: Path) -> AsyncIterator[LocalBackend]:
    backend = LocalBackend.load(tiny_model_dir)
    yield backend
    await backend.close()


class Recording:
    """The real backend, noting every version the watcher asks it to load."""

    def __init__(self, backend: LocalBackend) -> None:
        self.backend = backend
        self.asked: list[int] = []

    @property
    def id(self) -> str:
        return self.backend.id

    @property
    def weight_version(self) -> int:
        return self.backend.weight_version

    async def load_weights(self, checkpoint: Path | None, version: int, mode: str = "wait") -> None:
        self.asked.append(version)
        await self.backend.load_weights(checkpoint, version)


@contextlib.asynccontextmanager
async def watching(log: Log, run: str, backend: LocalBackend) -> AsyncIterator[Recording]:
    kv = await Bucket.open(log.js, "ts_policy")
    target = Recording(backend)
    task = asyncio.create_task(watch_policy(kv, run, target, retry_delay_s=0.1))
    try:
        yield target
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def put(log: Log, run: str, version: int, checkpoint: Path | str) -> None:
    kv = await log.js.key_value("ts_policy")
    await kv.put(run, json.dumps({"version": version, "checkpoint": str(checkpoint)}).encode())


async def logprobs(backend: LocalBackend) -> list[float]:
    return [lp async for chunk in backend.generate(Prompt(PROMPT), GREEDY) for lp in chunk.logprobs]


async def test_a_new_version_in_the_bucket_is_loaded(
    log: Log, backend: LocalBackend, other_weights: Path
) -> None:
    reference = await logprobs(LocalBackend.load(other_weights))
    assert await logprobs(backend) != pytest.approx(reference, abs=1e-6)
    async with watching(log, "run-a", backend):
        await put(log, "run-a", 2, other_weights)
        await eventually(lambda: backend.weight_version == 2, 10, "weight_version 2 loaded")
    assert await logprobs(backend) == pytest.approx(reference, abs=1e-6)


async def test_the_current_version_is_loaded_when_the_watch_starts(
    log: Log, backend: LocalBackend, other_weights: Path
) -> None:
    """A gateway restarted mid-run catches up with the trainer before anything new is put.
    (Through ``watch_policy`` with the backend as its target, as the gateway service does.)"""
    await put(log, "run-b", 4, other_weights)
    task = asyncio.create_task(
        watch_policy(await Bucket.open(log.js, "ts_policy"), "run-b", backend)
    )
    try:
        await eventually(lambda: backend.weight_version == 4, 10, "weight_version 4 loaded")
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_stale_bad_and_foreign_entries_are_skipped(
    log: Log,
    backend: LocalBackend,
    tiny_model_dir: Path,
    other_weights: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    base = await logprobs(backend)
    async with watching(log, "run-c", backend) as target:
        await put(log, "run-c", 3, other_weights)
        await eventually(lambda: backend.weight_version == 3, 10, "weight_version 3 loaded")
        await put(log, "run-c", 2, tiny_model_dir)  # older: must not roll back
        await put(log, "run-c", 5, tmp_path / "no-such-checkpoint")  # fails to load
        kv = await log.js.key_value("ts_policy")
        await kv.put("run-c", b"{not json")
        await put(log, "run-other", 9, tiny_model_dir)  # another run's key
        await put(log, "run-c", 6, tiny_model_dir)  # still followed after all that
        await eventually(lambda: backend.weight_version == 6, 10, "weight_version 6 loaded")
    assert target.asked == [3, 5, 6]  # 5 was tried, failed, and left version 3 serving
    assert "could not load run 'run-c' policy version 5" in caplog.text
    assert "ignoring policy entry" in caplog.text
    assert await logprobs(backend) == pytest.approx(base, abs=1e-6)


async def test_a_deleted_key_leaves_the_policy_alone(
    log: Log, backend: LocalBackend, other_weights: Path, tiny_model_dir: Path
) -> None:
    async with watching(log, "run-d", backend) as target:
        await put(log, "run-d", 1, other_weights)
        await eventually(lambda: backend.weight_version == 1, 10, "weight_version 1 loaded")
        kv = await log.js.key_value("ts_policy")
        await kv.delete("run-d")
        await put(log, "run-d", 2, tiny_model_dir)
        await eventually(lambda: backend.weight_version == 2, 10, "weight_version 2 loaded")
    assert target.asked == [1, 2]


async def test_an_entry_without_a_checkpoint_leaves_the_local_weights_as_they_are(
    log: Log, backend: LocalBackend, caplog: pytest.LogCaptureFixture
) -> None:
    """A trainer that syncs inference servers of its own (verl) publishes versions without a
    checkpoint: the local backend cannot follow one, says why, and keeps weights and version."""
    base = await logprobs(backend)
    async with watching(log, "run-e", backend) as target:
        kv = await log.js.key_value("ts_policy")
        await kv.put("run-e", b'{"version": 3}')
        await eventually(lambda: "without a checkpoint" in caplog.text, 10, "the refusal logged")
    assert target.asked == [3]
    assert backend.weight_version == 0
    assert "still serving weight_version 0" in caplog.text
    assert "--backend vllm or sglang" in caplog.text
    assert await logprobs(backend) == pytest.approx(base, abs=1e-6)
