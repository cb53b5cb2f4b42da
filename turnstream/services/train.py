"""``turnstream train``: the reference GRPO / PPO trainer as a service (DESIGN §9).

    turnstream train --log.url nats://HOST:4222 --run R [--steps N] [--algorithm grpo|ppo]
                     [--temperature T] [--sink.group-size N] [--model DIR]

Joins an existing log (``--log.url``, or the ``<data_dir>/stack.json`` of a running
``turnstream up``), takes run R's trajectories live from TRAJ through the trainer sink (a durable
consumer of its own, ``trainer-<run>`` unless ``--sink.durable`` says otherwise), and runs
``trainer_sink.ReferenceTrainer`` on them: one update per batch, a checkpoint under
``<data_dir>/checkpoints/<run>/v<N>/``, and PolicyUpdated in the ``ts_policy`` bucket, which the
gateways serving run R load. So gateway, workers, shard writer and trainer run as separate
processes that meet only in the log.

``--steps 0`` (the default) trains until SIGINT / SIGTERM; either signal lets the step under
way finish, publish and commit, then the trainer exits 0. Trajectories it held in incomplete
groups are delivered again after ``--sink.ack-wait-s``. A restarted trainer resumes from the
run's newest published policy (``ReferenceTrainer.resume``).

The trainer recomputes each token's log-prob at its own turn's temperature and top-p, which the
trajectories record (fold version 7). ``--temperature`` is for rows folded before that: they are
computed at it (and top-p 1), and refused when they were sampled at another temperature.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict
from transformers import AutoConfig

from eventlog import JetStreamImageStore, JetStreamPublisher
from eventlog.buckets import Bucket
from schemas.codec import Codec
from schemas.ids import ID_PATTERN
from schemas.policy import UpdateMode
from trainer_sink import (
    BatchingSettings,
    LiveSource,
    LiveSourceSettings,
    SinkVision,
    TrainerSink,
    VisionModel,
)
from turnstream.stack.event_log import EventLog, open_log, require_log_url
from turnstream.stack.process import stop_on_signals, without_progress_bars
from turnstream.stack.settings import PublishingSettings
from turnstream.stack.stack_file import join_stack
from turnstream.trainer.reference import (
    ReferenceTrainer,
    ReferenceTrainerSettings,
    StepReport,
)

__all__ = ["SinkSettings", "TrainCommand", "TrainSettings", "train"]

log = logging.getLogger(__name__)


class SinkSettings(BatchingSettings):
    """How the trainer takes trajectories: batching (GRPO groups by default) and its durable
    consumer on TRAJ."""

    policy: Literal["count", "tokens", "groups"] = Field(
        "groups", description="count: batch_size samples; tokens: up to token_budget; groups: GRPO"
    )
    batch_size: int = Field(
        1, ge=1, description="count: samples per batch; groups: groups per batch (one step each)"
    )
    durable: str | None = Field(
        None, description="durable consumer on TRAJ, one per training job; unset: trainer-<run>"
    )
    max_ack_pending: int = Field(
        4096, ge=1, description="trajectories delivered and not committed (flow control)"
    )
    ack_wait_s: float = Field(
        600.0, gt=0, description="an uncommitted trajectory is delivered again after this"
    )

    def batching(self) -> BatchingSettings:
        return BatchingSettings.model_validate(
            self.model_dump(include=set(BatchingSettings.model_fields))
        )

    def live(self, run: str) -> LiveSourceSettings:
        return LiveSourceSettings(
            durable=self.durable or f"trainer-{run}",
            max_ack_pending=self.max_ack_pending,
            fetch_batch=min(64, self.max_ack_pending),
            ack_wait_s=self.ack_wait_s,
        )


class TrainSettings(PublishingSettings):
    """The reference GRPO trainer as a service: live from TRAJ, publishes its policies."""

    model_config = SettingsConfigDict(cli_prog_name="turnstream train")

    run: str = Field(
        "default",
        pattern=f"^{ID_PATTERN}$",
        description="the run whose trajectories it trains on and whose policy it publishes",
    )
    model: Path | None = Field(
        None,
        description="the model the gateway serves (from_pretrained dir); unset: the one in "
        "stack.json, else the built-in tiny model",
    )
    algorithm: Literal["grpo", "ppo"] = Field(
        "grpo", description="grpo: advantages per group; ppo: over the batch, no critic"
    )
    steps: int = Field(0, ge=0, description="policy versions to train, then exit; 0: until Ctrl-C")
    lr: float = Field(1e-4, gt=0, description="Adam learning rate")
    clip: float = Field(0.2, gt=0, description="PPO ratio clip epsilon")
    epochs: int = Field(1, ge=1, description="optimizer steps on each batch")
    session_balanced: bool = Field(
        False,
        description="weigh each row's loss by 1 / (rows of its session): a session folded into "
        "many segments (sub-agents, forks) weighs as much as a session of one",
    )
    temperature: float = Field(
        1.0,
        ge=0,
        description="the agents' sampling temperature, for rows that do not record each turn's "
        "(folded before fold version 7); greedy (below 1e-5) counts as 1",
    )
    device: str = Field("cpu", description="torch device")
    update_mode: UpdateMode = Field(
        "wait",
        description="what the gateway's local backend does with its generations in flight when "
        "it loads a new version: wait (finish on the old weights), abort (end; the gateway "
        "continues each on the new weights, each token's version recorded), keep (switch at the "
        "next token)",
    )
    checkpoint_dir: Path | None = Field(
        None,
        description="new policies go to <checkpoint_dir>/v<N>/; unset: "
        "<data_dir>/checkpoints/<run>",
    )
    sink: SinkSettings = SinkSettings()

    def trainer_settings(self, model_dir: Path) -> ReferenceTrainerSettings:
        return ReferenceTrainerSettings(
            model_dir=model_dir,
            checkpoint_dir=self.checkpoint_dir or self.data_dir / "checkpoints" / self.run,
            run=self.run,
            algorithm=self.algorithm,
            steps=self.steps,
            lr=self.lr,
            clip=self.clip,
            epochs=self.epochs,
            session_balanced=self.session_balanced,
            temperature=self.temperature,
            device=self.device,
            update_mode=self.update_mode,
        )


async def train(
    settings: TrainSettings, event_log: EventLog, model_dir: Path, stop: asyncio.Event
) -> list[StepReport]:
    """Train ``settings.run`` from the live feed until ``settings.steps`` (0: until ``stop``)."""
    names = settings.log.names
    publisher = await JetStreamPublisher(event_log.nc, settings.publisher).start()
    source = LiveSource(
        event_log.js,
        publisher,
        settings.sink.live(settings.run),
        stream=names.trajectories,
        run=settings.run,
        codec=Codec(max_payload=settings.log.max_payload),
        commits_bucket=names.commits_bucket,
    )
    vision = await _vision(event_log, settings, model_dir)
    sink = TrainerSink(source, settings.sink.batching(), wait_s=0.5, vision=vision)
    try:
        trainer = await asyncio.to_thread(ReferenceTrainer, settings.trainer_settings(model_dir))
        policy = await Bucket.open(event_log.js, names.policy_bucket)
        log.info(
            "training run %s from policy version %d (%s, base model %s): waiting for "
            "trajectories on %s",
            settings.run,
            await trainer.resume(policy),
            settings.algorithm,
            model_dir,
            event_log.url,
        )
        return await trainer.run(sink, policy, stop=stop, on_step=_log_step)
    finally:
        await sink.close()
        await publisher.close()


async def _vision(
    event_log: EventLog, settings: TrainSettings, model_dir: Path
) -> SinkVision | None:
    """For a vision-language model: its image processor and the log's image store, which the
    sink reads each batch's images from; None for a text model."""
    config = await asyncio.to_thread(AutoConfig.from_pretrained, model_dir)
    if getattr(config, "vision_config", None) is None:
        return None
    model = await asyncio.to_thread(VisionModel.load, model_dir)
    return SinkVision(model, await JetStreamImageStore.open(event_log.nc, settings.log))


def _log_step(report: StepReport) -> None:
    delta = "-" if report.logprob_delta is None else f"{report.logprob_delta:.1e}"
    log.info(
        "step %d: policy version %d, %d samples, mean reward %.3f, loss %.4f, "
        "max |Δ logprob| %s, checkpoint %s",
        report.step,
        report.version,
        report.samples,
        report.mean_reward,
        report.loss,
        delta,
        report.checkpoint,
    )


class TrainCommand(TrainSettings):
    __doc__ = TrainSettings.__doc__

    def cli_cmd(self) -> None:
        settings, stack = join_stack(self)
        require_log_url(settings, "train")
        model = settings.model or (Path(stack.model_dir) if stack and stack.model_dir else None)
        asyncio.run(_serve(settings, model))


async def _serve(settings: TrainSettings, model: Path | None) -> None:
    from gateway.model import ensure_tiny_model  # torch: only when training

    without_progress_bars()
    stop = stop_on_signals()
    model_dir = model or ensure_tiny_model(settings.data_dir / "models")
    async with open_log(settings, name="turnstream-train") as event_log:
        reports = await train(settings, event_log, model_dir, stop)
    version = reports[-1].version if reports else None
    log.info(
        "trainer stopped after %d steps%s",
        len(reports),
        f" at policy version {version}" if version is not None else "",
    )
