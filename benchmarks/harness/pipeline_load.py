"""Load for the pipeline benchmarks (``pipeline_throughput.py``, ``sink_assembly.py``): append-only
sessions of ``Plan.turns`` turns of random int32 ids published as events, their closes published
later, and the waits on the pipeline's consumers."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import numpy as np
from nats.js import JetStreamContext

from harness.processes import RUN
from harness.synthetic_sessions import CHARS_PER_TOKEN, VOCAB
from schemas.events import SessionClosed, SessionEvent, SessionOpened, TurnCompleted


@dataclass(frozen=True)
class Plan:
    sessions: int
    latency_sessions: int
    turns: int = 10
    prompt_tokens: int = 1_500
    completion_tokens: int = 500


def make_session(
    rng: np.random.Generator, corpus: str, index: int, plan: Plan
) -> list[SessionEvent]:
    """Open + turns of one append-only session (the close is published later)."""
    session = f"s{index:06d}"
    events: list[SessionEvent] = [
        SessionOpened(run=RUN, session=session, group=f"g{index // 8}", created_at=time.time())
    ]
    context = 0
    for t in range(plan.turns):
        n_prompt, n_completion = plan.prompt_tokens, plan.completion_tokens
        start = int(rng.integers(0, len(corpus) - n_prompt * CHARS_PER_TOKEN))
        content = corpus[start : start + n_prompt * CHARS_PER_TOKEN]
        events.append(
            TurnCompleted(
                run=RUN,
                session=session,
                turn=t,
                prefix_len=context,
                prompt_ids=rng.integers(0, VOCAB, n_prompt, dtype=np.int32),
                completion_ids=rng.integers(0, VOCAB, n_completion, dtype=np.int32),
                logprobs=-rng.random(n_completion, dtype=np.float32),
                message_prefix_len=2 * t,
                new_messages=[{"role": "tool" if t else "user", "content": content}],
                text=corpus[start : start + n_completion * CHARS_PER_TOKEN],
                weight_version=1,
                created_at=time.time(),
            )
        )
        context += n_prompt + n_completion
    return events


def close_of(events: list[SessionEvent], plan: Plan) -> SessionClosed:
    return SessionClosed(
        run=RUN, session=events[0].session, reward=1.0, num_turns=plan.turns, created_at=time.time()
    )


def tokens_of(plan: Plan) -> int:
    return plan.turns * (plan.prompt_tokens + plan.completion_tokens)


async def wait_for(what: str, condition, timeout_s: float, poll_s: float = 0.1) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not await condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"benchmark stuck: {what} not within {timeout_s:.0f}s")
        await asyncio.sleep(poll_s)


async def consumers_idle(js: JetStreamContext, names: list[str]) -> bool:
    for name in names:
        try:
            info = await js.consumer_info("EVENTS", name)
        except Exception:
            return False
        if info.num_pending or info.num_ack_pending:
            return False
    return True
