"""The reference trainer closes the loop through the log alone (issue 5): a real gateway process
on the tiny model, agents on the openai SDK, a fold worker, the live sink, the trainer, and the
new policies going back to the gateway through ``ts_policy``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from consumers import FoldWorker
from eventlog import JetStreamPublisher, connect, read_session
from eventlog.buckets import Bucket
from schemas import TurnCompleted
from tests.conftest import FAST_LOG, Log
from tests.helpers.gateway_process import GatewayProcess
from trainer_sink.config import BatchingSettings, LiveSourceSettings
from trainer_sink.sink import TrainerSink
from trainer_sink.sources import LiveSource
from turnstream.trainer.reference import ReferenceTrainer, ReferenceTrainerSettings, StepReport

pytestmark = pytest.mark.integration

RUN = "e2e"  # GatewayProcess serves this run
GROUP_SIZE = 4
# Not 1 and 1: the trainer must recompute the distribution each token was drawn from, the
# tempered one cut to the top-p nucleus (issue 38: without the nucleus, off by ~0.1 nats). It
# reads both from the trajectories (fold v7), not from its settings.
TEMPERATURE = 0.8
TOP_P = 0.9
FAST_PUBLISH = ("--publisher.ack-timeout-s", "2", "--publisher.max-attempts", "3")


@dataclass(frozen=True)
class Rollout:
    session: str
    served_before: int  # the gateway's weight_version when the session started


async def served_version(http: httpx.AsyncClient) -> int:
    return int((await http.get("/health")).json()["weight_version"])


async def episode(http: httpx.AsyncClient, group: str, turns: int) -> Rollout:
    """One agent episode: 1-2 turns of chat; the reward is the share of letters it wrote."""
    before = await served_version(http)
    opened = (await http.post("/v1/sessions", json={"group": group})).json()
    client = openai.AsyncOpenAI(base_url=opened["base_url"], api_key="unused", max_retries=0)
    messages: list[Any] = [{"role": "user", "content": f"Say something, {group}."}]
    text = ""
    for _ in range(turns):
        reply = await client.chat.completions.create(
            model="tiny",
            messages=messages,
            temperature=TEMPERATURE,
            top_p=TOP_P,
            max_tokens=12,
        )
        content = reply.choices[0].message.content or ""
        text += content
        messages += [
            {"role": "assistant", "content": content},
            {"role": "user", "content": "More."},
        ]
    await client.close()
    reward = sum(c.isalpha() for c in text) / max(len(text), 1)
    closed = await http.post(f"/v1/sessions/{opened['session_id']}/close", json={"reward": reward})
    assert closed.status_code == 200, closed.text
    return Rollout(opened["session_id"], before)


async def agents(
    http: httpx.AsyncClient, until: asyncio.Task[list[StepReport]]
) -> list[list[Rollout]]:
    """Complete GRPO groups, one after another, until training is over."""
    groups: list[list[Rollout]] = []
    n = 0
    deadline = time.monotonic() + 120
    while not until.done():
        assert time.monotonic() < deadline, "the trainer did not finish its steps in 120 s"
        group = f"g{n}"
        groups.append(
            list(
                await asyncio.gather(*(episode(http, group, 1 + i % 2) for i in range(GROUP_SIZE)))
            )
        )
        n += 1
    return groups


@contextlib.asynccontextmanager
async def fold_worker(log: Log) -> AsyncIterator[None]:
    publisher = await JetStreamPublisher(log.nc).start()
    stop = asyncio.Event()
    task = asyncio.create_task(FoldWorker(log.js, publisher).run(stop))
    try:
        yield
    finally:
        stop.set()
        await task
        await publisher.close()


@contextlib.asynccontextmanager
async def live_sink(log: Log) -> AsyncIterator[TrainerSink]:
    nc = await connect(log.server.url, FAST_LOG, name="trainer")
    publisher = await JetStreamPublisher(nc).start()
    source = LiveSource(nc.jetstream(), publisher, LiveSourceSettings(durable="trainer"), run=RUN)
    batching = BatchingSettings(policy="groups", group_size=GROUP_SIZE, batch_size=2)
    sink = TrainerSink(source, batching, wait_s=0.2)
    try:
        yield sink
    finally:
        await sink.close()
        await publisher.close()
        await nc.close()


async def weight_versions(log: Log, session: str) -> list[int]:
    events = await read_session(log.js, RUN, session)
    return [e.weight_version for e in events if isinstance(e, TurnCompleted)]


async def test_the_reference_trainer_agrees_with_the_gateway_and_its_policies_are_served(
    log: Log, tiny_model_dir: Path, tmp_path: Path
) -> None:
    # Started after `log` made the streams and the ts_policy bucket fresh, so it watches them.
    gateway = await asyncio.to_thread(
        GatewayProcess, log.server.url, tiny_model_dir, tmp_path / "gateway", *FAST_PUBLISH
    )
    settings = ReferenceTrainerSettings(
        model_dir=tiny_model_dir,
        checkpoint_dir=tmp_path / "checkpoints",
        run=RUN,
        steps=3,
        lr=1e-3,
    )
    trainer = ReferenceTrainer(settings)
    try:
        async with (
            httpx.AsyncClient(base_url=gateway.url, timeout=30) as http,
            fold_worker(log),
            live_sink(log) as sink,
        ):
            kv = await Bucket.open(log.js, "ts_policy")
            training = asyncio.create_task(trainer.run(sink, kv))
            groups = await agents(http, until=training)
            reports = await training

            deadline = time.monotonic() + 30
            while await served_version(http) != 3:
                assert time.monotonic() < deadline, "the gateway did not load policy version 3"
                await asyncio.sleep(0.1)
            later = await asyncio.gather(*(episode(http, "later", 2) for _ in range(2)))
    finally:
        gateway.stop()

    first = reports[0]
    # Step 1 trains on rollouts of the weights in model_dir, all of which the trainer checks.
    assert first.agreement_samples == first.samples == 2 * GROUP_SIZE
    assert first.logprob_delta is not None and first.logprob_delta <= 1e-4
    for report in reports[1:]:  # later steps check the samples made by their weights, if any
        assert report.logprob_delta is None or report.logprob_delta <= 1e-4
    assert [r.version for r in reports] == [1, 2, 3]
    assert all((r.checkpoint / "model.safetensors").is_file() for r in reports)

    # Every turn carries the version the gateway served when its session began, or a newer one.
    # Groups ran one after another, so versions never go down from one group to the next, and
    # the sessions run after the last step are served the last policy.
    versions = [[await weight_versions(log, r.session) for r in group] for group in groups]
    for group, group_versions in zip(groups, versions, strict=True):
        for rollout, turns in zip(group, group_versions, strict=True):
            assert turns and min(turns) >= rollout.served_before
    spans = [(min(min(t) for t in g), max(max(t) for t in g)) for g in versions]
    assert spans[0][0] == 0
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), spans
    for rollout in later:
        assert await weight_versions(log, rollout.session) == [3, 3]
    print(
        "reference trainer:",
        [
            (r.version, round(r.loss, 4), round(r.mean_reward, 3), r.logprob_delta, r.samples)
            for r in reports
        ],
        "group versions:",
        spans,
    )
