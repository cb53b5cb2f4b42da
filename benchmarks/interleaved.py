"""Benchmark: gateway CPU per turn, 1, 4 or 16 conversations a session (also
``gateway_overhead.py --interleaved``).

Issue 18: sub-agents share their caller's session and take turns with it, so the gateway matches
every request against every turn the session holds. This measures what that costs: the gateway's
CPU per turn when each session holds N interleaved conversations of ~32k tokens, set beside N = 1
(target: within 1.2x). What is sent, measured and checked is described in the docstring of
``gateway_overhead.py`` ("Interleaved conversations: --interleaved"); the processes, the CPU
meter, the closing JSON line and the Chat request shape come from ``harness``.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import harness
import httpx
from harness import (
    MAX_TOKENS,
    ChatSurface,
    ClaudeCodeShape,
    banner,
    claude_code_shape,
    dumps,
    finish,
    fixed_latency_stack,
    run_gateway_mode,
    say,
    tool_output,
)

from eventlog import read_session

JSON = dict[str, Any]

LEVELS = (1, 4, 16)  # conversations per session
CONVERSATIONS = 16  # per phase, whatever N: 16 sessions of 1, 4 of 4 or 1 of 16
SYSTEM_CHARS = 19_000  # with the tools, the user message, the template: a ~32k-token prompt
TOOLS = 4  # Claude Code's first four tools (~9 KB of JSON)
WARM_TURNS = 2  # per conversation, before the measured ones
MEASURED_TURNS = 4  # per conversation
MAX_CONTEXT = 65_536
TARGET_RATIO = 1.2


def interleaved_shape() -> ClaudeCodeShape:
    shape = claude_code_shape()
    text = "".join(shape.system)
    system = (text * (SYSTEM_CHARS // len(text) + 1))[:SYSTEM_CHARS]
    return ClaudeCodeShape(system=(system,), tools=shape.tools[:TOOLS], user=shape.user)


@dataclass
class Conversation:
    """One conversation's history (encoded items) and the turn indices the gateway gave it."""

    history: list[bytes]
    turns: list[str] = field(default_factory=list)  # the replies' ids (TurnCompleted.reply)
    prompt_tokens: list[int] = field(default_factory=list)


@dataclass
class Phase:
    level: int
    round: int
    turns: int
    cpu_s: dict[str, float]
    prompt_tokens: list[int]

    def cpu_ms_per_turn(self, key: str = "gateway") -> float:
        return 1000 * self.cpu_s[key] / self.turns


class InterleavedLoad:
    """Sessions of N conversations; each request carries its conversation's whole history."""

    def __init__(self, surface: ChatSurface, url: str) -> None:
        self.surface = surface
        self.url = url + surface.path
        self.head = surface.head(False)
        self.sessions: dict[str, list[Conversation]] = {}

    def open(self, sid: str, level: int) -> None:
        system, user = self.surface.opening()
        # The conversations share the system prompt and differ from their first user message on.
        self.sessions[sid] = [
            Conversation(
                [
                    dumps(system),
                    dumps(
                        {
                            **user,
                            "content": [{"type": "text", "text": f"[task {c}] "}, *user["content"]],
                        }
                    ),
                ]
            )
            for c in range(level)
        ]

    async def turn(self, client: httpx.AsyncClient, sid: str, c: int) -> None:
        conversation = self.sessions[sid][c]
        body = self.head + b"[" + b",".join(conversation.history) + b"]}"
        headers = {"X-Session-Id": sid, "content-type": "application/json"}
        response = await client.post(self.url, content=body, headers=headers)
        if response.status_code != 200:
            raise RuntimeError(
                f"session {sid} conversation {c}: HTTP {response.status_code}: "
                f"{response.text[:600]}"
            )
        answer = response.json()
        reply = self.surface.reply(answer)
        conversation.turns.append(harness.reply_of(answer["id"]))
        conversation.prompt_tokens.append(int(answer["usage"]["prompt_tokens"]))
        conversation.history += [dumps(item) for item in reply.echo]
        result = self.surface.tool_result(reply.call_id, tool_output(len(conversation.turns)))
        conversation.history += [dumps(item) for item in result]

    async def round_robin(self, client: httpx.AsyncClient, sids: list[str], turns: int) -> None:
        """``turns`` turns per conversation, the conversations of a session taking turns."""
        for _ in range(turns):
            for sid in sids:
                for c in range(len(self.sessions[sid])):
                    await self.turn(client, sid, c)


async def check(js: Any, load: InterleavedLoad) -> JSON:
    """Every turn after a conversation's first continues that conversation's previous turn:
    its parent_turn, the whole of its context (token-exact, no fork) and its messages."""
    from schemas.events import TurnCompleted

    turns_checked = 0
    for sid, conversations in load.sessions.items():
        events = await read_session(js, harness.RUN, sid, stream=harness.STREAM)
        turns = {e.turn: e for e in events if isinstance(e, TurnCompleted)}
        index_of = {e.reply: e.turn for e in turns.values()}
        context = {
            t: e.prefix_len + len(e.prompt_ids) + len(e.completion_ids) for t, e in turns.items()
        }
        for c, conversation in enumerate(conversations):
            indices = [index_of[reply] for reply in conversation.turns]
            for previous, index in itertools.pairwise(indices):
                event = turns[index]
                if event.parent_turn != previous or event.prefix_len != context[previous]:
                    raise RuntimeError(
                        f"session {sid} conversation {c}: turn {index} has parent_turn "
                        f"{event.parent_turn} and prefix_len {event.prefix_len}; expected turn "
                        f"{previous} and its whole context of {context[previous]} tokens"
                    )
                turns_checked += 1
    say(
        f"\nchecked: {turns_checked:,} turns in {len(load.sessions)} sessions, each continuing "
        "its own conversation's previous turn, token-exact (parent_turn, whole context)"
    )
    return {"sessions": len(load.sessions), "turns_continuing_their_conversation": turns_checked}


async def bench(args: argparse.Namespace, rounds: int, tmp: Path) -> JSON:
    async with fixed_latency_stack(args, tmp, MAX_CONTEXT, "gateway-bench-interleaved") as stack:
        surface = ChatSurface(interleaved_shape(), stack.model_dir.name)
        load = InterleavedLoad(surface, stack.gateway_url)
        phases: list[Phase] = []
        async with httpx.AsyncClient(timeout=120.0) as client:
            load.open("warm", 2)
            await load.round_robin(client, ["warm"], 2)
            gc.collect()
            for rnd in range(rounds):
                order = LEVELS if rnd % 2 == 0 else LEVELS[::-1]
                line = []
                for level in order:
                    phase = await run_phase(load, client, stack.procs, level, rnd)
                    phases.append(phase)
                    line.append(f"N={level:<2} {phase.cpu_ms_per_turn():6.2f} ms CPU/turn")
                say(f"  round {rnd + 1}/{rounds}: " + " | ".join(line))
        checks = await check(stack.js, load)
    return {"phases": phases, "checks": checks}


async def run_phase(
    load: InterleavedLoad, client: httpx.AsyncClient, procs: harness.Procs, level: int, rnd: int
) -> Phase:
    """CONVERSATIONS conversations in sessions of ``level``: warmed up to ~32k tokens each,
    then MEASURED_TURNS turns each under the CPU meter."""
    sids = [f"il-n{level}-r{rnd}-s{k}" for k in range(CONVERSATIONS // level)]
    for sid in sids:
        load.open(sid, level)
    await load.round_robin(client, sids, WARM_TURNS)
    cpu0 = procs.cpu()
    await load.round_robin(client, sids, MEASURED_TURNS)
    cpu1 = procs.cpu()
    measured = [p for sid in sids for c in load.sessions[sid] for p in c.prompt_tokens[WARM_TURNS:]]
    return Phase(level, rnd, len(measured), {k: cpu1[k] - cpu0[k] for k in cpu0}, measured)


def report(phases: list[Phase], rounds: int) -> JSON:
    rows = []
    single = {p.round: p for p in phases if p.level == 1}
    say(
        f"\n{'N':>3}{'gateway CPU ms/turn':>21}{'user ms/turn':>14}{'vs N=1':>8}"
        f"{'prompt tokens':>15}{'turns':>7}  vs N=1 per round"
    )
    for level in LEVELS:
        mine = sorted((p for p in phases if p.level == level), key=lambda p: p.round)
        turns = sum(p.turns for p in mine)
        cpu = 1000 * sum(p.cpu_s["gateway"] for p in mine) / turns
        user = 1000 * sum(p.cpu_s["gateway_user"] for p in mine) / turns
        ratios = [p.cpu_ms_per_turn() / single[p.round].cpu_ms_per_turn() for p in mine]
        tokens = round(statistics.mean(t for p in mine for t in p.prompt_tokens))
        rows.append(
            {
                "conversations_per_session": level,
                "cpu_ms_per_turn": round(cpu, 3),
                "user_cpu_ms_per_turn": round(user, 3),
                "ratio_vs_one": round(statistics.median(ratios), 3),
                "round_ratios_vs_one": [round(r, 3) for r in ratios],
                "mean_prompt_tokens": tokens,
                "turns": turns,
            }
        )
        say(
            f"{level:>3}{cpu:>21.2f}{user:>14.2f}{statistics.median(ratios):>8.3f}{tokens:>15,}"
            f"{turns:>7}  " + " ".join(f"{r:.2f}" for r in ratios)
        )
    return {"rows": rows}


async def interleaved_main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.compare_with is not None or args.backend_kind != "fixed-latency":
        parser.error("--interleaved runs one gateway on the fixed-latency backend")
    if args.max_inflight_per_replica is None:
        args.max_inflight_per_replica = 1
    rounds = args.rounds or (2 if args.quick else 6)
    started = time.perf_counter()
    info = harness.gateway_machine_info()
    banner("gateway CPU per turn, interleaved conversations", args.quick, info)
    say(
        f"sessions of N = {', '.join(map(str, LEVELS))} conversations, {CONVERSATIONS} "
        f"conversations per phase, each ~31k tokens after its first turn, {WARM_TURNS} warm-up "
        f"and {MEASURED_TURNS} measured turns each (round-robin within a session; every reply a "
        f"tool call); {rounds} rounds, the order reversed every other round"
    )
    with tempfile.TemporaryDirectory(prefix="ts-gwil-", dir=args.store_dir) as tmp:
        result = await bench(args, rounds, Path(tmp))
    out = report(result["phases"], rounds)
    worst = max(r["ratio_vs_one"] for r in out["rows"])
    targets = {"ratio_vs_one_max": TARGET_RATIO, "worst_ratio": worst, "met": worst <= TARGET_RATIO}
    say(
        f"\ntarget: CPU per turn with 4 and 16 conversations within {TARGET_RATIO}x of one: "
        f"worst {worst:.3f}: {'met' if targets['met'] else 'NOT met'}"
    )
    figures = {
        **{
            f"cpu_ms_per_turn_n{r['conversations_per_session']}": r["cpu_ms_per_turn"]
            for r in out["rows"]
        },
        **{
            f"ratio_vs_one_n{r['conversations_per_session']}": r["ratio_vs_one"]
            for r in out["rows"]
        },
        "targets": targets,
        "rows": out["rows"],
        "checks": result["checks"],
        "settings": {
            "levels": LEVELS,
            "conversations_per_phase": CONVERSATIONS,
            "system_chars": SYSTEM_CHARS,
            "tools": TOOLS,
            "warm_turns": WARM_TURNS,
            "measured_turns": MEASURED_TURNS,
            "rounds": rounds,
            "max_tokens": MAX_TOKENS,
            "max_context": MAX_CONTEXT,
            "ttft_ms": args.ttft_ms,
            "gateway_log_level": args.gateway_log_level or "as shipped",
        },
    }
    finish(figures, quick=args.quick, duration_s=time.perf_counter() - started, info=info)


if __name__ == "__main__":
    run_gateway_mode(__doc__, interleaved_main)
