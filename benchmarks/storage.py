"""Benchmark: stream bytes per unique token, delta-encoded turns against full prompts per turn.

Run it from the repository root (nats-server on PATH, or in the venv's bin)::

    .venv/bin/python benchmarks/storage.py           # full run, 128 sessions
    .venv/bin/python benchmarks/storage.py --quick   # 8 sessions, a few seconds

What it measures
----------------
Synthetic agent sessions, seeded: a system prompt (900-1,600 tokens) and a task (150-400
tokens), then 30 turns. Each turn the model writes 100-300 tokens; 85% of turns end in a tool
call (a short thought + JSON arguments) answered by a tool result of 100-800 tokens, the rest
end in a reply answered by a user message of 20-200 tokens; the last turn is a reply. Every
message carries ~4 characters of text per token of content; the chat template adds 5 tokens per
message and 3 for the generation prompt. Token ids are random int32, logprobs float32.

Each session is published twice as real events (``SessionOpened``, ``TurnCompleted`` per turn,
``SessionClosed``; the default ``schemas.codec.Codec``; ``JetStreamPublisher.publish_many``) to
a nats-server started by this script (file store, default ``LogSettings`` streams):

* **delta**: what the gateway publishes. Each turn's prompt and messages are delta-encoded with
  ``schemas.delta.encode_delta`` against the previous turn's full context, so a turn stores the
  prefix length, the new prompt tokens (the tool result or user message) and the new messages.
* **full**: what an in-memory proxy records. Each turn stores its whole prompt
  (``prefix_len`` 0) and the whole conversation (``message_prefix_len`` 0). Everything else
  (completion, logprobs, text, tool calls, sampling, timings, usage; the tools list on turn 0
  only) is the same bytes in both.

Both variants are stored for the sessions truncated to 10, 20 and 30 turns (open, the first k
turns, close), one variant at a time into a freshly purged EVENTS stream; the stream's
``state.bytes`` (``js.stream_info``) is the stored size, JetStream's per-message overhead
(subject, ``Nats-Msg-Id`` header, record framing) included. The codec payload bytes are reported
next to it. Unique tokens = the session's final full context (last prompt + last completion),
summed over the sessions. ``bytes/token`` = bytes / unique tokens; ``ratio`` = full / delta.
Target: ``full_over_delta_ratio_30_turns`` >= 10.

Decode check (exits 1 when it fails): after the 30-turn delta run, every session is read back
from the stream (``eventlog.read_session``, the fold worker's path), every turn's full prompt
and conversation are rebuilt with ``schemas.delta.replay_context`` and compared with what the
model saw, and ``consumers.fold.fold`` must give one trajectory whose ``input_ids`` are the final
context. After the 30-turn full run, the last turn of every session read back must hold the
same full prompt.

Reading the output: a table per turn count, then the LAST line: one JSON object with
``bytes_per_token_delta`` and ``full_over_delta_ratio_30_turns`` (stream bytes), their payload
counterparts, the ratios at 10 and 20 turns, the machine and the date. Sizes do not depend on
the machine; only ``duration_s`` does.

Today's figures (2026-11-25, the 2-core VM): full run (128 sessions, 26 s) 10.54 stream bytes
per unique token delta-encoded against 137.2 full; ``full_over_delta_ratio_30_turns`` 13.01
(5.08 at 10 turns, 9.07 at 20). ``--quick`` (8 sessions, 4 s) reports the same keys and ratios
within 3% of those (13.31 at 30 turns); only the absolute byte totals scale with the sessions.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from harness.reporting import banner, finish, machine_info, say
from harness.synthetic_sessions import TOOLS, TURNS, Session, SessionMaker, session_arguments
from nats.js import JetStreamContext
from subagents import subagents_main

from consumers.fold import fold
from eventlog import JetStreamPublisher, LogSettings, connect, provision, read_session
from eventlog.server import NatsServer
from schemas.codec import Codec
from schemas.delta import encode_delta, replay_context
from schemas.events import JSON, SessionClosed, SessionEvent, SessionOpened, TurnCompleted

STREAM = "EVENTS"
CHECKPOINTS = (10, 20, 30)
TARGET_RATIO = 10.0


@dataclass(frozen=True)
class Plan:
    """How much work the run does (``--quick`` shrinks it)."""

    sessions: int


FULL = Plan(sessions=128)
QUICK = Plan(sessions=8)


# -- events -----------------------------------------------------------------------------------


def session_events(
    session: Session, run: str, num_turns: int, *, delta: bool
) -> list[SessionEvent]:
    """Open, the first ``num_turns`` turns (delta-encoded or full), close."""
    t0 = 1_800_000_000.0
    events: list[SessionEvent] = [
        SessionOpened(
            run=run,
            session=session.id,
            created_at=t0,
            group=f"task-{session.id[:8]}",
            metadata={"task": session.task, "env": "swe-sandbox", "seed": 7},
            model="Qwen/Qwen3-8B",
        )
    ]
    context = np.empty(0, dtype=np.int32)
    conversation: list[JSON] = []
    for index, turn in enumerate(session.turns[:num_turns]):
        if delta:
            encoded = encode_delta(context, conversation, turn.prompt, turn.messages)
            if encoded.prefix_len != len(context):
                raise AssertionError(f"{session.id} turn {index} does not extend the last one")
        else:
            encoded = encode_delta([], [], turn.prompt, turn.messages)
        events.append(
            TurnCompleted(
                run=run,
                session=session.id,
                created_at=t0 + 5.0 * (index + 1),
                turn=index,
                prefix_len=encoded.prefix_len,
                prompt_ids=encoded.prompt_ids,
                completion_ids=turn.completion,
                logprobs=turn.logprobs,
                message_prefix_len=encoded.message_prefix_len,
                new_messages=encoded.new_messages,
                tools=TOOLS if index == 0 else None,
                sampling={"temperature": 1.0, "top_p": 1.0, "max_tokens": 4096, "logprobs": 1},
                finish_reason=turn.finish_reason,
                text=turn.text,
                tool_calls=turn.tool_calls,
                weight_version=41 + index // 12,
                template_hash="sha256:9f2c1e0b7a4d3c2b1a09f8e7d6c5b4a3",
                backend="vllm-0",
                timings={"queue_s": 0.0012, "ttft_s": 0.043, "total_s": 1.87},
                usage={
                    "prompt_tokens": len(turn.prompt),
                    "completion_tokens": len(turn.completion),
                },
            )
        )
        context = turn.context
        conversation = [*turn.messages, turn.assistant_message]
    events.append(
        SessionClosed(
            run=run,
            session=session.id,
            created_at=t0 + 5.0 * (num_turns + 1),
            status="completed",
            reward=1.0,
            num_turns=num_turns,
        )
    )
    return events


def array_bytes(events: list[SessionEvent]) -> int:
    """Bytes of token ids and logprobs in ``events`` (the rest is text and metadata)."""
    return sum(
        e.prompt_ids.nbytes + e.completion_ids.nbytes + e.logprobs.nbytes
        for e in events
        if isinstance(e, TurnCompleted)
    )


# -- the stream -------------------------------------------------------------------------------


@dataclass
class Stored:
    messages: int
    payload_bytes: int
    array_bytes: int
    stream_bytes: int


async def store(
    js: JetStreamContext,
    pub: JetStreamPublisher,
    sessions: list[Session],
    run: str,
    num_turns: int,
    *,
    delta: bool,
) -> Stored:
    """Publish every session into the purged stream; what it then holds."""
    await js.purge_stream(STREAM)
    before = (await js.stream_info(STREAM)).state
    if before.messages or before.bytes:
        raise RuntimeError(f"{STREAM} holds {before.messages} messages after a purge")
    codec = Codec()
    messages = payload = arrays = 0
    for session in sessions:  # one session at a time: the full variant is large
        events = session_events(session, run, num_turns, delta=delta)
        receipts = await pub.publish_many(events)
        if any(r.duplicate or r.spooled for r in receipts):
            raise RuntimeError(f"{run}/{session.id}: a duplicate or spooled publish")
        messages += len(events)
        payload += sum(len(codec.encode(e)) for e in events)
        arrays += array_bytes(events)
    state = (await js.stream_info(STREAM)).state
    if state.messages != messages:
        raise RuntimeError(f"{STREAM} holds {state.messages} messages, {messages} published")
    return Stored(messages, payload, arrays, state.bytes)


async def check_delta(js: JetStreamContext, sessions: list[Session], run: str) -> int:
    """Rebuild every turn of every session from the stored delta events; returns turns checked.

    Raises AssertionError naming the session and turn that does not match the model's view.
    """
    checked = 0
    for session in sessions:
        events = await read_session(js, run, session.id)
        turns = sorted((e for e in events if isinstance(e, TurnCompleted)), key=lambda e: e.turn)
        if len(turns) != TURNS:
            raise AssertionError(f"{run}/{session.id}: {len(turns)} turns read back of {TURNS}")
        for index, (event, truth) in enumerate(zip(turns, session.turns, strict=True)):
            context, conversation = replay_context(turns[:index])
            prompt = np.concatenate([context[: event.prefix_len], event.prompt_ids])
            messages = [*conversation[: event.message_prefix_len], *event.new_messages]
            if not np.array_equal(prompt, truth.prompt) or messages != truth.messages:
                raise AssertionError(
                    f"{run}/{session.id} turn {index}: the prompt rebuilt from the delta events "
                    f"({len(prompt)} tokens, {len(messages)} messages) is not the full prompt "
                    f"({len(truth.prompt)} tokens, {len(truth.messages)} messages)"
                )
            checked += 1
        [trajectory] = fold(events).trajectories
        if not np.array_equal(trajectory.input_ids, session.turns[-1].context):
            raise AssertionError(f"{run}/{session.id}: the fold's input_ids are not the context")
    return checked


async def check_full(js: JetStreamContext, sessions: list[Session], run: str) -> None:
    """The last stored full-prompt turn of every session is the prompt the model saw."""
    for session in sessions:
        events = await read_session(js, run, session.id)
        last = max((e for e in events if isinstance(e, TurnCompleted)), key=lambda e: e.turn)
        truth = session.turns[-1]
        if last.prefix_len or not np.array_equal(last.prompt_ids, truth.prompt):
            raise AssertionError(f"{run}/{session.id}: the stored full prompt differs")
        if last.new_messages != truth.messages:
            raise AssertionError(f"{run}/{session.id}: the stored conversation differs")


async def measure(
    sessions: list[Session], store_parent: str | None
) -> tuple[dict[int, dict[str, Stored]], int]:
    results: dict[int, dict[str, Stored]] = {}
    with tempfile.TemporaryDirectory(prefix="ts-bench-", dir=store_parent) as tmp:
        server = NatsServer(Path(tmp) / "nats").start()
        try:
            nc = await connect(server.url, name="bench-storage")
            try:
                js = nc.jetstream()
                await provision(js, LogSettings())
                pub = await JetStreamPublisher(nc).start()
                try:
                    checked = await _measure(js, pub, sessions, results)
                finally:
                    await pub.close()
            finally:
                await nc.close()
        finally:
            server.stop()
    return results, checked


async def _measure(
    js: JetStreamContext,
    pub: JetStreamPublisher,
    sessions: list[Session],
    results: dict[int, dict[str, Stored]],
) -> int:
    checked = 0
    for k in CHECKPOINTS:
        results[k] = {}
        for variant in ("delta", "full"):
            run = f"storage-{variant[0]}{k:02d}"  # same length for both: same subject overhead
            t0 = time.perf_counter()
            stored = await store(js, pub, sessions, run, k, delta=variant == "delta")
            results[k][variant] = stored
            if k == TURNS and variant == "delta":
                checked = await check_delta(js, sessions, run)
            elif k == TURNS:
                await check_full(js, sessions, run)
            say(
                f"  {k:>2} turns {variant:<5} {stored.messages:>6,} msgs "
                f"{stored.payload_bytes:>14,} B payload {stored.stream_bytes:>14,} B stream "
                f"({time.perf_counter() - t0:.1f} s)"
            )
    return checked


# -- main -------------------------------------------------------------------------------------


def figures_of(
    sessions: list[Session], results: dict[int, dict[str, Stored]], checked: int
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    say(
        f"\n  {'turns':>5} {'unique tokens':>14} {'delta B/token':>14} {'full B/token':>13} "
        f"{'ratio':>7} {'payload ratio':>14} {'delta payload B/token':>22}"
    )
    for k in CHECKPOINTS:
        unique = sum(s.unique_tokens(k) for s in sessions)
        delta, full = results[k]["delta"], results[k]["full"]
        per_token = {v: results[k][v].stream_bytes / unique for v in ("delta", "full")}
        ratio = full.stream_bytes / delta.stream_bytes
        payload_ratio = full.payload_bytes / delta.payload_bytes
        out[f"full_over_delta_ratio_{k}_turns"] = round(ratio, 2)
        out[f"payload_full_over_delta_ratio_{k}_turns"] = round(payload_ratio, 2)
        out[f"bytes_per_token_delta_{k}_turns"] = round(per_token["delta"], 3)
        out[f"bytes_per_token_full_{k}_turns"] = round(per_token["full"], 3)
        out[f"unique_tokens_{k}_turns"] = unique
        for variant, stored in results[k].items():
            out[f"stream_bytes_{variant}_{k}_turns"] = stored.stream_bytes
            out[f"payload_bytes_{variant}_{k}_turns"] = stored.payload_bytes
        say(
            f"  {k:>5} {unique:>14,} {per_token['delta']:>14.2f} {per_token['full']:>13.1f} "
            f"{ratio:>7.2f} {payload_ratio:>14.2f} {delta.payload_bytes / unique:>22.2f}"
        )
    last = results[TURNS]
    unique = out[f"unique_tokens_{TURNS}_turns"]
    delta = last["delta"]
    overhead = (delta.stream_bytes - delta.payload_bytes) / delta.messages
    return {
        "bytes_per_token_delta": out[f"bytes_per_token_delta_{TURNS}_turns"],
        "bytes_per_token_full": out[f"bytes_per_token_full_{TURNS}_turns"],
        "payload_bytes_per_token_delta": round(delta.payload_bytes / unique, 3),
        "payload_bytes_per_token_full": round(last["full"].payload_bytes / unique, 3),
        "full_over_delta_ratio_30_turns": out["full_over_delta_ratio_30_turns"],
        "target_ratio": TARGET_RATIO,
        "target_met": out["full_over_delta_ratio_30_turns"] >= TARGET_RATIO,
        "sessions": len(sessions),
        "unique_tokens_per_session_30_turns": round(unique / len(sessions)),
        "delta_array_share_of_payload": round(delta.array_bytes / delta.payload_bytes, 3),
        "stream_overhead_bytes_per_message": round(overhead, 1),
        "decode_check": f"ok: {checked} turns rebuilt from delta events",
        **out,
    }


async def main() -> int:
    parser = session_arguments(__doc__)
    parser.add_argument(
        "--subagents",
        action="store_true",
        help="a main agent and 4 interleaved sub-agents sharing its 32k-token system prompt and "
        "history: log bytes with deltas against each turn's parent vs the previous turn",
    )
    args = parser.parse_args()
    if args.subagents:
        await subagents_main(parser, args)
        return 0
    plan = QUICK if args.quick else FULL
    started = time.perf_counter()
    info = machine_info("nats-py", "msgspec", "numpy")
    banner("storage", args.quick, info)
    maker = SessionMaker(np.random.default_rng(args.seed))
    sessions = [maker.session() for _ in range(plan.sessions)]
    say(
        f"{len(sessions)} sessions of {TURNS} turns, "
        f"{np.mean([s.unique_tokens(TURNS) for s in sessions]):,.0f} unique tokens each on average"
    )
    try:
        results, checked = await measure(sessions, args.store_dir)
    except AssertionError as exc:
        say(f"DECODE CHECK FAILED: {exc}")
        return 1
    say(f"decode check: ok, {checked} turns rebuilt from the stored delta events")
    figures = figures_of(sessions, results, checked)
    if not figures["target_met"]:
        say(f"target not met: full/delta {figures['full_over_delta_ratio_30_turns']} < 10")
    finish(figures, quick=args.quick, duration_s=time.perf_counter() - started, info=info)
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.ERROR)
    sys.exit(asyncio.run(main()))
