"""Benchmark: ``turnstream record`` and ``replay`` against raw JetStream reads and publishes.

Run it from the repository root::

    .venv/bin/python benchmarks/record_replay.py           # 24,000 events of ~4 KB, 6 rounds
    .venv/bin/python benchmarks/record_replay.py --quick   # the same events, 2 rounds

What it measures
----------------
A run of sessions of 10 turns (``TurnCompleted`` with 800 tokens: 600 new prompt ids, 200
completion ids and their logprobs, a short tool result and reply; ~4 KB encoded) plus each
session's open and close, published once into a *source* nats-server started here (file
store, default ``LogSettings`` streams). Then, in rounds that alternate which side goes first:

1. **record**: ours is ``turnstream.data.record.record_run`` (connect, read the run's
   subject with an ordered consumer, write the zstd Parquet recording with its checksum);
   raw is a pull consumer (no acks, batches of 512) reading the same subject's messages into
   memory, nothing written. Checked: the recording holds every event.
2. **replay**: into a second, *target* nats-server whose EVENTS stream is made anew (not
   purged: a purge keeps the duplicate window's Msg-Ids) and the page cache synced, untimed,
   before each run. Ours is ``turnstream.data.replay.replay_recording`` (read and verify
   the file, scan the target run's Msg-Ids, publish pipelined through ``JetStreamPublisher``);
   raw is nats-py ``js.publish_async`` of the same subjects, bytes and Msg-Ids (already in
   memory) and one ``gather`` of the acks. Checked: the target holds every event, none was a
   duplicate.
3. **replay --run NEW**: as 2., but ours decodes every event, rewrites its run and encodes it
   again (raw still publishes the recorded bytes).

``ratio = ours / raw`` of events/s (= of MB/s: the bytes are the same); the target is >= 0.5
for record and replay. MB = 10^6 bytes of event payload. Both servers and the client share this
machine, so absolute rates include the servers' CPU; compare ratios across machines. On a small
machine run-to-run noise is large: the per-round ratios are printed and kept in the JSON. The
LAST line is one JSON object with every figure (``record_ratio``, ``replay_ratio``,
``replay_new_run_ratio``, the absolute rates, the machine, the date).

Today's figures (2026-11-25, the 2-core VM shared with other work at load 5-9): full run
(194 s) record_ratio 0.591, replay_ratio 1.033, replay_new_run_ratio 0.530 (record 2,835
ev/s = 11.0 MB/s against raw 4,794); per-round record ratios 0.40-0.83, replay 0.68-1.21.
``--quick`` (the same 24,000 events, 2 rounds; 89 s) beside it: 0.667, 0.710, 0.585.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from harness.reporting import arguments, banner, finish, machine_info, say
from nats.js import JetStreamContext
from nats.js import api as js_api

from consumers.recording import read_recording
from eventlog import LogSettings, connect, provision
from eventlog.server import NatsServer
from schemas.codec import Codec
from schemas.events import SessionClosed, SessionEvent, SessionOpened, TurnCompleted
from schemas.routing import route
from turnstream.data.record import record_run
from turnstream.data.replay import replay_recording
from turnstream.stack.settings import PublishingSettings

MB = 1_000_000
RUN = "bench"
STREAM = "EVENTS"
TURNS = 10
VOCAB = 151_000


@dataclass(frozen=True)
class Plan:
    sessions: int
    rounds: int  # even: each side goes first in half of them
    new_run_rounds: int


FULL = Plan(sessions=2_000, rounds=6, new_run_rounds=2)  # x (10 turns + open + close) = 24,000
# --quick: the same run, fewer rounds, so each round does the full run's work (with 8,000
# events the quick rates were up to 40% off the full run's, its record ratio 20%).
QUICK = Plan(sessions=2_000, rounds=2, new_run_rounds=2)


def session(index: int, rng: np.random.Generator) -> list[SessionEvent]:
    """One session: open, 10 append-only turns of ~600 tokens each, close."""
    name = f"s{index:06d}"
    events: list[SessionEvent] = [SessionOpened(run=RUN, session=name, created_at=1.7e9)]
    context = 0
    for turn in range(TURNS):
        prompt = rng.integers(0, VOCAB, 600, dtype=np.int32)
        completion = rng.integers(0, VOCAB, 200, dtype=np.int32)
        events.append(
            TurnCompleted(
                run=RUN,
                session=name,
                created_at=1.7e9 + turn,
                turn=turn,
                prefix_len=context,
                prompt_ids=prompt,
                completion_ids=completion,
                logprobs=-rng.exponential(0.5, 200).astype(np.float32),
                new_messages=[{"role": "tool", "content": "ran the tests: 41 passed, 1 failed"}],
                sampling={"temperature": 1.0, "top_p": 1.0, "max_tokens": 4096},
                finish_reason="tool_calls",
                text="The failure is an off-by-one in parse(); fixing it and running again.",
                weight_version=7,
                template_hash="sha256:9f2c1e0b7a4d3c2b1a09f8e7d6c5b4a3",
                backend="vllm-0",
                timings={"queue_s": 0.0012, "ttft_s": 0.043, "total_s": 1.87},
                usage={"prompt_tokens": context + 600, "completion_tokens": 200},
            )
        )
        context += 800
    events.append(SessionClosed(run=RUN, session=name, reward=1.0, num_turns=TURNS))
    return events


Items = list[tuple[str, bytes, str]]


def make_items(plan: Plan, rng: np.random.Generator) -> Items:
    codec = Codec()
    items: Items = []
    for i in range(plan.sessions):
        for event in session(i, rng):
            subject, msg_id = route(event)
            items.append((subject, codec.encode(event), msg_id))
    return items


async def publish_all(js: JetStreamContext, items: Items) -> None:
    for start in range(0, len(items), 2_000):
        futures = [
            await js.publish_async(subject, data, headers={"Nats-Msg-Id": msg_id})
            for subject, data, msg_id in items[start : start + 2_000]
        ]
        await asyncio.gather(*futures)


# -- the sides ---------------------------------------------------------------------------------


@dataclass
class Bench:
    source: NatsServer
    target: NatsServer
    source_js: JetStreamContext
    target_js: JetStreamContext
    items: Items
    recording: Path
    runs: int = 0

    def settings(self, server: NatsServer) -> PublishingSettings:
        return PublishingSettings(run=RUN, log=LogSettings(url=server.url))

    async def record_ours(self) -> None:
        meta = await record_run(self.settings(self.source), self.recording, progress=False)
        assert meta.count == len(self.items), meta

    async def record_raw(self) -> None:
        self.runs += 1
        durable = f"bench-raw-{self.runs}"
        await self.source_js.add_consumer(
            STREAM,
            js_api.ConsumerConfig(
                durable_name=durable,
                ack_policy=js_api.AckPolicy.NONE,
                deliver_policy=js_api.DeliverPolicy.ALL,
                filter_subject=f"ts.ev.{RUN}.>",
                max_ack_pending=-1,
            ),
        )
        sub = await self.source_js.pull_subscribe_bind(durable, stream=STREAM)
        got: list[bytes] = []
        while len(got) < len(self.items):
            got += [msg.data for msg in await sub.fetch(512, timeout=5.0)]
        await sub.unsubscribe()
        await self.source_js.delete_consumer(STREAM, durable)
        assert len(got) == len(self.items)

    async def replay_ours(self) -> None:
        report = await replay_recording(self.settings(self.target), self.recording, progress=False)
        assert report.published == len(self.items) and not report.duplicates, report

    async def replay_new_run_ours(self) -> None:
        report = await replay_recording(
            self.settings(self.target), self.recording, into="bench-new", progress=False
        )
        assert report.published == len(self.items) and not report.duplicates, report

    async def replay_raw(self) -> None:
        futures = [
            await self.target_js.publish_async(subject, data, headers={"Nats-Msg-Id": msg_id})
            for subject, data, msg_id in self.items
        ]
        acks = await asyncio.gather(*futures)
        assert not any(ack.duplicate for ack in acks)

    async def clean_target(self) -> None:
        # A new stream, not a purge: a purge keeps the duplicate window's Msg-Ids, and every
        # run publishes the same ones.
        await self.target_js.delete_stream(STREAM)
        await provision(self.target_js, LogSettings())
        await asyncio.to_thread(os.sync)

    async def check_target(self) -> None:
        stored = (await self.target_js.stream_info(STREAM)).state.messages
        if stored != len(self.items):
            raise RuntimeError(f"the target holds {stored} of {len(self.items)} events")


async def timed(run: Callable[[], Awaitable[None]]) -> float:
    gc.collect()
    start = time.perf_counter()
    await run()
    return time.perf_counter() - start


async def measure(
    bench: Bench, label: str, sides: dict[str, Callable[[], Awaitable[None]]], rounds: int,
    before: Callable[[], Awaitable[None]] | None = None,
    after: Callable[[], Awaitable[None]] | None = None,
) -> dict[str, list[float]]:  # fmt: skip
    """Seconds per run of each side, rounds alternating the order."""
    secs: dict[str, list[float]] = {side: [] for side in sides}
    n = len(bench.items)
    for r in range(rounds):
        order = list(sides) if r % 2 == 0 else list(reversed(sides))
        for side in order:
            if before is not None:
                await before()
            secs[side].append(await timed(sides[side]))
            if after is not None:
                await after()
        say(
            f"  {label:<8} round {r + 1}/{rounds}: "
            + "  ".join(f"{side} {n / secs[side][-1]:>9,.0f} ev/s" for side in order)
        )
    return secs


def summarize(label: str, ours: list[float], raw: list[float], n: int, size: int) -> dict[str, Any]:
    eps_ours, eps_raw = n / statistics.median(ours), n / statistics.median(raw)
    ratio = round(eps_ours / eps_raw, 3)
    say(
        f"  {label:<8} median: ours {eps_ours:>9,.0f} ev/s {eps_ours * size / n / MB:>7,.1f} MB/s"
        f" | raw {eps_raw:>9,.0f} ev/s {eps_raw * size / n / MB:>7,.1f} MB/s | ratio {ratio:.3f}"
    )
    return {
        f"{label}_ratio": ratio,
        f"{label}_ours_events_per_s": round(eps_ours, 1),
        f"{label}_raw_events_per_s": round(eps_raw, 1),
        f"{label}_ours_mb_per_s": round(eps_ours * size / n / MB, 2),
        f"{label}_raw_mb_per_s": round(eps_raw * size / n / MB, 2),
        f"{label}_round_ratios": [round(r / o, 3) for o, r in zip(ours, raw, strict=True)],
    }


async def run_bench(plan: Plan, rng: np.random.Generator, parent: str | None) -> dict[str, Any]:
    items = make_items(plan, rng)
    n, size = len(items), sum(len(data) for _, data, _ in items)
    say(f"{n:,} events, {size / MB:,.1f} MB ({size / n:,.0f} B per event on average)")
    figures: dict[str, Any] = {"events": n, "payload_mb": round(size / MB, 2)}
    with tempfile.TemporaryDirectory(prefix="ts-bench-", dir=parent) as tmp:
        source = NatsServer(Path(tmp) / "source").start()
        target = NatsServer(Path(tmp) / "target").start()
        try:
            source_nc = await connect(source.url, name="bench-source")
            target_nc = await connect(target.url, name="bench-target")
            source_js, target_js = source_nc.jetstream(), target_nc.jetstream()
            await provision(source_js, LogSettings())
            await provision(target_js, LogSettings())
            await publish_all(source_js, items)
            bench = Bench(
                source, target, source_js, target_js, items, Path(tmp) / "recording.parquet"
            )
            await bench.record_ours()  # warm-up, untimed; leaves the file replay reads
            file_mb = bench.recording.stat().st_size / MB
            figures["recording_file_mb"] = round(file_mb, 2)
            assert [e.data for e in read_recording(bench.recording).events] == [
                data for _, data, _ in items
            ]
            say(f"recording: {file_mb:,.1f} MB on disk (zstd)\n")
            secs = await measure(
                bench, "record", {"raw": bench.record_raw, "ours": bench.record_ours}, plan.rounds
            )
            figures |= summarize("record", secs["ours"], secs["raw"], n, size)
            secs = await measure(
                bench, "replay", {"raw": bench.replay_raw, "ours": bench.replay_ours},
                plan.rounds, before=bench.clean_target, after=bench.check_target,
            )  # fmt: skip
            figures |= summarize("replay", secs["ours"], secs["raw"], n, size)
            secs = await measure(
                bench, "new-run", {"raw": bench.replay_raw, "ours": bench.replay_new_run_ours},
                plan.new_run_rounds, before=bench.clean_target, after=bench.check_target,
            )  # fmt: skip
            figures |= summarize("replay_new_run", secs["ours"], secs["raw"], n, size)
            await source_nc.close()
            await target_nc.close()
        finally:
            source.stop()
            target.stop()
    return figures


async def main() -> None:
    parser = arguments(
        __doc__,
        "the same 24,000 events, 2 rounds instead of 6",
        seed="seed of the token ids",
        store_dir=True,
    )
    args = parser.parse_args()
    plan = QUICK if args.quick else FULL
    started = time.perf_counter()
    info = machine_info("nats-py", "pyarrow", "msgspec")
    banner("record/replay", args.quick, info)
    figures = await run_bench(plan, np.random.default_rng(args.seed), args.store_dir)
    finish(figures, quick=args.quick, duration_s=time.perf_counter() - started, info=info)


if __name__ == "__main__":
    logging.basicConfig(level=logging.ERROR)
    asyncio.run(main())
