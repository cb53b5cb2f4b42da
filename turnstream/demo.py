"""``turnstream demo``: simulated agent sessions through the log, folded into trajectories.

Until the gateway exists, the "agent" and "model" are scripted: a calculator agent calls a tool,
reads its result, answers; every other session then rewrites its history (a summary), which
the fold turns into a second segment. Tokens are the UTF-8 bytes of a ChatML rendering, so the
trajectory can be shown as text with the tokens the policy generated highlighted.

Everything else is real: the embedded nats-server, the durable publisher (each turn acked by
JetStream), reading the session back from the EVENTS stream, and the pure fold.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import numpy as np
import pyarrow.compute as pc
from rich.console import Console
from rich.table import Table
from rich.text import Text

from consumers import FoldWorker, ShardWriterSettings
from consumers.shard_store import FileShardStore
from consumers.shard_writer import ShardWriter
from schemas import (
    Event,
    RewardAssigned,
    SessionClosed,
    SessionOpened,
    TrajectoryReady,
    TurnCompleted,
)
from schemas.delta import encode_delta
from schemas.events import JSON
from schemas.ids import new_session_id
from schemas.log import JetStreamPublisher, Outbox
from schemas.shards import open_shards_dataset, table_to_trajectories
from turnstream.settings import ServiceSettings
from turnstream.stack import EventLog, open_log

SYSTEM = "You are a calculator agent. Call the calc tool, then answer."


def render(messages: list[JSON]) -> list[int]:
    """ChatML as UTF-8 bytes, ending with the assistant header the model continues from."""
    text = "".join(f"<|im_start|>{m['role']}\n{m['content'] or ''}<|im_end|>\n" for m in messages)
    return list((text + "<|im_start|>assistant\n").encode())


@dataclass
class ScriptedTurn:
    messages: list[JSON]  # the full conversation the model answers
    reply: str


def script(index: int, a: int, b: int) -> list[ScriptedTurn]:
    call = {"name": "calc", "arguments": json.dumps({"expr": f"{a} * {b}"})}
    question = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{a} * {b}?"}]
    turns = [
        ScriptedTurn(question, f"<tool_call>{json.dumps(call)}</tool_call>"),
        ScriptedTurn(
            [
                *question,
                {"role": "assistant", "content": f"<tool_call>{json.dumps(call)}</tool_call>"},
                {"role": "tool", "content": str(a * b)},
            ],
            f"{a} * {b} = {a * b}.",
        ),
    ]
    if index % 2:  # the agent summarizes its history: the next prompt no longer extends it
        summary = f"Earlier: {a} * {b} = {a * b}. Now add 9."
        turns.append(
            ScriptedTurn(
                [{"role": "system", "content": SYSTEM}, {"role": "user", "content": summary}],
                f"{a * b} + 9 = {a * b + 9}.",
            )
        )
    return turns


def session_events(
    run: str,
    session: str,
    turns: list[ScriptedTurn],
    rng: np.random.Generator,
) -> list[TurnCompleted]:
    """Delta-encode each turn against the previous one, as the gateway does."""
    events: list[TurnCompleted] = []
    context: list[int] = []
    history: list[JSON] = []
    for t, turn in enumerate(turns):
        prompt = render(turn.messages)
        completion = list((turn.reply + "<|im_end|>").encode())
        events.append(
            TurnCompleted(
                run=run,
                session=session,
                turn=t,
                created_at=time.time(),
                **encode_delta(context, history, prompt, turn.messages)._asdict(),
                completion_ids=np.array(completion),
                logprobs=-rng.exponential(0.3, len(completion)),
                text=turn.reply,
                finish_reason="stop",
                backend="scripted",
            )
        )
        context = prompt + completion
        history = [*turn.messages, {"role": "assistant", "content": turn.reply}]
    return events


def show(sample: TrajectoryReady) -> Text:
    """The sample's text, generated tokens (loss_mask 1) in green, the rest dimmed."""
    text = Text()
    ids, mask = sample.input_ids, sample.loss_mask
    edges = np.flatnonzero(np.diff(mask)) + 1
    for start, end in zip([0, *edges], [*edges, len(ids)], strict=True):
        chunk = bytes(ids[start:end].astype(np.uint8)).decode(errors="replace")
        text.append(chunk, style="bold green" if mask[start] else "dim")
    return text


async def fold_and_shard(
    settings: ServiceSettings, event_log: EventLog, sessions: list[str], console: Console
) -> list[TrajectoryReady]:
    """Run a fold worker and a shard writer in this process until ``sessions`` are in shards."""
    target = str(settings.data_dir / "shards")
    publisher = await JetStreamPublisher(event_log.nc, settings.publisher).start()
    names = settings.log.names
    worker = FoldWorker(event_log.js, publisher, names=names)
    writer = ShardWriter(
        event_log.js,
        publisher,
        FileShardStore(target),
        ShardWriterSettings(max_age_s=0.2),
        stream=names.trajectories,
    )
    stop = asyncio.Event()
    running = [asyncio.create_task(worker.run(stop)), asyncio.create_task(writer.run(stop))]
    try:
        async with asyncio.timeout(60):
            while True:
                await asyncio.sleep(0.1)
                for task in running:
                    if task.done():
                        task.result()  # a worker that stopped early: raise its error here
                folded = worker.stats.sessions_folded >= len(sessions)
                if folded and writer.stats.rows_written >= worker.stats.trajectories:
                    break
    finally:
        stop.set()
        await asyncio.gather(*running, return_exceptions=True)
        await publisher.close()
    table = open_shards_dataset(target).to_table(filter=pc.field("session").isin(sessions))
    console.print(
        f"fold worker: {worker.stats.sessions_folded} sessions -> "
        f"{worker.stats.trajectories} trajectories ({worker.stats.forks} forks) on TRAJ; "
        f"shard writer: {writer.stats.rows_written} rows in {writer.stats.shards_written} "
        f"Parquet shard(s) under {target}"
    )
    order = {session: i for i, session in enumerate(sessions)}
    samples = [t for _, t in table_to_trajectories(table)]
    return sorted(samples, key=lambda t: (order[t.session], t.segment))


async def run_demo(settings: ServiceSettings, sessions: int, console: Console) -> None:
    rng = np.random.default_rng(0)
    started = time.perf_counter()
    async with open_log(settings, name="turnstream-demo") as event_log:
        console.print(f"[bold]event log[/] {event_log.url} (streams provisioned)")
        outbox = Outbox(settings.data_dir / "outbox.log", settings.publisher.outbox_max_bytes)
        publisher = await JetStreamPublisher(
            event_log.nc, settings.publisher, outbox=outbox
        ).start()
        ids = [new_session_id() for _ in range(sessions)]
        published = 0
        try:
            for index, session in enumerate(ids):
                a, b = int(rng.integers(10, 99)), int(rng.integers(10, 99))
                turns = session_events(settings.run, session, script(index, a, b), rng)
                events: list[Event] = [
                    SessionOpened(
                        run=settings.run,
                        session=session,
                        group=f"q{index // 2}",
                        metadata={"task": "calc", "expr": f"{a}*{b}"},
                        model="scripted",
                    ),
                    *turns,
                    RewardAssigned(run=settings.run, session=session, value=1.0, key="correct"),
                    SessionClosed(run=settings.run, session=session, num_turns=len(turns)),
                ]
                for event in events:  # one by one, as a gateway answers turn after turn
                    await publisher.publish(event)
                published += len(events)
        finally:
            await publisher.close()
            outbox.close()
        console.print(
            f"published {published} events for {sessions} sessions, each acked by JetStream"
        )

        samples = await fold_and_shard(settings, event_log, ids, console)
        table = Table(
            "trajectory id",
            "turns",
            "tokens",
            "generated",
            "reward",
            "status",
            title=f"run {settings.run}: folded from the EVENTS stream, read back from the shards",
        )
        table.columns[0].no_wrap = True
        for sample in samples:
            table.add_row(
                sample.trajectory_id,
                str(sample.num_turns),
                str(len(sample.input_ids)),
                str(int(sample.loss_mask.sum())),
                f"{sample.reward}",
                sample.status,
            )
        console.print(table)
        console.print("[bold]first trajectory[/] (green: generated by the policy, loss_mask=1)")
        console.print(show(samples[0]))
        info = await event_log.js.stream_info(settings.log.names.events)
        tokens = sum(len(s.input_ids) for s in samples)
        console.print(
            f"EVENTS holds {info.state.messages} messages, {info.state.bytes:,} bytes "
            f"for {tokens:,} trajectory tokens; done in {time.perf_counter() - started:.1f}s"
        )
