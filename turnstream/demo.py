"""``turnstream demo``: the main job on the embedded default, end to end (DESIGN §9).

``turnstream up`` in this process (a nats-server, the gateway on the tiny local model, a fold
worker, a shard writer), then:

- built-in agents: unmodified ``openai`` SDK clients, each episode a session of a GRPO group
  (one prompt, ``group_size`` rollouts) with two turns and a tool result between them; the
  reward is the share of letters in what the model wrote (something the tiny model can learn);
- the reference GRPO trainer fed live by the trainer sink: each step checks that the log-probs
  it recomputes agree with what the gateway recorded, updates the policy, writes a checkpoint and
  publishes PolicyUpdated; the gateway loads it, and later episodes carry the new weight_version.

At the end: the trainer's steps, the versions the episodes were served, and the trajectories
read back from the Parquet shards, the first one shown with the tokens the policy generated.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pyarrow.compute as pc
from pydantic import Field
from pydantic_settings import SettingsConfigDict
from rich.console import Console
from rich.table import Table
from rich.text import Text
from transformers import AutoTokenizer

from eventlog import JetStreamPublisher, read_session
from eventlog.buckets import Bucket
from eventlog.shard_store import open_shards_dataset
from schemas.events import TrajectoryReady, TurnCompleted
from schemas.shards import table_to_trajectories
from trainer_sink import (
    BatchingSettings,
    LiveSource,
    LiveSourceSettings,
    ReferenceTrainer,
    ReferenceTrainerSettings,
    StepReport,
    TrainerSink,
)
from turnstream.up import Stack, UpSettings, embedded_stack

__all__ = ["DemoCommand", "DemoSettings", "run_demo"]

TEMPERATURE = 0.8
TASKS = ["Name a fruit.", "Describe the sea.", "Spell a word.", "Greet a friend."]


class DemoSettings(UpSettings):
    """The main job on the embedded default: agents -> gateway -> log -> trajectories ->
    shards and a GRPO trainer whose new policies the gateway serves."""

    model_config = SettingsConfigDict(cli_prog_name="turnstream demo")

    port: int = Field(0, ge=0, le=65535, description="gateway port; 0 picks a free one")
    steps: int = Field(3, ge=1, le=100, description="trainer steps (one policy version each)")
    group_size: int = Field(4, ge=2, le=16, description="episodes per GRPO group")


@dataclass(frozen=True)
class Episode:
    group: str
    session: str
    reward: float


async def episode(http: httpx.AsyncClient, group: str, task: str) -> Episode:
    """One agent episode through the OpenAI API: ask, get a tool result, answer."""
    opened = (await http.post("/v1/sessions", json={"group": group})).json()
    client = openai.AsyncOpenAI(base_url=opened["base_url"], api_key="unused", max_retries=0)
    messages: list[Any] = [{"role": "user", "content": task}]
    written = ""
    for turn in range(2):
        reply = await client.chat.completions.create(
            model="tiny", messages=messages, temperature=TEMPERATURE, max_tokens=16
        )
        content = reply.choices[0].message.content or ""
        written += content
        messages.append({"role": "assistant", "content": content})
        if turn == 0:
            messages.append({"role": "user", "content": f"(tool) looked up: {task.lower()}"})
    await client.close()
    reward = sum(c.isalpha() for c in written) / max(len(written), 1)
    await http.post(f"/v1/sessions/{opened['session_id']}/close", json={"reward": reward})
    return Episode(group, opened["session_id"], reward)


async def run_agents(
    http: httpx.AsyncClient, group_size: int, training: asyncio.Task[list[StepReport]]
) -> list[Episode]:
    """Complete groups, one after another, until the trainer has done its steps."""
    episodes: list[Episode] = []
    number = 0
    while not training.done():
        group, task = f"g{number}", TASKS[number % len(TASKS)]
        episodes += await asyncio.gather(*(episode(http, group, task) for _ in range(group_size)))
        number += 1
        if number > 200:
            raise RuntimeError("the trainer did not finish its steps after 200 groups")
    return episodes


async def versions_of(stack: Stack, run: str, session: str) -> list[int]:
    events = await read_session(stack.event_log.js, run, session)
    return [e.weight_version for e in events if isinstance(e, TurnCompleted)]


def show(sample: TrajectoryReady, tokenizer: Any) -> Text:
    """The sample's text, generated tokens (loss_mask 1) in green, the rest dimmed."""
    text = Text()
    ids, mask = sample.input_ids.tolist(), sample.loss_mask.tolist()
    start = 0
    for end in range(1, len(ids) + 1):
        if end == len(ids) or mask[end] != mask[start]:
            chunk = tokenizer.decode(ids[start:end], skip_special_tokens=False)
            text.append(chunk, style="bold green" if mask[start] else "dim")
            start = end
    return text


async def run_demo(settings: DemoSettings, console: Console) -> None:
    started = time.perf_counter()
    # Every demo is a run of its own: a new trainer starts from the base weights at version 0.
    # Shards are cut every half second, so the demo can read back what it made.
    shards = settings.shards.model_copy(update={"max_age_s": 0.5})
    settings = settings.model_copy(update={"run": f"demo-{int(time.time())}", "shards": shards})
    async with embedded_stack(settings) as stack:
        console.print(
            f"[bold]stack up[/]: log {stack.event_log.url}, gateway {stack.url} (tiny model, "
            f"run {settings.run}), fold worker, shard writer -> {stack.shard_target}"
        )
        publisher = await JetStreamPublisher(stack.event_log.nc, settings.publisher).start()
        source = LiveSource(
            stack.event_log.js,
            publisher,
            LiveSourceSettings(durable=f"trainer-{settings.run}"),
            stream=settings.log.names.trajectories,
            run=settings.run,
            commits_bucket=settings.log.names.commits_bucket,
        )
        batching = BatchingSettings(policy="groups", group_size=settings.group_size, batch_size=1)
        sink = TrainerSink(source, batching, wait_s=0.2)
        trainer = ReferenceTrainer(
            ReferenceTrainerSettings(
                model_dir=settings.model_dir,
                checkpoint_dir=settings.data_dir / "checkpoints" / settings.run,
                run=settings.run,
                steps=settings.steps,
                lr=1e-3,
                temperature=TEMPERATURE,
            )
        )
        kv = await Bucket.open(stack.event_log.js, settings.log.names.policy_bucket)
        try:
            async with httpx.AsyncClient(base_url=stack.url, timeout=60) as http:
                training = asyncio.create_task(trainer.run(sink, kv))
                episodes = await run_agents(http, settings.group_size, training)
                reports = await training
                deadline = time.monotonic() + 30
                while (await http.get("/health")).json()["weight_version"] < settings.steps:
                    if time.monotonic() > deadline:
                        raise RuntimeError("the gateway did not load the trainer's last policy")
                    await asyncio.sleep(0.1)
                after = await asyncio.gather(
                    *(episode(http, "after", TASKS[0]) for _ in range(settings.group_size))
                )
        finally:
            await sink.close()
            await publisher.close()
        console.print(
            f"agents: {len(episodes)} episodes in {len(episodes) // settings.group_size} GRPO "
            f"groups of {settings.group_size}, each turn published and acked before it was "
            f"answered"
        )
        steps = Table(
            "step",
            "policy version",
            "samples",
            "mean reward",
            "loss",
            "max |Δ logprob|",
            title="reference GRPO trainer, fed live by the sink",
        )
        for number, report in enumerate(reports, start=1):
            delta = "-" if report.logprob_delta is None else f"{report.logprob_delta:.1e}"
            steps.add_row(
                str(number),
                str(report.version),
                str(report.samples),
                f"{report.mean_reward:.3f}",
                f"{report.loss:.4f}",
                delta,
            )
        console.print(steps)
        served = [await versions_of(stack, settings.run, e.session) for e in after]
        console.print(
            f"after training, new episodes are served weight_version "
            f"{sorted({v for turns in served for v in turns})} (the trainer published "
            f"{[r.version for r in reports]} through the ts_policy bucket)"
        )
        sessions = [e.session for e in [*episodes, *after]]
        deadline = time.monotonic() + 30
        while stack.writer.stats.rows_written < len(sessions):
            if time.monotonic() > deadline:
                raise RuntimeError("the shard writer did not write every trajectory")
            await asyncio.sleep(0.1)
    table = open_shards_dataset(stack.shard_target).to_table(
        filter=pc.field("session").isin(sessions)
    )
    samples = [t for _, t in table_to_trajectories(table)]
    rows = Table(
        "trajectory id",
        "group",
        "tokens",
        "generated",
        "reward",
        "weight versions",
        title=f"run {settings.run}: read back from the Parquet shards ({len(samples)} rows)",
    )
    rows.columns[0].no_wrap = True
    for sample in samples[:8]:
        rows.add_row(
            sample.trajectory_id,
            sample.group,
            str(len(sample.input_ids)),
            str(int(sample.loss_mask.sum())),
            f"{sample.reward:.3f}" if sample.reward is not None else "-",
            f"{sample.min_weight_version}..{sample.max_weight_version}",
        )
    console.print(rows)
    tokenizer = AutoTokenizer.from_pretrained(settings.model_dir)
    console.print("[bold]first trajectory[/] (green: generated by the policy, loss_mask=1)")
    console.print(show(samples[0], tokenizer))
    console.print(f"done in {time.perf_counter() - started:.1f}s")


class DemoCommand(DemoSettings):
    __doc__ = DemoSettings.__doc__

    def cli_cmd(self) -> None:
        from rich.console import Console

        asyncio.run(run_demo(self, Console(stderr=True)))
