"""``turnstream demo``: the main job on the embedded default, end to end, learning (DESIGN §9).

    turnstream demo [--steps 30] [--seed 0] [--run R] [--json] [--data-dir data]

``turnstream up`` in this process (a nats-server, the gateway on the tiny local model, a fold
worker, a shard writer), then the loop the project exists for:

- agents (unmodified ``openai`` SDK clients, ``turnstream.demo.agents``) play GRPO groups of
  episodes through the gateway: two-turn chats, and lookups that make a real tool call;
- every turn is published to EVENTS before it is answered; closed sessions are folded into
  trajectories (TRAJ) and written to Parquet shards;
- the reference GRPO trainer, fed live by the trainer sink from TRAJ, checks that the log-probs
  it recomputes agree with what the gateway recorded, updates the policy and publishes it
  through ``ts_policy``; the gateway loads it, and the next batch is sampled from it.

The model is the built-in tiny one (2 layers, random weights: untrained), taught beforehand
only to close a tool call (``turnstream.demo.model``); the task is to write lowercase letters
(reward: the share of an answer's tokens that are a-z). The mean reward per step rises within
the default run. At the end: the trainer's steps, a summary of what was made, counted where it
lives (``turnstream.demo.report``), the reward curve ``<data_dir>/demo-<run>-reward.png``, and
with ``--json`` the summary as JSON on stdout.

Every demo is a run of its own: without ``--run`` the run is ``demo-<unix time>``; a run that
already has events, trajectories or a policy in this log is refused.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Literal

import httpx
from pydantic import AliasChoices, Field, model_validator
from pydantic_settings import SettingsConfigDict
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from eventlog import JetStreamPublisher
from eventlog.buckets import Bucket
from schemas.errors import TurnstreamError
from schemas.policy import UpdateMode
from shardstore import FileShardStore
from trainer_sink import (
    BatchingSettings,
    LiveSource,
    LiveSourceSettings,
    TrainerSink,
)
from turnstream.demo.agents import (
    CHANCE,
    KEEPALIVE_EXPIRY_S,
    NO_CALL,
    TURN_TIMEOUT_S,
    AgentPlan,
    Episode,
    run_agents,
)
from turnstream.demo.report import (
    DemoSummary,
    count_shards,
    count_streams,
    steps_table,
    summary_table,
    write_reward_png,
)
from turnstream.stack.process import without_progress_bars
from turnstream.stack.up import Stack, UpSettings, embedded_stack
from turnstream.trainer.reference import ReferenceTrainer, ReferenceTrainerSettings, StepReport

__all__ = ["DemoCommand", "DemoError", "DemoSettings", "run_demo"]


class DemoError(TurnstreamError):
    """The demo cannot run as asked (a used run) or did not finish (see the message)."""


class DemoBatching(BatchingSettings):
    """The sink's batching as the demo trains: GRPO groups, a few per step."""

    policy: Literal["count", "tokens", "groups"] = Field("groups", description="groups: GRPO")
    group_size: int = Field(6, ge=2, description="episodes per GRPO group (one prompt)")
    batch_size: int = Field(4, ge=1, description="groups per trainer step")


class DemoSettings(UpSettings):
    """The main job on the embedded default: agents, gateway, log, shards, a GRPO trainer.

    A tiny untrained model learns, live, to write lowercase letters: agents -> gateway -> log ->
    trajectories -> shards, and a GRPO trainer whose new policies the gateway serves."""

    model_config = SettingsConfigDict(cli_prog_name="turnstream demo")

    port: int = Field(0, ge=0, le=65535, description="gateway port; 0 picks a free one")
    steps: int = Field(30, ge=1, le=1000, description="trainer steps (one policy version each)")
    sink: DemoBatching = DemoBatching()
    lr: float = Field(2.5e-3, gt=0, description="the trainer's Adam learning rate")
    warmup_steps: int = Field(
        10, ge=0, description="steps over which the learning rate rises to --lr"
    )
    temperature: float = Field(0.8, gt=0, le=2, description="the agents' sampling temperature")
    update_mode: UpdateMode = Field(
        "abort",
        description="what the gateway does with the agents' generations in flight when the "
        "trainer publishes a version: abort (the default: they end and are continued on the new "
        "weights, each token's version recorded), wait, keep",
    )
    max_tokens: int = Field(16, ge=1, le=256, description="tokens per answer (the reward's unit)")
    seed: int = Field(0, ge=0, description="sampling seed of every episode (replays the demo)")
    json_output: bool = Field(
        False,
        validation_alias=AliasChoices("json", "json_output"),
        description="print the summary as JSON on stdout",
    )

    @model_validator(mode="after")
    def _grpo_groups(self) -> DemoSettings:
        if self.sink.policy != "groups":
            raise ValueError("the demo trains GRPO: --sink.policy must be groups")
        if self.sink.drop_uniform_groups:
            # The agents make exactly the groups each step trains on, then wait for its policy.
            raise ValueError("the demo trains on every group: no --sink.drop-uniform-groups")
        return self

    def plan(self) -> AgentPlan:
        return AgentPlan(
            steps=self.steps,
            group_size=self.sink.group_size,
            groups_per_step=self.sink.batch_size,
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            seed=self.seed,
        )


def demo_settings(settings: DemoSettings) -> DemoSettings:
    """The run (``demo-<time>`` unless ``--run``) and shards cut every 2 s (unless set), so
    that the demo reads back all it made soon after its last step."""
    update: dict[str, object] = {}
    if "run" not in settings.model_fields_set:
        update["run"] = f"demo-{int(time.time())}"
    if "max_age_s" not in settings.shards.model_fields_set:
        update["shards"] = settings.shards.model_copy(update={"max_age_s": 2.0})
    return settings.model_copy(update=update)


def with_taught_model(settings: DemoSettings, console: Console) -> DemoSettings:
    """The built-in tiny model taught to close a tool call (``turnstream.demo.model``), unless
    ``--model`` names a model of its own."""
    if settings.model is not None:
        return settings
    from turnstream.demo.model import teach_tool_call  # torch: import on use

    with console.status("showing the tiny model how a tool call ends (once per data dir)"):
        model = teach_tool_call(settings.model_dir, temperature=settings.temperature)
    return settings.model_copy(update={"model": model, "model_name": settings.model_name or "tiny"})


def intro(settings: DemoSettings, *, taught: bool) -> str:
    s = settings.sink
    model = (
        "a [bold]tiny untrained model[/] (2 layers, 64 wide, random weights: it writes byte "
        "noise; shown beforehand only how to close a tool call)"
        if taught
        else f"the model in {settings.model}"
    )
    return (
        f"[bold]turnstream demo[/], run [bold]{settings.run}[/]: {model} learns by GRPO, live, "
        f"to [bold]write lowercase letters[/]. Reward: the share of an answer's "
        f"{settings.max_tokens} tokens that are one letter a-z (by chance about {CHANCE:.2f}); a "
        f"lookup whose tool call does not parse scores {NO_CALL}. Each of {settings.steps} steps "
        f"trains on {s.batch_size} groups of {s.group_size} episodes sampled from the policy it "
        f"published last: two-turn chats, and lookups in which the model calls the "
        f"dictionary_word tool, gets its result back and answers."
    )


async def _refuse_used_run(stack: Stack, settings: DemoSettings, kv: Bucket) -> None:
    run = settings.run
    streams = await count_streams(stack.event_log.js, settings.log.names, run)
    shards = [s for s in FileShardStore(stack.shard_target).committed() if s.run == run]
    policy = await kv.get(run)
    if streams.sessions or streams.traj_messages or shards or policy is not None:
        raise DemoError(
            f"run {run} is already used in this log ({streams.sessions} sessions, "
            f"{streams.traj_messages} trajectories, {len(shards)} shards under "
            f"{stack.shard_target}, policy {'published' if policy else 'none'}): a demo is a run "
            f"of its own; pass another --run, or none for a fresh demo-<time> id"
        )


def _readable(text: str, width: int = 40) -> str:
    """An answer as one line of text: what is not printable shown as a dot."""
    return escape("".join(ch if ch.isprintable() else "·" for ch in text)[:width])


async def _wait_for_shards(target: str, run: str, rows: int, timeout_s: float = 60.0) -> None:
    """Until the run's shards hold ``rows`` trajectories (footers only)."""
    store = FileShardStore(target)
    deadline = time.monotonic() + timeout_s
    while True:
        held = sum(store.read_metadata(s).rows for s in store.committed() if s.run == run)
        if held >= rows:
            return
        if time.monotonic() > deadline:
            raise DemoError(
                f"the shard writer wrote {held} of run {run}'s {rows} trajectories to {target} "
                f"within {timeout_s:.0f} s; see the log above"
            )
        await asyncio.sleep(0.1)


@dataclass
class _Training:
    """What the live training of one demo run produced."""

    reports: list[StepReport]
    batches: int  # committed by the trainer
    seconds: float
    first: list[Episode]  # the first batch's episodes
    last: list[Episode]  # the last batch's
    served: int  # the policy version the gateway serves afterwards


async def train_live(stack: Stack, settings: DemoSettings, console: Console) -> _Training:
    """The agents and the reference trainer, fed live by the sink, until ``settings.steps``."""
    run = settings.run
    kv = await Bucket.open(stack.event_log.js, settings.log.names.policy_bucket)
    await _refuse_used_run(stack, settings, kv)
    trainer = ReferenceTrainer(
        ReferenceTrainerSettings(
            model_dir=settings.model_dir,
            checkpoint_dir=settings.data_dir / "checkpoints" / run,
            run=run,
            steps=settings.steps,
            lr=settings.lr,
            warmup_steps=settings.warmup_steps,
            temperature=settings.temperature,
            update_mode=settings.update_mode,
        )
    )
    publisher = await JetStreamPublisher(stack.event_log.nc, settings.publisher).start()
    source = LiveSource(
        stack.event_log.js,
        publisher,
        LiveSourceSettings(durable=f"trainer-{run}"),
        stream=settings.log.names.trajectories,
        run=run,
        commits_bucket=settings.log.names.commits_bucket,
    )
    sink = TrainerSink(source, settings.sink, wait_s=0.2)
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    )
    steps = progress.add_task("training", total=settings.steps)
    first: list[Episode] = []
    last: list[Episode] = []

    def on_batch(batch: int, episodes: list[Episode]) -> None:
        first[:] = first or episodes
        last[:] = episodes
        reward = sum(e.reward for e in episodes) / len(episodes)
        progress.update(
            steps,
            completed=batch,  # the gateway serves version `batch`: that many steps are done
            description=f"step {batch + 1}: sampled from version {batch}, mean reward {reward:.3f}",
        )

    started = time.perf_counter()
    try:
        async with httpx.AsyncClient(
            base_url=stack.url,
            timeout=TURN_TIMEOUT_S,
            limits=httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY_S),
        ) as http:
            training = asyncio.create_task(trainer.run(sink, kv), name="trainer")
            try:
                with progress:
                    await run_agents(http, settings.plan(), training, on_batch)
                    reports = await training
                    progress.update(steps, completed=len(reports), description="trained")
            finally:
                if not training.done():
                    training.cancel()
                    await asyncio.gather(training, return_exceptions=True)
            seconds = time.perf_counter() - started
            served = await _served_after(http, reports[-1].version)
    finally:
        await sink.close()
        await publisher.close()
    return _Training(reports, sink.stats.committed, seconds, first, last, served)


async def _served_after(http: httpx.AsyncClient, version: int, timeout_s: float = 30.0) -> int:
    """The version the gateway serves once it has loaded ``version`` (the trainer's last)."""
    deadline = time.monotonic() + timeout_s
    while (served := int((await http.get("/health")).json()["weight_version"])) < version:
        if time.monotonic() > deadline:
            raise DemoError(
                f"the gateway still serves policy version {served} {timeout_s:.0f} s after the "
                f"trainer published {version}; see the log above"
            )
        await asyncio.sleep(0.05)
    return served


async def run_demo(settings: DemoSettings, console: Console) -> DemoSummary:
    """The demo (see the module docstring); its summary, also printed on ``console``."""
    started = time.perf_counter()
    settings = demo_settings(settings)
    console.print(intro(settings, taught=settings.model is None))
    settings = with_taught_model(settings, console)
    run = settings.run
    async with embedded_stack(settings) as stack:
        trained = await train_live(stack, settings, console)
        streams = await count_streams(stack.event_log.js, settings.log.names, run)
        await _wait_for_shards(stack.shard_target, run, streams.traj_messages)
    shards = await asyncio.to_thread(count_shards, stack.shard_target, run)
    reports = trained.reports
    png = settings.data_dir / f"demo-{run}-reward.png"
    await asyncio.to_thread(
        write_reward_png,
        png,
        [r.mean_reward for r in reports],
        title=f"turnstream demo, run {run}\na tiny untrained model learns to write lowercase",
        chance=CHANCE,
    )
    summary = DemoSummary(
        run,
        streams,
        shards,
        trained.batches,
        reports,
        wall_s=time.perf_counter() - started,
        train_s=trained.seconds,
        png=png,
    )
    console.print(steps_table(reports))
    console.print(
        f"after training, new episodes are served weight_version [{trained.served}] (the "
        f"trainer published {[r.version for r in reports]} through the ts_policy bucket)"
    )
    for name, episodes in (("first", trained.first), ("last", trained.last)):
        best = max(episodes, key=lambda e: e.reward)
        console.print(
            f"best answer of the {name} batch ({best.kind}, reward {best.reward:.3f}): "
            f"[green]{_readable(' | '.join(a.text for a in best.answers))}[/]"
        )
    console.print(
        "what the run made, counted in the EVENTS stream and read back from the Parquet shards:"
    )
    console.print(summary_table(summary))
    console.print(f"reward curve: [bold]{png}[/]")
    return summary


class DemoCommand(DemoSettings):
    __doc__ = DemoSettings.__doc__

    def cli_cmd(self) -> None:
        # The progress bar says what these would say a line each (shards cut, policies
        # loaded, weights read): the summary counts them.
        for chatty in ("consumers.shard_writer", "gateway.backends.policy_watch"):
            logging.getLogger(chatty).setLevel(logging.WARNING)
        without_progress_bars()
        summary = asyncio.run(run_demo(self, Console(stderr=True)))
        if self.json_output:
            print(json.dumps(summary.as_json()))
