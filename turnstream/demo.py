"""``turnstream demo``: simulated agent sessions through the log, folded into trajectories.

Until the gateway exists, the "agent" and "model" are scripted: a calculator agent calls a tool,
reads its result, answers; every other session then rewrites its history (a summary), which
the fold turns into a second segment. Tokens are the UTF-8 bytes of a ChatML rendering, so the
trajectory can be shown as text with the tokens the policy generated highlighted.

Everything else is real: the embedded nats-server, the durable publisher (each turn acked by
JetStream), reading the session back from the EVENTS stream, and the pure fold.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import numpy as np
from rich.console import Console
from rich.table import Table
from rich.text import Text

from consumers import FoldResult, fold
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
from schemas.log import JetStreamPublisher, Outbox, read_session
from turnstream.settings import ServiceSettings
from turnstream.stack import open_log

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

        table = Table(
            "trajectory id",
            "turns",
            "tokens",
            "generated",
            "reward",
            "forks",
            title=f"run {settings.run}: folded from the EVENTS stream",
        )
        table.columns[0].no_wrap = True
        results: list[FoldResult] = []
        for session in ids:
            result = fold(await read_session(event_log.js, settings.run, session))
            results.append(result)
            for sample in result.trajectories:
                table.add_row(
                    sample.trajectory_id,
                    str(sample.num_turns),
                    str(len(sample.input_ids)),
                    str(int(sample.loss_mask.sum())),
                    f"{sample.reward}",
                    str(result.forks),
                )
        console.print(table)
        console.print("[bold]first trajectory[/] (green: generated by the policy, loss_mask=1)")
        console.print(show(results[0].trajectories[0]))
        info = await event_log.js.stream_info(settings.log.names.events)
        tokens = sum(len(s.input_ids) for r in results for s in r.trajectories)
        console.print(
            f"EVENTS holds {info.state.messages} messages, {info.state.bytes:,} bytes "
            f"for {tokens:,} trajectory tokens; done in {time.perf_counter() - started:.1f}s"
        )
