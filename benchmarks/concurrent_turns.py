"""Benchmark: turns of one session in flight together (issue 35).

Claude Code's background sub-agents and its main agent send requests of one session at once (three
in flight in the captured ``cc_bg`` run); a gateway that serves a session's turns one at a time
makes them wait for each other. Against a fixed-latency backend whose time to first token is
realistic (``--ttft-ms``, default 600 as in the issue's measurement; below 500 is warned of),
two measurements, paired:

1. **K conversations of one session against K sessions**, K = 1, 2, 4, 8. Each conversation is
   its own multi-turn chat (Chat Completions through the ``openai`` SDK): the Claude Code system
   text and its first four tools, a first user message of its own (``[task i]``), then
   ``turns`` requests, each appending the reply (two tool calls: the backend's one answer) and a
   tool result per call. The K conversations run at once, all on one ``X-Session-Id`` (**one**)
   or each on its own (**separate**); each also sends ``X-Turnstream-Agent: conv-<i>``
   (``--no-agent-header``: not), which a gateway that does not read it ignores. Per K and round,
   a phase of each, back to back, the order alternating (by K, and reversed every other round).
   ``wall_ratio_k<K>``: the median over rounds of one's wall time over separate's (target:
   <= 1.2; K = 1 is the control: the same work either way); ``cpu_ratio_k<K>``: the same of
   the gateway's CPU per turn (all its threads' on-CPU time over the phase, from schedstat).
2. **A Claude-Code-shaped session with two background sub-agents** (``harness.claude_code_tree``:
   main's spawning turn; then the fork's two turns, the fresh agent's two turns and main's next
   turn, in flight together; then main's final turn; the Messages API through the ``anthropic``
   SDK, streamed, with Claude Code's headers), end to end through the gateway (**gateway**),
   against the backend alone (**direct**): the same seven requests in the same order and
   concurrency, each a prompt of as many tokens as the gateway reported for it, straight to the
   backend's ``/v1/completions``. ``tree_ratio``: the median over rounds of gateway over direct
   wall time (~1 when the session's turns overlap as the client sends them).

Checked from EVENTS at the end (exits 1 otherwise): every turn of part 1 after a conversation's
first continues that conversation's previous turn (``parent_turn``, its whole context as
``prefix_len``), and every request of part 2 was recorded as a turn. Reported beside, not
checked: the parent each part-2 turn was given, and the agent identity the gateway recorded.

``--after-tree DIR``: the gateway runs that checkout's code (e.g. ``git worktree add DIR REV``:
a revision before a change), as in ``--compare-with``; ``--ttft-ms``, ``--rounds`` as in
``gateway_overhead.py``.

    .venv/bin/python benchmarks/concurrent_turns.py            # ~4 min serialized, less after
    .venv/bin/python benchmarks/concurrent_turns.py --quick    # ~45 s serialized
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import harness
import openai
from harness import (
    MAX_TOKENS,
    ChatSurface,
    banner,
    check_continued,
    claude_code_shape,
    finish,
    fixed_latency_stack,
    say,
    session_turns,
    thread_cpu_ns,
    tool_output,
    turn_of,
)
from harness.claude_code_tree import NODES, SPAWN_TEXT, ClaudeCodeSessions
from harness.surfaces import function

JSON = dict[str, Any]
P = TypeVar("P")

LEVELS = (1, 2, 4, 8)  # conversations in flight at once
CHAT_TOOLS = 4  # Claude Code's first four tools (the Agent tool among them)
MAX_CONTEXT = 131_072  # byte-level tokenizer: Claude Code's first request is ~50k tokens
TARGET_RATIO = 1.2
MIN_TTFT_MS = 500.0


@dataclass(frozen=True)
class TurnsPlan:
    rounds: int
    turns: int  # requests per conversation (part 1)
    trees: int  # Claude Code sessions per phase (part 2)


FULL = TurnsPlan(rounds=4, turns=3, trees=2)
QUICK = TurnsPlan(rounds=1, turns=2, trees=1)


def cpu(procs: harness.Procs) -> dict[str, float]:
    """CPU seconds so far per process; ``gateway``: all its threads' on-CPU time (schedstat, ns:
    a phase of a few turns is a few 10 ms ticks of /proc/PID/stat)."""
    return {**procs.cpu(), "gateway": thread_cpu_ns(procs.gateway.pid) / 1e9}


def peak_in_flight(spans: list[tuple[float, float]]) -> int:
    """The most requests open at one time (as the client saw them)."""
    edges = sorted([(t0, 1) for t0, _ in spans] + [(t1, -1) for _, t1 in spans])
    peak = now = 0
    for _, step in edges:
        now += step
        peak = max(peak, now)
    return peak


# -- part 1: K conversations --------------------------------------------------------------------


@dataclass
class Chat:
    sid: str
    headers: dict[str, str]
    messages: list[JSON]
    answers: list[str] = field(default_factory=list)  # the answers' ids
    spans: list[tuple[float, float]] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)


@dataclass
class KPhase:
    level: int
    path: str  # "one" session or "separate" sessions
    round: int
    wall_s: float
    cpu_s: dict[str, float]
    chats: list[Chat]

    @property
    def turns(self) -> int:
        return sum(len(c.answers) for c in self.chats)

    def cpu_ms_per_turn(self, key: str = "gateway") -> float:
        return 1000 * self.cpu_s[key] / self.turns


class ConversationLoad:
    """Chats on Chat Completions through the openai SDK, every request the whole history."""

    def __init__(self, url: str, model: str, agent_header: bool) -> None:
        shape = claude_code_shape()
        self.surface = ChatSurface(shape, model)
        tools = shape.tools[:CHAT_TOOLS]
        self.tools = [{"type": "function", "function": function(t)} for t in tools]
        self.model, self.agent_header = model, agent_header
        self.client = openai.AsyncOpenAI(
            base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600.0
        )

    def open(self, sid: str, i: int) -> Chat:
        system, user = self.surface.opening()
        task = {**user, "content": [{"type": "text", "text": f"[task {i}] "}, *user["content"]]}
        headers = {"X-Session-Id": sid}
        if self.agent_header:
            headers["X-Turnstream-Agent"] = f"conv-{i}"
        return Chat(sid, headers, [system, task])

    async def converse(self, chat: Chat, turns: int) -> None:
        for turn in range(turns):
            t0 = time.perf_counter()
            completion = await self.client.chat.completions.create(
                model=self.model,
                messages=chat.messages,  # type: ignore[arg-type]  # plain JSON messages
                tools=self.tools,  # type: ignore[arg-type]
                max_tokens=MAX_TOKENS,
                extra_headers=chat.headers,
            )
            chat.spans.append((t0, time.perf_counter()))
            choice = completion.choices[0]
            calls = [c.model_dump(exclude_none=True) for c in choice.message.tool_calls or ()]
            if choice.finish_reason != "tool_calls" or len(calls) != 2:
                raise RuntimeError(f"{chat.sid}: expected two tool calls, got {completion}")
            chat.answers.append(completion.id)
            chat.prompt_tokens.append(completion.usage.prompt_tokens if completion.usage else 0)
            chat.messages.append(
                {"role": "assistant", "content": choice.message.content, "tool_calls": calls}
            )
            chat.messages += [
                {"role": "tool", "tool_call_id": c["id"], "content": tool_output(turn)}
                for c in calls
            ]

    async def phase(
        self, procs: harness.Procs, level: int, rnd: int, turns: int, path: str
    ) -> KPhase:
        sids = [
            f"ct-k{level}-r{rnd}-{path}" + ("" if path == "one" else f"-{i}") for i in range(level)
        ]
        chats = [self.open(sid, i) for i, sid in enumerate(sids)]
        cpu0, t0 = cpu(procs), time.perf_counter()
        await asyncio.gather(*(self.converse(chat, turns) for chat in chats))
        wall, cpu1 = time.perf_counter() - t0, cpu(procs)
        return KPhase(level, path, rnd, wall, {k: cpu1[k] - cpu0[k] for k in cpu0}, chats)


# -- part 2: a Claude Code session with two background sub-agents -------------------------------


@dataclass
class TreePhase:
    path: str  # "gateway" or "direct"
    round: int
    wall_s: float  # the sessions' wall times, summed
    cpu_s: dict[str, float]
    requests: int
    peak: int  # the most requests of one session in flight at once


async def tree_phase(
    load: ClaudeCodeSessions, procs: harness.Procs, rnd: int, sessions: int, path: str
) -> TreePhase:
    """``sessions`` Claude Code sessions one after the other, through the gateway or direct."""
    run = load.through_gateway if path == "gateway" else load.direct
    cpu0, wall, peak = cpu(procs), 0.0, 0
    for _ in range(sessions):
        t0 = time.perf_counter()
        spans = await run()
        wall += time.perf_counter() - t0
        peak = max(peak, peak_in_flight(spans))
    cpu1 = cpu(procs)
    spent = {k: cpu1[k] - cpu0[k] for k in cpu0}
    return TreePhase(path, rnd, wall, spent, sessions * len(NODES), peak)


# -- checks ---------------------------------------------------------------------------------------


async def check_chats(js: Any, phases: list[KPhase]) -> JSON:
    chats = [chat for phase in phases for chat in phase.chats]
    checked = await check_continued(js, ((chat.sid, chat.answers) for chat in chats))
    agents = 0
    for sid in sorted({chat.sid for chat in chats}):
        turns = await session_turns(js, sid)
        for chat in (c for c in chats if c.sid == sid):
            agent = chat.headers.get("X-Turnstream-Agent")
            events = [turn_of(turns, answer) for answer in chat.answers]
            agents += sum(1 for e in events if agent and e.agent.get("id") == agent)
    say(
        f"checked: {checked:,} later turns of part 1 each continue their own conversation's "
        f"previous turn, token-exact; {agents:,} of {sum(p.turns for p in phases):,} turns "
        "record their X-Turnstream-Agent"
    )
    return {"turns_continuing_their_conversation": checked, "turns_recording_their_agent": agents}


async def check_tree(js: Any, load: ClaudeCodeSessions) -> JSON:
    assert load.last is not None
    tree, ids = load.last
    turns = await session_turns(js, tree.session)
    events = {node: turn_of(turns, ids[node]) for node in NODES}
    node_of = {e.turn: node for node, e in events.items()}
    parents = {  # None: a root (a new conversation)
        node: None if e.parent_turn is None or e.parent_turn < 0 else node_of.get(e.parent_turn)
        for node, e in events.items()
    }
    recorded = {node: e.agent for node, e in events.items() if e.agent}
    say(
        f"checked: the Claude Code session's {len(NODES)} requests are {len(turns)} turns; "
        f"parents: " + ", ".join(f"{n} <- {p or '-'}" for n, p in parents.items())
    )
    if len(turns) != len(NODES):
        raise RuntimeError(f"{len(turns)} turns recorded for the {len(NODES)} requests")
    return {"tree_turns": len(turns), "tree_parents": parents, "tree_agents_recorded": recorded}


# -- the run --------------------------------------------------------------------------------------


async def paired(
    paths: tuple[str, str], in_order: bool, phase: Callable[[str], Awaitable[P]]
) -> tuple[P, P]:
    """A phase of each path back to back (the second first unless ``in_order``), in the order
    of ``paths``."""
    done = {path: await phase(path) for path in (paths if in_order else paths[::-1])}
    return done[paths[0]], done[paths[1]]


async def bench(args: argparse.Namespace, plan: TurnsPlan, tmp: Path) -> JSON:
    from transformers import AutoTokenizer

    from gateway.model import ensure_tiny_model

    model_dir = ensure_tiny_model(Path(args.model_cache))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    completion = [*tokenizer.encode(SPAWN_TEXT, add_special_tokens=False)]
    completion.append(int(tokenizer.eos_token_id))
    tree = None if args.after_tree == harness.REPO else args.after_tree
    async with fixed_latency_stack(
        args, tmp, MAX_CONTEXT, "bench-concurrent-turns", completion=completion, source_tree=tree
    ) as stack:
        model = stack.model_dir.name
        chats = ConversationLoad(stack.gateway_url, model, not args.no_agent_header)
        trees = ClaudeCodeSessions(stack.gateway_url, stack.backend_url, model, completion)
        k_phases: list[KPhase] = []
        tree_phases: list[TreePhase] = []
        try:
            # Warm-up, unmeasured: the gateway's first requests, and part 2's token counts.
            await chats.phase(stack.procs, 2, -1, 1, "one")
            await trees.through_gateway()
            for rnd in range(plan.rounds):
                order = LEVELS if rnd % 2 == 0 else LEVELS[::-1]
                for i, level in enumerate(order):
                    one, sep = await paired(
                        ("one", "separate"),
                        i % 2 == 0,
                        functools.partial(chats.phase, stack.procs, level, rnd, plan.turns),
                    )
                    k_phases += [one, sep]
                    say(
                        f"  round {rnd + 1}/{plan.rounds} K={level}: one session "
                        f"{one.wall_s:6.2f} s, {level} sessions {sep.wall_s:6.2f} s, ratio "
                        f"{one.wall_s / sep.wall_s:5.2f}; CPU/turn {one.cpu_ms_per_turn():6.2f} "
                        f"/ {sep.cpu_ms_per_turn():6.2f} ms"
                    )
                gw, direct = await paired(
                    ("gateway", "direct"),
                    rnd % 2 == 0,
                    functools.partial(tree_phase, trees, stack.procs, rnd, plan.trees),
                )
                tree_phases += [gw, direct]
                say(
                    f"  round {rnd + 1}/{plan.rounds} Claude Code session: gateway "
                    f"{gw.wall_s / plan.trees:5.2f} s, backend alone "
                    f"{direct.wall_s / plan.trees:5.2f} s, ratio {gw.wall_s / direct.wall_s:5.2f} "
                    f"(in flight at once: {gw.peak} / {direct.peak})"
                )
            checks = await check_chats(stack.js, k_phases)
            checks |= await check_tree(stack.js, trees)
        finally:
            await chats.client.close()
            await trees.close()
    return {"k": k_phases, "tree": tree_phases, "checks": checks, "tokens": trees.tokens}


def report(k_phases: list[KPhase], tree_phases: list[TreePhase]) -> JSON:
    say(
        f"\n{'K':>3}{'one s':>8}{'K sessions s':>14}{'wall ratio':>12}{'CPU ms/turn one':>17}"
        f"{'K sessions':>12}{'CPU ratio':>11}{'in flight':>11}  wall ratio per round"
    )
    rows = []
    for level in LEVELS:
        mine = [p for p in k_phases if p.level == level]
        one = {p.round: p for p in mine if p.path == "one"}
        sep = {p.round: p for p in mine if p.path == "separate"}
        walls = [one[r].wall_s / sep[r].wall_s for r in sorted(one)]
        cpus = [one[r].cpu_ms_per_turn() / sep[r].cpu_ms_per_turn() for r in sorted(one)]

        def per_turn(phases: dict[int, KPhase]) -> float:
            cpu = sum(p.cpu_s["gateway"] for p in phases.values())
            return 1000 * cpu / sum(p.turns for p in phases.values())

        row = {
            "conversations": level,
            "wall_s_one": round(statistics.mean(p.wall_s for p in one.values()), 3),
            "wall_s_separate": round(statistics.mean(p.wall_s for p in sep.values()), 3),
            "wall_ratio": round(statistics.median(walls), 3),
            "round_wall_ratios": [round(r, 3) for r in walls],
            "cpu_ms_per_turn_one": round(per_turn(one), 3),
            "cpu_ms_per_turn_separate": round(per_turn(sep), 3),
            "cpu_ratio": round(statistics.median(cpus), 3),
            "round_cpu_ratios": [round(r, 3) for r in cpus],
            "peak_in_flight_one": max(
                peak_in_flight([s for c in p.chats for s in c.spans]) for p in one.values()
            ),
            "turns_per_phase": one[min(one)].turns,
            "mean_prompt_tokens": round(
                statistics.mean(t for p in mine for c in p.chats for t in c.prompt_tokens)
            ),
        }
        rows.append(row)
        say(
            f"{level:>3}{row['wall_s_one']:>8.2f}{row['wall_s_separate']:>14.2f}"
            f"{row['wall_ratio']:>12.3f}{row['cpu_ms_per_turn_one']:>17.2f}"
            f"{row['cpu_ms_per_turn_separate']:>12.2f}{row['cpu_ratio']:>11.3f}"
            f"{row['peak_in_flight_one']:>11}  " + " ".join(f"{r:.2f}" for r in walls)
        )
    gw = {p.round: p for p in tree_phases if p.path == "gateway"}
    direct = {p.round: p for p in tree_phases if p.path == "direct"}
    ratios = [gw[r].wall_s / direct[r].wall_s for r in sorted(gw)]
    sessions = sum(p.requests for p in gw.values()) // len(NODES)
    tree = {
        "tree_wall_s_gateway": round(sum(p.wall_s for p in gw.values()) / sessions, 3),
        "tree_wall_s_direct": round(sum(p.wall_s for p in direct.values()) / sessions, 3),
        "tree_ratio": round(statistics.median(ratios), 3),
        "tree_round_ratios": [round(r, 3) for r in ratios],
        "tree_peak_in_flight_gateway": max(p.peak for p in gw.values()),
        "tree_peak_in_flight_direct": max(p.peak for p in direct.values()),
        "tree_cpu_ms_per_request_gateway": round(
            1000
            * sum(p.cpu_s["gateway"] for p in gw.values())
            / sum(p.requests for p in gw.values()),
            3,
        ),
        "tree_sessions": sessions,
    }
    say(
        f"\nClaude Code session, two background sub-agents ({len(NODES)} requests): gateway "
        f"{tree['tree_wall_s_gateway']:.2f} s, backend alone {tree['tree_wall_s_direct']:.2f} s, "
        f"ratio {tree['tree_ratio']:.3f} (rounds: "
        + " ".join(f"{r:.2f}" for r in ratios)
        + f"); in flight at once {tree['tree_peak_in_flight_gateway']} through the gateway, "
        f"{tree['tree_peak_in_flight_direct']} direct"
    )
    return {"rows": rows, **tree}


async def concurrent_turns_main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.compare_with is not None or args.backend_kind != "fixed-latency":
        parser.error("concurrent_turns.py runs one gateway on the fixed-latency backend")
    if args.max_inflight_per_replica is None:
        args.max_inflight_per_replica = 32  # the gateway's default: more than any K here
    base = QUICK if args.quick else FULL
    plan = TurnsPlan(args.rounds or base.rounds, base.turns, base.trees)
    started = time.perf_counter()
    info = harness.gateway_machine_info()
    banner("concurrent turns of one session", args.quick, info)
    if args.ttft_ms < MIN_TTFT_MS:
        say(f"warning: --ttft-ms {args.ttft_ms:g} < {MIN_TTFT_MS:g}: not the benchmark's shape")
    say(
        f"K = {', '.join(map(str, LEVELS))} conversations of {plan.turns} turns in flight, one "
        f"session vs K sessions; a Claude Code session with two background sub-agents, gateway "
        f"vs the backend alone ({plan.trees} per phase); backend time to first token "
        f"{args.ttft_ms:g} ms; {plan.rounds} round(s), the order alternating"
    )
    with tempfile.TemporaryDirectory(prefix="ts-ct-", dir=args.store_dir) as tmp:
        result = await bench(args, plan, Path(tmp))
    out = report(result["k"], result["tree"])
    worst = max(r["wall_ratio"] for r in out["rows"] if r["conversations"] > 1)
    targets = {"wall_ratio_max": TARGET_RATIO, "worst_wall_ratio": worst}
    targets["met"] = worst <= TARGET_RATIO
    say(
        f"\ntarget: K conversations of one session within {TARGET_RATIO}x of K sessions' wall "
        f"time: worst {worst:.3f}: {'met' if targets['met'] else 'NOT met'}"
    )
    rows = out.pop("rows")
    figures = {
        **{f"wall_ratio_k{r['conversations']}": r["wall_ratio"] for r in rows},
        **{f"cpu_ratio_k{r['conversations']}": r["cpu_ratio"] for r in rows},
        **out,
        "targets": targets,
        "rows": rows,
        "tree_prompt_tokens": result["tokens"],
        "checks": result["checks"],
        "settings": {
            "levels": LEVELS,
            "turns_per_conversation": plan.turns,
            "trees_per_phase": plan.trees,
            "rounds": plan.rounds,
            "ttft_ms": args.ttft_ms,
            "agent_header": not args.no_agent_header,
            "max_context": MAX_CONTEXT,
            "max_inflight_per_replica": args.max_inflight_per_replica,
            "gateway_log_level": args.gateway_log_level or "as shipped",
            "gateway_tree": str(args.after_tree),
        },
    }
    finish(figures, quick=args.quick, duration_s=time.perf_counter() - started, info=info)


def main() -> None:
    logging.basicConfig(level=logging.ERROR)
    parser = harness.gateway_arguments(__doc__)
    parser.add_argument(
        "--no-agent-header",
        action="store_true",
        help="part 1 without X-Turnstream-Agent (the conversations told apart by tokens alone)",
    )
    parser.set_defaults(ttft_ms=600.0)
    asyncio.run(concurrent_turns_main(parser, parser.parse_args()))


if __name__ == "__main__":
    main()
