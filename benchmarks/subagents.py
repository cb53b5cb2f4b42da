"""Benchmark: a session tree in the log, deltas against parents vs previous turns (also
``storage.py --subagents``).

A main agent A has a 32k-token system prompt (the tools included) and a task, and takes
``MAIN_TURNS`` turns of tool calls. It then runs ``SUBAGENTS`` sub-agents that share its system
prompt and history: each sub-agent's conversation is A's conversation so far plus its own
instruction, and each takes ``SUBAGENT_TURNS`` turns (tool call, tool result), all of them
interleaved round-robin on the one session, as a coding agent's parallel task agents do. Then A
takes ``MAIN_TURNS`` more turns with their results. Sizes as in ``storage.py`` (random int32 ids,
~4 characters of text per token, chat-template tokens per message).

The same turns are published twice into a purged EVENTS stream on a real nats-server:

* **tree**: each turn delta-encoded against its parent, the turn of its own conversation that it
  extends (``parent_turn``), as the gateway publishes it now;
* **linear**: each turn delta-encoded against the turn before it in the session, whatever
  conversation that was (``parent_turn`` unset): the encoding before sessions were trees. A
  sub-agent's turn then shares only A's history with the turn before it (another sub-agent's), so
  it stores its own conversation since it started again, turn after turn.

Decode check (exits 1 when it fails): every tree-encoded session read back from the stream folds
(``consumers.fold.fold``) into one trajectory per conversation whose tokens are exactly that
conversation's final context, and the sampled ids of every turn are where the model wrote them.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import logging
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from harness import STREAM
from harness.reporting import finish, machine_info, say
from harness.synthetic_sessions import (
    GENERATION_PROMPT_TOKENS,
    TOOLS,
    SessionMaker,
    session_arguments,
)
from nats.js import JetStreamContext

from consumers.fold import fold
from eventlog import JetStreamPublisher, LogSettings, connect, provision, read_session
from eventlog.server import NatsServer
from schemas.codec import Codec
from schemas.delta import encode_delta
from schemas.events import JSON, SessionClosed, SessionEvent, SessionOpened, TurnCompleted

SYSTEM_TOKENS = 32_000
SUBAGENTS = 4
MAIN_TURNS = 4
SUBAGENT_TURNS = 8


@dataclass(frozen=True)
class TreeTurn:
    """A turn as the model lived it, and the turn of its conversation it extends (-1: none)."""

    conversation: str  # "main" or "sub-<i>"
    parent: int
    prompt: np.ndarray  # int32
    messages: list[JSON]
    completion: np.ndarray
    logprobs: np.ndarray
    text: str
    tool_calls: list[JSON]

    @property
    def context(self) -> np.ndarray:
        return np.concatenate([self.prompt, self.completion])

    @property
    def reply(self) -> JSON:
        message: JSON = {"role": "assistant", "content": self.text or None}
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return message


class TreeSessionMaker:
    """Seeded sessions of a main agent and its interleaved sub-agents."""

    def __init__(self, maker: SessionMaker) -> None:
        self.maker = maker
        self.rng = maker.rng

    def _turn(
        self, conversation: str, parent: int, prompt: np.ndarray, messages: list[JSON]
    ) -> TreeTurn:
        rng, maker = self.rng, self.maker
        n = int(rng.integers(100, 301))
        call_id = f"call_{rng.bytes(12).hex()}"
        tool = TOOLS[int(rng.integers(len(TOOLS)))]["function"]
        arg = next(iter(tool["parameters"]["properties"]))
        return TreeTurn(
            conversation=conversation,
            parent=parent,
            prompt=prompt,
            messages=messages,
            completion=maker.tokens(n),
            logprobs=-rng.exponential(0.4, n).astype(np.float32),
            text=maker.text(n // 4),
            tool_calls=[
                {
                    "id": call_id,
                    "type": "function",
                    "function": {
                        "name": tool["name"],
                        "arguments": json.dumps({arg: maker.text(n - n // 4)}),
                    },
                }
            ],
        )

    def _next(
        self,
        turns: list[TreeTurn],
        index: int,
        conversation: str,
        new: list[tuple[JSON, np.ndarray]],
    ) -> TreeTurn:
        """The next turn of the conversation whose last turn is ``index``, after ``new``."""
        last = turns[index]
        prompt = np.concatenate(
            [last.context, *(ids for _, ids in new), self.maker.tokens(GENERATION_PROMPT_TOKENS)]
        )
        messages = [*last.messages, last.reply, *(m for m, _ in new)]
        return self._turn(conversation, index, prompt, messages)

    def _result(self, turn: TreeTurn) -> list[tuple[JSON, np.ndarray]]:
        reply, ids = self.maker.message(
            "tool", int(self.rng.integers(100, 801)), tool_call_id=turn.tool_calls[0]["id"]
        )
        return [(reply, np.concatenate([self.maker.tokens(1), ids]))]

    def session(self) -> tuple[str, list[TreeTurn]]:
        maker = self.maker
        session_id = base64.urlsafe_b64encode(self.rng.bytes(16)).rstrip(b"=").decode()
        system, system_ids = maker.message("system", SYSTEM_TOKENS)
        task, task_ids = maker.message("user", 300)
        first = np.concatenate([system_ids, task_ids, maker.tokens(GENERATION_PROMPT_TOKENS)])
        turns = [self._turn("main", -1, first, [system, task])]
        main = 0
        for _ in range(MAIN_TURNS - 1):
            turns.append(self._next(turns, main, "main", self._result(turns[main])))
            main = len(turns) - 1
        tips = {}
        for i in range(SUBAGENTS):  # each extends A's conversation with its own instruction
            instruction = maker.message("user", 200)
            turns.append(self._next(turns, main, f"sub-{i}", [instruction]))
            tips[i] = len(turns) - 1
        for _ in range(SUBAGENT_TURNS - 1):
            for i in range(SUBAGENTS):
                turns.append(self._next(turns, tips[i], f"sub-{i}", self._result(turns[tips[i]])))
                tips[i] = len(turns) - 1
        for _ in range(MAIN_TURNS):
            turns.append(self._next(turns, main, "main", self._result(turns[main])))
            main = len(turns) - 1
        return session_id, turns


def tree_events(session: str, turns: list[TreeTurn], run: str, *, tree: bool) -> list[SessionEvent]:
    t0 = 1_800_000_000.0
    events: list[SessionEvent] = [
        SessionOpened(run=run, session=session, created_at=t0, group="g", model="Qwen/Qwen3-8B")
    ]
    for index, turn in enumerate(turns):
        base = turn.parent if tree else index - 1
        if base >= 0:
            parent = turns[base]
            encoded = encode_delta(
                parent.context, [*parent.messages, parent.reply], turn.prompt, turn.messages
            )
        else:
            encoded = encode_delta([], [], turn.prompt, turn.messages)
        events.append(
            TurnCompleted(
                run=run,
                session=session,
                created_at=t0 + index + 1,
                turn=index,
                parent_turn=base if tree else None,
                prefix_len=encoded.prefix_len,
                prompt_ids=encoded.prompt_ids,
                completion_ids=turn.completion,
                logprobs=turn.logprobs,
                message_prefix_len=encoded.message_prefix_len,
                new_messages=encoded.new_messages,
                tools=TOOLS if index == 0 else None,
                sampling={"temperature": 1.0, "top_p": 1.0, "max_tokens": 4096},
                finish_reason="tool_calls",
                text=turn.text,
                tool_calls=turn.tool_calls,
                weight_version=3,
                template_hash="sha256:9f2c1e0b7a4d3c2b1a09f8e7d6c5b4a3",
                backend="vllm-0",
                usage={
                    "prompt_tokens": len(turn.prompt),
                    "completion_tokens": len(turn.completion),
                },
            )
        )
    events.append(
        SessionClosed(
            run=run,
            session=session,
            created_at=t0 + len(turns) + 1,
            reward=1.0,
            num_turns=len(turns),
        )
    )
    return events


def unique_tokens(turns: list[TreeTurn]) -> int:
    """Distinct token positions of the tree: each turn's tokens beyond what its parent shares."""
    return sum(
        len(t.context) - (len(turns[t.parent].context) if t.parent >= 0 else 0) for t in turns
    )


async def _store(
    js: JetStreamContext,
    pub: JetStreamPublisher,
    sessions: list[tuple[str, list[TreeTurn]]],
    run: str,
    *,
    tree: bool,
) -> tuple[int, int]:
    await js.purge_stream(STREAM)
    codec = Codec()
    payload = 0
    for session, turns in sessions:
        events = tree_events(session, turns, run, tree=tree)
        receipts = await pub.publish_many(events)
        if any(r.duplicate or r.spooled for r in receipts):
            raise RuntimeError(f"{run}/{session}: a duplicate or spooled publish")
        payload += sum(len(codec.encode(e)) for e in events)
    return payload, (await js.stream_info(STREAM)).state.bytes


async def _check(js: JetStreamContext, sessions: list[tuple[str, list[TreeTurn]]], run: str) -> int:
    """Every conversation folds into one trajectory holding exactly its final context."""
    checked = 0
    for session, turns in sessions:
        result = fold(await read_session(js, run, session))
        last = {t.conversation: t for t in turns}  # the last turn of each conversation
        finals = sorted(t.context.tobytes() for t in last.values())
        got = sorted(t.input_ids.tobytes() for t in result.trajectories)
        if finals != got:
            raise AssertionError(
                f"{run}/{session}: {len(result.trajectories)} trajectories, not one per "
                f"conversation ({len(last)}) holding its final context"
            )
        generated = sum(int(t.loss_mask.sum()) for t in result.trajectories)
        if generated != sum(len(t.completion) for t in turns):
            raise AssertionError(
                f"{run}/{session}: {generated} tokens marked generated in the trajectories, "
                f"not the {sum(len(t.completion) for t in turns)} the turns sampled (once each)"
            )
        checked += len(turns)
    return checked


async def subagents_main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    started = time.perf_counter()
    info = machine_info("nats-py", "msgspec", "numpy")
    count = 2 if args.quick else 8
    maker = TreeSessionMaker(SessionMaker(np.random.default_rng(args.seed)))
    sessions = [maker.session() for _ in range(count)]
    turns = len(sessions[0][1])
    unique = sum(unique_tokens(t) for _, t in sessions)
    say(
        f"turnstream storage --subagents: {count} sessions, each a main agent "
        f"({SYSTEM_TOKENS:,}-token system prompt, {2 * MAIN_TURNS} turns) and {SUBAGENTS} "
        f"interleaved sub-agents of {SUBAGENT_TURNS} turns sharing its prompt and history; "
        f"{turns} turns, {unique / count:,.0f} unique tokens per session"
    )
    results: dict[str, tuple[int, int]] = {}
    with tempfile.TemporaryDirectory(prefix="ts-bench-", dir=args.store_dir) as tmp:
        server = NatsServer(Path(tmp) / "nats").start()
        try:
            nc = await connect(server.url, name="bench-storage-subagents")
            try:
                js = nc.jetstream()
                await provision(js, LogSettings())
                pub = await JetStreamPublisher(nc).start()
                try:
                    for variant in ("tree", "linear"):
                        run = f"storage-{variant[:4]}"
                        results[variant] = await _store(
                            js, pub, sessions, run, tree=variant == "tree"
                        )
                        payload, stream = results[variant]
                        say(f"  {variant:<6} {payload:>13,} B payload {stream:>13,} B stream")
                        if variant == "tree":
                            checked = await _check(js, sessions, run)
                finally:
                    await pub.close()
            finally:
                await nc.close()
        finally:
            server.stop()
    tree, linear = results["tree"], results["linear"]
    figures: dict[str, Any] = {
        "subagents_stream_bytes_tree": tree[1],
        "subagents_stream_bytes_linear": linear[1],
        "subagents_payload_bytes_tree": tree[0],
        "subagents_payload_bytes_linear": linear[0],
        "subagents_linear_over_tree_ratio": round(linear[1] / tree[1], 2),
        "subagents_bytes_per_unique_token_tree": round(tree[1] / unique, 3),
        "subagents_bytes_per_unique_token_linear": round(linear[1] / unique, 3),
        "unique_tokens_per_session": round(unique / count),
        "sessions": count,
        "turns_per_session": turns,
        "decode_check": f"ok: {checked} turns, one trajectory per conversation",
    }
    say(
        f"  linear/tree {figures['subagents_linear_over_tree_ratio']}x; bytes per unique token: "
        f"tree {figures['subagents_bytes_per_unique_token_tree']}, "
        f"linear {figures['subagents_bytes_per_unique_token_linear']}"
    )
    finish(figures, quick=args.quick, duration_s=time.perf_counter() - started, info=info)


def main() -> None:
    """The same run as ``storage.py --subagents``, with the same flags."""
    parser = session_arguments(__doc__)
    asyncio.run(subagents_main(parser, parser.parse_args()))


if __name__ == "__main__":
    logging.basicConfig(level=logging.ERROR)
    main()
