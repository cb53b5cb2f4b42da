"""Benchmark: the gateway's CPU per request on each API surface (also
``gateway_overhead.py --api-surfaces``).

Issue 17: the same Claude-Code-shaped session sent as Chat Completions, as Anthropic Messages
and as OpenAI Responses; the gateway's CPU per request on each, set beside Chat Completions'
(target: within 1.2x). What is sent, measured and checked is described in the docstring of
``gateway_overhead.py`` ("Per-API CPU: --api-surfaces"); the processes (backend, gateway,
nats-server), the CPU meter, the request bodies per API (``harness.surfaces``), the profiler and
the closing JSON line come from ``harness``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import harness
import httpx
from harness import (
    MAX_TOKENS,
    REPLY_TEXT,
    SURFACES,
    Reply,
    Surface,
    banner,
    claude_code_shape,
    dumps,
    finish,
    fixed_latency_stack,
    run_gateway_mode,
    say,
    tool_output,
)
from harness.surfaces import SYSTEM_CHARS
from harness.turn_floor import api_floors, later_turn_figures

from eventlog import read_session

JSON = dict[str, Any]

APIS = ("chat", "messages", "responses")
RECORDED_API = {"chat": "chat.completions", "messages": "messages", "responses": "responses"}
TURNS = 20  # requests per session
MAX_CONTEXT = 262_144  # byte-level tokenizer: a 20-turn session is ~90k tokens
TARGET_RATIO = 1.2
WARMUP_TURNS = 3


@dataclass(frozen=True)
class SurfacePlan:
    """Per round, each variant (concurrency, streamed) runs a phase per API."""

    rounds: int  # even: the API order is reversed in every other round
    sessions_per_worker: int  # each of c workers runs this many whole sessions per phase
    variants: tuple[tuple[int, bool], ...]


# -- load -----------------------------------------------------------------------------------


@dataclass
class SentSessions:
    """Requests answered per session id, and the API that carried them (checked against
    EVENTS at the end)."""

    requests: dict[str, int] = field(default_factory=dict)
    api: dict[str, str] = field(default_factory=dict)


class SessionLoad:
    """Whole sessions of one API: TURNS requests, each with the history so far (kept encoded,
    one item at a time, so the load generator does not re-encode 90 KB per request)."""

    def __init__(self, surface: Surface, url: str, sent: SentSessions) -> None:
        self.surface = surface
        self.url = url + surface.path
        self.sent = sent
        self.heads = {stream: surface.head(stream) for stream in (False, True)}
        self.opening = [dumps(item) for item in surface.opening()]
        self.last: tuple[str, list[bytes]] = ("", [])  # the last session: its id, its bodies

    async def session(
        self,
        client: httpx.AsyncClient,
        sid: str,
        stream: bool,
        samples: list[float],
        turns: int = TURNS,
        gateway_ns: Callable[[], int] | None = None,
        later_turn_ms: list[float] | None = None,
    ) -> None:
        """``gateway_ns``: the gateway's CPU so far (one request at a time), read around each
        later turn into ``later_turn_ms``."""
        history = list(self.opening)
        bodies: list[bytes] = []
        self.last = (sid, bodies)
        self.sent.api[sid] = self.surface.name
        self.sent.requests[sid] = 0
        headers = {"X-Session-Id": sid, "content-type": "application/json"}
        for turn in range(turns):
            body = self.heads[stream] + b"[" + b",".join(history) + b"]}"
            bodies.append(body)
            cpu0 = gateway_ns() if gateway_ns is not None and turn else None
            t0 = time.perf_counter()
            try:
                if stream:
                    reply = await self._streamed(client, body, headers)
                else:
                    response = await client.post(self.url, content=body, headers=headers)
                    if response.status_code != 200:
                        raise RuntimeError(f"HTTP {response.status_code}: {response.text[:600]}")
                    reply = self.surface.reply(response.json())
            except (RuntimeError, KeyError, TypeError, ValueError, httpx.HTTPError) as exc:
                raise RuntimeError(
                    f"{self.surface.name} (stream={stream}) session {sid} turn {turn}: {exc!r}"
                ) from exc
            samples.append(time.perf_counter() - t0)
            if cpu0 is not None and gateway_ns is not None and later_turn_ms is not None:
                later_turn_ms.append((gateway_ns() - cpu0) / 1e6)
            self.sent.requests[sid] += 1
            history += [dumps(item) for item in reply.echo]
            result = self.surface.tool_result(reply.call_id, tool_output(turn))
            history += [dumps(item) for item in result]

    async def _streamed(
        self, client: httpx.AsyncClient, body: bytes, headers: dict[str, str]
    ) -> Reply:
        events: list[tuple[str | None, JSON]] = []
        name: str | None = None
        async with client.stream("POST", self.url, content=body, headers=headers) as response:
            if response.status_code != 200:
                detail = (await response.aread())[:600]
                raise RuntimeError(f"HTTP {response.status_code}: {detail!r}")
            async for line in response.aiter_lines():
                if line.startswith("event:"):
                    name = line[6:].strip()
                elif line.startswith("data:"):
                    payload = line[5:].strip()
                    if payload != "[DONE]":
                        events.append((name, json.loads(payload)))
                    name = None
        return self.surface.streamed_reply(events)


@dataclass
class SurfacePhase:
    api: str
    concurrency: int
    streamed: bool
    round: int
    latencies_s: list[float]
    requests: int
    sessions: int
    wall_s: float
    cpu_s: dict[str, float]
    later_turn_ms: list[float]  # the gateway's CPU per later turn (c = 1, unprofiled only)

    def cpu_ms_per_request(self, key: str = "gateway") -> float:
        return 1000 * self.cpu_s[key] / self.requests


async def run_sessions(
    load: SessionLoad,
    clients: list[httpx.AsyncClient],
    per: int,
    c: int,
    stream: bool,
    sessions_per_worker: int,
    tag: str,
    procs: harness.Procs,
    on_edge: Callable[[], None] | None,
) -> tuple[list[float], int, float, dict[str, float], list[float]]:
    """``c`` closed-loop workers, each running ``sessions_per_worker`` whole sessions: every
    API gets the same mix of turns (early turns are cheaper: less history to read). One worker
    unprofiled: the gateway's CPU of each later turn too (its threads' schedstat, in ns)."""
    samples: list[float] = []
    later: list[float] = []
    pid = procs.gateway.pid
    gateway_ns = (lambda: harness.thread_cpu_ns(pid)) if c == 1 and on_edge is None else None

    async def worker(wid: int) -> None:
        for n in range(sessions_per_worker):
            sid = f"{load.surface.name}-{tag}-w{wid}-s{n}"
            await load.session(clients[wid // per], sid, stream, samples, TURNS, gateway_ns, later)

    if on_edge is not None:
        on_edge()
    cpu0, t0 = procs.cpu(), time.perf_counter()
    tasks = [asyncio.create_task(worker(w)) for w in range(c)]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        raise
    wall, cpu1 = time.perf_counter() - t0, procs.cpu()
    if on_edge is not None:
        on_edge()
    cpu = {k: cpu1[k] - cpu0[k] for k in cpu0}
    return samples, c * sessions_per_worker, wall, cpu, later


# -- checks against EVENTS ------------------------------------------------------------------


def canonical_keys(messages: list[JSON]) -> list[tuple[object, ...]]:
    """``message_key`` of each message, tool-call ids left out (each API makes its own)."""
    from gateway.core.conversation import message_key

    return [(*message_key({**m, "tool_call_id": None})[:3], m.get("name")) for m in messages]


async def check_sessions(js: Any, sent: SentSessions) -> dict[str, Any]:
    """Per session: one SessionOpened, then TurnCompleted 0..n-1 with n = requests answered,
    each recorded as its API's, each with a tool call, each extending the previous turn's
    tokens and messages whole (no fork). Per API, the conversations of a whole session (the
    first measured) are the same canonical messages, tools and prompt token counts as Chat's."""
    from schemas.events import SessionOpened, TurnCompleted

    sessions: dict[str, JSON] = {}
    for sid, n in sent.requests.items():
        events = await read_session(js, harness.RUN, sid, stream=harness.STREAM)
        opened = [e for e in events if isinstance(e, SessionOpened)]
        turns = sorted((e for e in events if isinstance(e, TurnCompleted)), key=lambda e: e.turn)
        where = f"session {sid} ({sent.api[sid]}, {n} requests answered)"
        if len(opened) != 1 or [t.turn for t in turns] != list(range(n)):
            raise RuntimeError(
                f"{where}: EVENTS has {len(opened)} SessionOpened and turns "
                f"{[t.turn for t in turns]}"
            )
        messages: list[JSON] = []
        prompt_lengths = []
        for k, turn in enumerate(turns):
            if turn.request.get("api") != RECORDED_API[sent.api[sid]] or not turn.tool_calls:
                raise RuntimeError(
                    f"{where}: turn {k} recorded as {turn.request.get('api')!r} "
                    f"with tool calls {turn.tool_calls}"
                )
            if k:
                previous = turns[k - 1]
                context = previous.prefix_len + len(previous.prompt_ids)
                context += len(previous.completion_ids)
                if (turn.prefix_len, turn.message_prefix_len) != (context, len(messages) + 1):
                    raise RuntimeError(
                        f"{where}: turn {k} forked: prefix_len {turn.prefix_len} of {context} "
                        f"tokens, message_prefix_len {turn.message_prefix_len} of "
                        f"{len(messages) + 1} messages"
                    )
                messages = [*messages, previous.assistant_message]
            messages = messages[: turn.message_prefix_len] + list(turn.new_messages)
            prompt_lengths.append(turn.prefix_len + len(turn.prompt_ids))
        sessions[sid] = {
            "api": sent.api[sid],
            "messages": canonical_keys(messages),
            "tools": turns[0].tools if turns else None,
            "prompt_tokens": prompt_lengths,
        }
    same = compare_canonical(sessions)
    checked = {"sessions": len(sessions), "turns": sum(sent.requests.values())}
    say(
        f"\nchecked: {checked['turns']:,} TurnCompleted in {checked['sessions']} sessions, "
        "every one its API's, a tool call, extending the previous turn (no fork)"
    )
    return {**checked, "same_canonical_conversation": same}


def compare_canonical(sessions: dict[str, JSON]) -> dict[str, bool]:
    """Whole sessions of each API against Chat's: messages, tools, prompt tokens per turn."""
    whole = {}
    for s in sessions.values():
        if len(s["prompt_tokens"]) == TURNS:
            whole.setdefault(s["api"], s)
    out = {}
    reference = whole.get("chat")
    for api, s in whole.items():
        if reference is None or api == "chat":
            continue
        diffs = [
            what for what in ("messages", "tools", "prompt_tokens") if s[what] != reference[what]
        ]
        out[api] = not diffs
        if diffs:
            say(f"WARNING: {api}'s canonical conversation differs from chat's in {diffs}")
            for what in diffs:
                mine, theirs = s[what], reference[what]
                if isinstance(mine, list) and isinstance(theirs, list):
                    at = next(
                        (i for i, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b),
                        min(len(mine), len(theirs)),
                    )
                    a = mine[at] if at < len(mine) else None
                    b = theirs[at] if at < len(theirs) else None
                    say(f"  {what}[{at}]: {str(a)[:300]}\n  chat: {str(b)[:300]}")
    if out:
        say(
            "checked: whole sessions of "
            + ", ".join(f"{api} ({'same' if ok else 'NOT the same'})" for api, ok in out.items())
            + " against chat: canonical messages, tools, prompt tokens per turn"
        )
    return out


# -- the run --------------------------------------------------------------------------------


async def bench(args: argparse.Namespace, plan: SurfacePlan, apis: list[str], tmp: Path) -> JSON:
    shape = claude_code_shape()
    say(
        f"system {sum(map(len, shape.system)):,} chars in {len(shape.system)} blocks, "
        f"{len(shape.tools)} tools ({len(dumps(list(shape.tools))):,} bytes of JSON)"
    )
    async with fixed_latency_stack(args, tmp, MAX_CONTEXT, "gateway-bench-apis") as stack:
        per = args.workers_per_client
        c_max = max(c for c, _ in plan.variants)
        limits = httpx.Limits(max_connections=per + 2, max_keepalive_connections=per + 2)
        sent = SentSessions()
        loads = {
            api: SessionLoad(SURFACES[api](shape, stack.model_dir.name), stack.gateway_url, sent)
            for api in apis
        }
        async with contextlib.AsyncExitStack() as clients_stack:
            clients = [
                await clients_stack.enter_async_context(
                    httpx.AsyncClient(limits=limits, timeout=120.0)
                )
                for _ in range(-(-c_max // per))
            ]
            # Warm-up, unmeasured: the first WARMUP_TURNS turns of a session per API, streamed
            # and not (lazy imports, first tokenizations, connections).
            t1 = time.perf_counter()
            for api in apis:
                for stream in (False, True):
                    sid = f"{api}-warm-{'s' if stream else 'n'}"
                    await loads[api].session(clients[0], sid, stream, [], WARMUP_TURNS)
            say(
                f"warm-up: {WARMUP_TURNS} turns per API, streamed and not, in "
                f"{time.perf_counter() - t1:.1f} s"
            )
            gc.collect()
            gc.freeze()
            phases = await run_rounds(args, plan, apis, loads, clients, stack.procs, stack.js)
        checks = await check_sessions(stack.js, sent)
        last = {api: load.last for api, load in loads.items()}
        floors = await api_floors(stack.js, last, stack.model_dir, MAX_TOKENS)
    return {"phases": phases, "checks": checks, "floors": floors}


async def run_rounds(
    args: argparse.Namespace,
    plan: SurfacePlan,
    apis: list[str],
    loads: dict[str, SessionLoad],
    clients: list[httpx.AsyncClient],
    procs: harness.Procs,
    js: Any,
) -> list[SurfacePhase]:
    say(
        f"\n{plan.rounds} rounds; per round and variant, a phase per API (order reversed every "
        f"other round): each of c workers runs {plan.sessions_per_worker} whole session(s) of "
        f"{TURNS} turns"
    )
    phases: list[SurfacePhase] = []
    for rnd in range(plan.rounds):
        order = apis if rnd % 2 == 0 else apis[::-1]
        for c, stream in plan.variants:
            line = []
            for api in order:
                tag = f"c{c}{'s' if stream else 'n'}r{rnd}"
                before = await harness.stream_messages(js)
                # Profiled: every phase of the odd rounds; the even rounds give unprofiled CPU.
                profiled = args.profile_gateway and rnd % 2 == 1
                edge = procs.toggle_profile if profiled else None
                samples, sessions, wall, cpu, later = await run_sessions(
                    loads[api],
                    clients,
                    args.workers_per_client,
                    c,
                    stream,
                    plan.sessions_per_worker,
                    tag,
                    procs,
                    edge,
                )
                phase = SurfacePhase(
                    api, c, stream, rnd, samples, len(samples), sessions, wall, cpu, later
                )
                grown = await harness.stream_messages(js) - before
                if grown != phase.requests + phase.sessions:
                    raise RuntimeError(
                        f"{api} c={c} stream={stream} round {rnd}: EVENTS grew by {grown}; "
                        f"{phase.requests} turns answered + {phase.sessions} sessions opened"
                    )
                phases.append(phase)
                line.append(
                    f"{api} {phase.cpu_ms_per_request():6.2f} ms CPU/req, "
                    f"p50 {harness.pct(samples, 50) * 1000:6.1f} ms"
                )
            say(
                f"  round {rnd + 1}/{plan.rounds} c={c} "
                f"{'streamed    ' if stream else 'not streamed'}: " + " | ".join(line)
            )
    return phases


def report(phases: list[SurfacePhase], plan: SurfacePlan, apis: list[str]) -> JSON:
    """Per API and variant: CPU ms per request (pooled over rounds), the ratio to Chat's (the
    median of the per-round ratios: each round's phases ran back to back; and the ratio of the
    pooled figures), p50 latency."""
    rows = []
    pooled_chat: dict[tuple[int, bool], float] = {}
    say(
        f"\n{'API':<10}{'streamed':>9}{'c':>3}{'gateway CPU ms/req':>20}{'user ms/req':>13}"
        f"{'vs chat':>9}{'pooled':>8}{'p50 ms':>9}{'p90 ms':>9}{'req':>6}  vs chat per round"
    )
    for c, stream in plan.variants:
        by_api = {
            api: sorted(
                (p for p in phases if (p.api, p.concurrency, p.streamed) == (api, c, stream)),
                key=lambda p: p.round,
            )
            for api in apis
        }
        for api, ps in by_api.items():
            requests = sum(p.requests for p in ps)
            cpu = 1000 * sum(p.cpu_s["gateway"] for p in ps) / requests
            user = 1000 * sum(p.cpu_s["gateway_user"] for p in ps) / requests
            latencies = [x * 1000 for p in ps for x in p.latencies_s]
            ratios = None
            if api == "chat":
                pooled_chat[(c, stream)] = cpu
            if "chat" in by_api:
                ratios = [
                    p.cpu_ms_per_request() / q.cpu_ms_per_request()
                    for p, q in zip(ps, by_api["chat"], strict=True)
                ]
            row = {
                "api": api,
                "streamed": stream,
                "concurrency": c,
                "cpu_ms_per_request": round(cpu, 3),
                "user_cpu_ms_per_request": round(user, 3),
                "ratio_vs_chat": round(statistics.median(ratios), 3) if ratios else None,
                "pooled_ratio_vs_chat": (
                    round(cpu / pooled_chat[(c, stream)], 3) if ratios else None
                ),
                "round_ratios_vs_chat": [round(r, 3) for r in ratios] if ratios else None,
                "round_cpu_ms_per_request": [round(p.cpu_ms_per_request(), 3) for p in ps],
                "p50_ms": round(harness.pct(latencies, 50), 2),
                "p90_ms": round(harness.pct(latencies, 90), 2),
                "requests": requests,
                "requests_per_s": round(requests / sum(p.wall_s for p in ps), 1),
                "cpu_ms_per_request_other": {
                    k: round(1000 * sum(p.cpu_s[k] for p in ps) / requests, 3)
                    for k in ("backend", "nats", "loadgen")
                },
            }
            rows.append(row)
            rounds = " ".join(f"{r:.2f}" for r in ratios or ())
            say(
                f"{api:<10}{'yes' if stream else 'no':>9}{c:>3}{cpu:>20.2f}{user:>13.2f}"
                f"{row['ratio_vs_chat'] or float('nan'):>9.3f}"
                f"{row['pooled_ratio_vs_chat'] or float('nan'):>8.3f}"
                f"{row['p50_ms']:>9.1f}{row['p90_ms']:>9.1f}{requests:>6}  {rounds}"
            )
    return {"rows": rows}


def surface_plan(args: argparse.Namespace) -> SurfacePlan:
    """Full: not streamed at every level, streamed at the first; quick: the first level only,
    not streamed and streamed."""
    levels = [int(c) for c in (args.concurrency or "1,4").split(",")]
    if args.quick:
        plan = SurfacePlan(2, 1, ((levels[0], False), (levels[0], True)))
    else:
        plan = SurfacePlan(6, 1, (*((c, False) for c in levels), (levels[0], True)))
    if args.rounds is not None:
        plan = SurfacePlan(args.rounds, plan.sessions_per_worker, plan.variants)
    return plan


async def api_surfaces_main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    apis = [api.strip() for api in args.api_surfaces.split(",") if api.strip()]
    unknown = sorted(set(apis) - set(APIS))
    if unknown or not apis:
        parser.error(f"--api-surfaces takes a comma-separated subset of {','.join(APIS)}")
    if args.compare_with is not None or args.backend_kind != "fixed-latency":
        parser.error("--api-surfaces runs one gateway on the fixed-latency backend")
    if args.profile_gateway and (args.rounds or 2) < 2:
        parser.error("--profile-gateway profiles odd rounds and needs at least 2")
    apis = [api for api in APIS if api in apis]
    plan = surface_plan(args)
    if args.max_inflight_per_replica is None:
        args.max_inflight_per_replica = max(c for c, _ in plan.variants)
    started = time.perf_counter()
    info = harness.gateway_machine_info()
    banner("gateway CPU per API surface", args.quick, info)
    say(
        f"APIs: {', '.join(apis)}; Claude-Code-shaped sessions of {TURNS} turns, every reply a "
        f"tool call; backend: {args.ttft_ms:g} ms to the reply (itl {args.itl_ms:g} ms); "
        f"max context {MAX_CONTEXT}; log level {args.gateway_log_level or 'as shipped'}"
        + (", UNDER cProfile in odd rounds" if args.profile_gateway else "")
    )
    with tempfile.TemporaryDirectory(prefix="ts-gwapis-", dir=args.store_dir) as tmp:
        result = await bench(args, plan, apis, Path(tmp))
    out = report(result["phases"], plan, apis)
    profile = None
    if args.profile_gateway:
        phases = result["phases"]
        plain = [p for p in phases if p.round % 2 == 0]
        cpu_ms = 1000 * sum(p.cpu_s["gateway"] for p in plain) / sum(p.requests for p in plain)
        profiled = sum(p.requests for p in phases if p.round % 2 == 1)
        profile = harness.print_profile(args.profile_gateway, args.profile_top, profiled, cpu_ms)
    later = {
        api: [x for p in result["phases"] if p.api == api for x in p.later_turn_ms] for api in apis
    }
    turn = later_turn_figures(later, result["floors"])
    for api, row in turn["claude_code_turn"].items():
        say(
            f"{api}: gateway CPU per later turn {row['cpu_ms']:.2f} ms ({row['measured_turns']} "
            f"turns at c=1); floor {row['floor_ms']:.3f} ms (decode {row['decode_ms']:.3f}, "
            f"encode {row['encode_ms']:.3f}, write {row['write_ms']:.3f}): {row['ratio_to_floor']}x"
        )
    ratios = {
        f"{r['api']}_c{r['concurrency']}{'_stream' if r['streamed'] else ''}": r["ratio_vs_chat"]
        for r in out["rows"]
        if r["api"] != "chat" and r["ratio_vs_chat"] is not None
    }
    worst = max(ratios.values(), default=None)
    targets = {
        "ratio_vs_chat_max": TARGET_RATIO,
        "worst_ratio": worst,
        "met": worst is not None and worst <= TARGET_RATIO,
    }
    if worst is not None:
        say(
            f"\ntarget: every API's CPU per request within {TARGET_RATIO}x of chat's: worst "
            f"{worst:.3f} ({max(ratios, key=lambda k: ratios[k])}): "
            f"{'met' if targets['met'] else 'NOT met'}"
        )
    figures = {
        **{
            f"cpu_ms_per_request_{r['api']}_c{r['concurrency']}"
            f"{'_stream' if r['streamed'] else ''}": r["cpu_ms_per_request"]
            for r in out["rows"]
        },
        **{f"ratio_vs_chat_{k}": v for k, v in ratios.items()},
        **turn,
        "targets": targets,
        "rows": out["rows"],
        "checks": result["checks"],
        "settings": {
            "apis": apis,
            "turns_per_session": TURNS,
            "sessions_per_worker": plan.sessions_per_worker,
            "rounds": plan.rounds,
            "variants": [{"concurrency": c, "streamed": s} for c, s in plan.variants],
            "max_tokens": MAX_TOKENS,
            "max_context": MAX_CONTEXT,
            "system_chars": SYSTEM_CHARS,
            "reply": REPLY_TEXT,
            "ttft_ms": args.ttft_ms,
            "itl_ms": args.itl_ms,
            "max_inflight_per_replica": args.max_inflight_per_replica,
            "gateway_log_level": args.gateway_log_level or "as shipped",
            "profiled": bool(args.profile_gateway),
        },
        **({"gateway_profile": profile} if profile else {}),
    }
    finish(figures, quick=args.quick, duration_s=time.perf_counter() - started, info=info)


if __name__ == "__main__":
    run_gateway_mode(__doc__, api_surfaces_main, api_surfaces="chat,messages,responses")
