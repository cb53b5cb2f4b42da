"""A restarted reference trainer resumes from the run's published policy (real ts_policy bucket)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from eventlog.buckets import Bucket
from schemas.events import TrajectoryReady
from schemas.policy import PolicyUpdate, encode_policy_update
from schemas.shards import trajectories_to_table
from tests.conftest import Log
from tests.helpers.trajectories import folded
from trainer_sink import (
    BatchingSettings,
    OfflineSource,
    PolicyError,
    TrainerSink,
)
from trainer_sink.assembly import assemble_padded
from turnstream.trainer.reference import ReferenceTrainer, ReferenceTrainerSettings

pytestmark = pytest.mark.integration


def samples_of(n: int = 4) -> list[TrajectoryReady]:
    """One GRPO group of ``n`` folded sessions with rewards 0 and 1."""
    return [
        folded("r", f"s{i}", turns=1 + i % 2, final_reward=float(i % 2), group="g")
        for i in range(n)
    ]


def weights(trainer: ReferenceTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


async def test_a_restarted_trainer_continues_from_the_published_policy(
    log: Log, tiny_model_dir: Path, tmp_path: Path
) -> None:
    settings = ReferenceTrainerSettings(
        model_dir=tiny_model_dir, checkpoint_dir=tmp_path / "ckpt", run="resume", lr=1e-2
    )
    kv = await Bucket.open(log.js, "ts_policy")
    first = ReferenceTrainer(settings)
    assert await first.resume(kv) == 0  # nothing published yet: model_dir at initial_version
    samples = samples_of()
    report = first.train_step(assemble_padded(samples))
    await first.publish(kv, report)
    served = digest(report.checkpoint / "model.safetensors")

    again = ReferenceTrainer(settings)  # the trainer restarted
    before = weights(again)
    assert await again.resume(kv) == 1
    after = weights(again)
    assert any(not torch.equal(before[k], after[k]) for k in after)  # not model_dir any more
    trained = weights(first)
    assert all(torch.equal(after[k], trained[k]) for k in after)  # exactly what it published

    # The restarted trainer's run() resumes by itself: its next policy is version 2.
    shards = tmp_path / "shards" / "run=r"
    shards.mkdir(parents=True)
    pq.write_table(trajectories_to_table(list(enumerate(samples, 1))), shards / "a.parquet")
    sink = TrainerSink(OfflineSource(str(shards.parent)), BatchingSettings(batch_size=4))
    restarted = ReferenceTrainer(settings.model_copy(update={"steps": 1}))
    [nxt] = await restarted.run(sink, kv)
    await sink.close()
    assert (nxt.version, nxt.checkpoint.name, sink.trainer_version) == (2, "v2", 2)
    assert digest(report.checkpoint / "model.safetensors") == served  # v1 left as served
    assert await ReferenceTrainer(settings).resume(kv) == 2


async def test_a_published_policy_the_trainer_cannot_read_is_a_clear_error(
    log: Log, tiny_model_dir: Path, tmp_path: Path
) -> None:
    kv = await Bucket.open(log.js, "ts_policy")
    elsewhere = tmp_path / "on-another-host" / "v5"
    await kv.put("gone", encode_policy_update(PolicyUpdate(5, elsewhere)))
    settings = ReferenceTrainerSettings(
        model_dir=tiny_model_dir, checkpoint_dir=tmp_path / "ckpt", run="gone"
    )
    with pytest.raises(PolicyError, match=r"version 5.*on-another-host.*new run"):
        await ReferenceTrainer(settings).resume(kv)

    await kv.put("garbled", b"{not json")
    garbled = settings.model_copy(update={"run": "garbled"})
    with pytest.raises(PolicyError, match=r"'garbled'.*not a policy"):
        await ReferenceTrainer(garbled).resume(kv)

    # A policy no newer than the weights held is nothing to resume.
    await kv.put("older", encode_policy_update(PolicyUpdate(2, elsewhere)))
    older = settings.model_copy(update={"run": "older", "initial_version": 3})
    assert await ReferenceTrainer(older).resume(kv) == 3
