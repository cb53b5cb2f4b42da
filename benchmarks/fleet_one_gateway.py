"""Benchmark: a fleet's sessions on one gateway process (issue 40, point 1; also
``gateway_overhead.py --fleet``).

What hundreds of long agent sessions held at once do to one gateway: its event loop's stalls,
the latency it adds, requests timing out, and its memory per held session::

    .venv/bin/python benchmarks/gateway_overhead.py --fleet           # ~6 min
    .venv/bin/python benchmarks/gateway_overhead.py --fleet --quick   # ~2 min

* Per fleet, its own stack (``harness.fixed_latency_stack``: nats-server, the fixed-latency
  backend answering every request with the Bash tool call after ``--ttft-ms``, one gateway of
  ``--max-context`` 262144 with the memory settings below passed as flags). Two fleets:
  ``sessions`` sessions of ~100k tokens (full: 256) and of ~30k tokens (full: 1,000; keys
  suffixed ``_1000``).
* A session is Claude-Code-shaped, on Chat Completions (``harness.surfaces``): at ~100k, Claude
  Code's system text (17,000 characters) and its 24 tools (~64 KB of JSON), at ~30k its system
  text cut to 4,000 characters and its first 4 tools; then tool-call turns (the model's Bash
  call, a ~300-character tool result) up to the context. Growing 256 sessions to 100k turn by
  turn would take most of an hour on 2 cores, so each session's history is built here (its
  past replies as the client would echo them, every session's tool results its own) and its
  first request sends it whole: a first turn at 100k tokens, the "full tokenization" a new
  session costs. The session goes on from the gateway's answer, turn by turn (the reply as
  returned, a tool result), as an agent does.
* Opening: the fleet's first turns, ``OPENING_CONCURRENCY`` at a time (not measured: RSS before
  is read after two warm-up sessions, RSS after once the window below has ended).
* The measured window (``measure_s``): every session takes a turn after a think time drawn
  uniformly from ``think_s``, and new sessions (their first turn at the full context) arrive
  every ``1 / arrivals_per_s`` seconds and then take turns too. Any request the client has not
  seen answered within ``CLIENT_TIMEOUT_S`` counts as a timeout (the session stops); a 503 in
  the window (the log not answering the gateway in time) is counted as ``errors_503`` (the
  session stops); a request whose pooled connection the gateway closed as the client took it
  (uvicorn closes one idle for 5 s) is sent again once, as the OpenAI SDK does, and counted
  (``client_reconnects``); any other failure ends the run.
* Figures per fleet, from the requests started in the window:
  ``fleet_added_p99_ms``: p99 of (latency - the backend's own time for a prompt this long sent
  straight to it, ``backend_direct_ms``: its ``--ttft-ms`` and reading ~100k ids of JSON, the
  median of 5 measured in the stack before the opening), first and later turns together (each
  apart in the details, and over ``--ttft-ms`` alone, ``added_over_ttft_ms_p99``).
  ``fleet_loop_lag_p99_ms``: the p99 of ``turnstream_gateway_event_loop_lag_seconds`` between
  scrapes of /metrics at the window's start and end, interpolated linearly within its bucket.
  ``fleet_loop_lag_max_ms``: the largest ``turnstream_gateway_event_loop_lag_max_seconds`` (the
  worst of the last 60 s) read ``GAUGE_CLEAR_S`` into the window, every ``GAUGE_EVERY_S`` after
  and at its end: every read sees the window alone and together they cover it (the first
  second aside). A window shorter than that (``--quick``) reads the upper bound of the
  histogram's highest bucket that grew instead (``loop_lag_max_from`` says which); both are
  in the details. ``fleet_timeouts``. ``fleet_rss_mb_per_session``: (the gateway's
  VmRSS after the window - before the opening) / sessions it then holds (fleet + arrivals).
* Memory bounds: the gateway's ``session_turns_kept``, ``session_tokens_kept``,
  ``max_open_sessions`` and ``kept_body_bytes`` (the product's defaults, passed as flags) are
  reported; checked: the kept bodies' gauge within ``kept_body_bytes``,
  and RSS growth within what the settings let the held sessions keep (their token ids,
  ``min(sessions, max_open_sessions) x session_tokens_kept x 4`` bytes, plus the bodies'
  budget), ``rss_within_settings``.
* ``--after-tree DIR``: the gateway runs that checkout's code (e.g. ``git archive`` of the
  revision before a change, unpacked), as in ``--agent-shape``.
* ``--profile-gateway FILE``: cProfile in the gateway during each window (which slows it: the
  figures of such a run are not the target's), its time by component printed (FILE, and
  FILE's stem + ``_1000`` for the second fleet).
* ``--tracemalloc-gateway FILE``: a diagnostic run (tracing slows the gateway): its live
  allocations made from the opening to the window's end, by line, into FILE (one per fleet).
* Checked from EVENTS at the end: a sample of sessions' later turns continue their previous
  turn token for token (``check_continued``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import harness
import httpx
from harness import (
    ChatSurface,
    ClaudeCodeShape,
    banner,
    check_continued,
    claude_code_shape,
    dumps,
    finish,
    fixed_latency_stack,
    run_gateway_mode,
    say,
    tool_output,
)
from harness.load import complete, completion_body
from harness.surfaces import CALL_ARGUMENTS, CALL_NAME

JSON = dict[str, Any]

MAX_CONTEXT = 262_144
CLIENT_TIMEOUT_S = 60.0
OPENING_CONCURRENCY = 8
GAUGE_EVERY_S = 10.0
GAUGE_CLEAR_S = 62.0  # the probe's 60 s window of whole seconds, and one more
CHECKED_SESSIONS = 6
LAG_METRIC = "turnstream_gateway_event_loop_lag_seconds"
LAG_MAX_METRIC = "turnstream_gateway_event_loop_lag_max_seconds"
KEPT_BYTES_METRIC = "turnstream_gateway_kept_body_bytes"
TARGETS = {"loop_lag_max_ms": 50.0, "loop_lag_p99_ms": 10.0, "added_p99_ms": 30.0}
TARGET_RSS_MB_100K = 1.5


@dataclass(frozen=True)
class FleetPlan:
    suffix: str  # "" (the ~100k fleet) or "_1000" (the ~30k one)
    sessions: int
    context: int  # tokens of a session's first prompt, about
    think_s: tuple[float, float]
    arrivals_per_s: float
    measure_s: float


FULL = (
    FleetPlan("", 256, 100_000, (2.0, 6.0), 1.0, 92.0),
    FleetPlan("_1000", 1000, 30_000, (4.0, 12.0), 2.0, 92.0),
)
QUICK = (
    FleetPlan("", 48, 100_000, (2.0, 6.0), 0.5, 20.0),
    FleetPlan("_1000", 160, 30_000, (4.0, 12.0), 1.0, 20.0),
)


# -- the sessions ---------------------------------------------------------------------------------


def fleet_shape(context: int) -> ClaudeCodeShape:
    """Claude Code's whole shape for ~100k; for a shorter context, its system text cut to 4,000
    characters and its first 4 tools (what fits under 30k with turns after it)."""
    shape = claude_code_shape()
    if context >= 90_000:
        return shape
    return ClaudeCodeShape(
        system=("".join(shape.system)[:4_000],), tools=shape.tools[:4], user=shape.user
    )


@dataclass
class Session:
    sid: str
    history: list[bytes]
    answers: list[str] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)


@dataclass
class Request:
    start: float
    latency_s: float  # inf: timed out
    first: bool


class FleetLoad:
    """Sessions of one fleet: their offline-built histories and their turns."""

    def __init__(self, shape: ClaudeCodeShape, model: str, url: str, context: int) -> None:
        self.surface = ChatSurface(shape, model)
        self.url = url + self.surface.path
        self.head = self.surface.head(False)
        self.context = context
        self.sessions: list[Session] = []
        self.requests: list[Request] = []
        self.timeouts = 0
        self.errors: list[str] = []  # 503s in the window
        # Requests sent again on a fresh connection after the server closed the pooled one
        # (uvicorn closes a connection idle for 5 s; a think time of 2-12 s races it)
        self.reconnects = 0

    def open(self, sid: str) -> Session:
        """A session whose history reaches ~``context`` tokens (a token a byte: the tiny
        model's tokenizer) in tool-call turns, as Claude Code would have sent them."""
        history = [dumps(item) for item in self.surface.opening()]
        size = len(self.head) + sum(len(h) for h in history)
        turn = 0
        while size < self.context:
            call_id = f"call_{sid}_{turn}"
            function = {"name": CALL_NAME, "arguments": json.dumps(CALL_ARGUMENTS)}
            call = {"id": call_id, "type": "function", "function": function}
            items = [
                {"role": "assistant", "content": None, "tool_calls": [call]},
                *self.surface.tool_result(call_id, f"[{sid}] " + tool_output(turn)),
            ]
            encoded = [dumps(item) for item in items]
            history += encoded
            size += sum(len(e) for e in encoded)
            turn += 1
        session = Session(sid, history)
        self.sessions.append(session)
        return session

    async def turn(self, client: httpx.AsyncClient, session: Session, *, record: bool) -> bool:
        """One request; False when it timed out (the session stops)."""
        body = self.head + b"[" + b",".join(session.history) + b"]}"
        headers = {"X-Session-Id": session.sid, "content-type": "application/json"}
        first = not session.answers
        t0 = time.perf_counter()
        try:
            try:
                response = await client.post(self.url, content=body, headers=headers)
            except (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError):
                # A kept-alive connection the gateway closed as it was taken from the pool:
                # sent again once, as the OpenAI SDK does (the gateway answers a resent
                # request with the turn it recorded, never a second one).
                self.reconnects += 1
                response = await client.post(self.url, content=body, headers=headers)
        except httpx.TimeoutException:
            self.timeouts += record
            if record:
                self.requests.append(Request(t0, float("inf"), first))
            return False
        latency = time.perf_counter() - t0
        if response.status_code != 200:
            # Under overload the gateway may answer 503 (the log not answering in time): counted
            # and reported, the session stops; anything else is the benchmark's failure.
            failure = f"session {session.sid}: HTTP {response.status_code}: {response.text[:300]}"
            if response.status_code != 503 or not record:
                raise RuntimeError(failure)
            self.errors.append(failure)
            return False
        answer = response.json()
        reply = self.surface.reply(answer)
        if record:
            self.requests.append(Request(t0, latency, first))
        session.answers.append(answer["id"])
        session.prompt_tokens.append(int(answer["usage"]["prompt_tokens"]))
        session.history += [dumps(item) for item in reply.echo]
        output = f"[{session.sid}] " + tool_output(len(session.answers))
        session.history += [dumps(item) for item in self.surface.tool_result(reply.call_id, output)]
        return True


# -- what the gateway says ------------------------------------------------------------------------


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def lag_buckets(text: str) -> dict[float, float]:
    """The loop-lag histogram's cumulative counts by upper bound (inf last)."""
    buckets: dict[float, float] = {}
    prefix = f'{LAG_METRIC}_bucket{{le="'
    for line in text.splitlines():
        if line.startswith(prefix):
            le = line[len(prefix) :].split('"')[0]
            buckets[float(le)] = float(line.rsplit(" ", 1)[1])
    return dict(sorted(buckets.items()))


def gauge(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def quantile(before: dict[float, float], after: dict[float, float], q: float) -> float:
    """The ``q`` quantile of what the histogram counted between two scrapes, linear within its
    bucket (a quantile in the +Inf bucket reads as the last finite bound)."""
    grown = [(le, after[le] - before.get(le, 0.0)) for le in after]
    total = grown[-1][1]
    if total <= 0:
        return 0.0
    rank, lower, below = q * total, 0.0, 0.0
    for le, cumulative in grown:
        if cumulative >= rank:
            if le == float("inf"):
                return lower
            inside = cumulative - below
            return lower + (le - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = le, cumulative
    return lower


def highest_bucket(before: dict[float, float], after: dict[float, float]) -> float:
    """The upper bound of the highest bucket that counted a wake between the scrapes (past the
    last finite bound: that bound, which the stall exceeded)."""
    last, previous, finite = 0.0, 0.0, 0.0
    for le, cumulative in after.items():
        grown = cumulative - before.get(le, 0.0)
        if grown > previous:
            last = finite if le == float("inf") else le
        previous = grown
        finite = le
    return last


# -- one fleet ------------------------------------------------------------------------------------


def memory_settings() -> dict[str, int]:
    """The gateway's settings that bound what it holds: the product's defaults, passed as flags
    so that the report names them."""
    from turnstream.services.gateway.settings import GatewaySettings

    fields = GatewaySettings.model_fields
    names = ("session_turns_kept", "session_tokens_kept", "max_open_sessions", "kept_body_bytes")
    return {name: int(fields[name].default) for name in names}


async def backend_direct_ms(url: str, model: str, tokens: int, completion: list[int]) -> float:
    """The backend's own time for a prompt of ``tokens`` sent straight to it (median of 5)."""
    body = completion_body(model, [32 + i % 200 for i in range(tokens)], len(completion), ())
    spans = []
    async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT_S) as client:
        for _ in range(6):
            t0 = time.perf_counter()
            await complete(client, f"{url}/v1/completions", body)
            spans.append(time.perf_counter() - t0)
    return 1000 * statistics.median(spans[1:])


def written(path: Path) -> list[str] | None:
    """The lines of a file written whole (its last line ended), or None."""
    if not path.exists():
        return None
    text = path.read_text()
    return text.splitlines() if text.endswith("\n") else None


async def memory_snapshot(procs: harness.Procs, path: Path) -> None:
    """The gateway's live allocations by line since tracing started (``--tracemalloc-gateway``;
    the launcher's MemorySnapshot), printed in part."""
    path.unlink(missing_ok=True)  # noqa: ASYNC240 (a moment, once, after the measured window)
    procs.toggle_profile()  # the second SIGUSR1: written
    for _ in range(600):
        lines = written(path)
        if lines is not None:
            say("  the gateway's live allocations by line (tracemalloc):")
            say("\n".join("    " + line for line in lines[:20]))
            return
        await asyncio.sleep(0.1)
    say(f"  no allocations written to {path} within 60 s")


def full_collections(gc_log: Path, wall: tuple[float, float]) -> JSON:
    """The gateway's full (generation 2) collections in the window (the launcher's log, written
    when the gateway stopped): each one stops its event loop for its whole pause."""
    if not gc_log.exists():
        return {"count": None}
    pauses = [
        gc["pause_ms"]
        for gc in json.loads(gc_log.read_text())["full_collections"]
        if wall[0] <= gc["at"] <= wall[1]
    ]
    return {"count": len(pauses), "max_pause_ms": max(pauses, default=0.0), "pauses_ms": pauses}


async def run_fleet(args: argparse.Namespace, plan: FleetPlan, tmp: Path) -> JSON:
    settings = memory_settings()
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in settings.items()]
    tree = None if args.after_tree == harness.REPO else args.after_tree
    async with fixed_latency_stack(
        args,
        tmp,
        MAX_CONTEXT,
        f"gateway-bench-fleet{plan.suffix}",
        source_tree=tree,
        gateway_flags=flags,
    ) as stack:
        pid = stack.procs.gateway.pid
        shape = fleet_shape(plan.context)
        load = FleetLoad(shape, stack.model_dir.name, stack.gateway_url, plan.context)
        rng = random.Random(40)
        per = 16
        limits = httpx.Limits(max_connections=per, max_keepalive_connections=per)
        async with contextlib.AsyncExitStack() as stack_clients:
            clients = [
                await stack_clients.enter_async_context(
                    httpx.AsyncClient(limits=limits, timeout=CLIENT_TIMEOUT_S)
                )
                for _ in range(8)
            ]
            scrape = clients[0]

            async def metrics() -> str:
                return (await scrape.get(f"{stack.gateway_url}/metrics")).text

            for k in range(2):  # warm-up: lazy imports, first buffers
                warm = load.open(f"fleet{plan.suffix}-warm-{k}")
                for _ in range(3):
                    await load.turn(clients[0], warm, record=False)
            direct_ms = await backend_direct_ms(
                stack.backend_url,
                stack.model_dir.name,
                load.sessions[0].prompt_tokens[0],
                harness.reply_ids(stack.model_dir),
            )
            rss_before = rss_bytes(pid)
            if args.tracemalloc_gateway:
                stack.procs.toggle_profile()  # the first SIGUSR1: tracing from here
            t0 = time.perf_counter()
            fleet = [load.open(f"fleet{plan.suffix}-{i}") for i in range(plan.sessions)]
            built_s = time.perf_counter() - t0
            say(f"  histories of {plan.sessions} sessions built in {built_s:.1f} s")
            gate = asyncio.Semaphore(OPENING_CONCURRENCY)

            async def opening(i: int, session: Session) -> None:
                async with gate:
                    await load.turn(clients[i % len(clients)], session, record=False)

            t0 = time.perf_counter()
            await asyncio.gather(*(opening(i, s) for i, s in enumerate(fleet)))
            opened_s = time.perf_counter() - t0
            tokens = statistics.mean(s.prompt_tokens[0] for s in fleet)
            say(
                f"  {plan.sessions} first turns of {tokens:,.0f} tokens on average in "
                f"{opened_s:.1f} s; gateway RSS {rss_before / 2**20:,.0f} -> "
                f"{rss_bytes(pid) / 2**20:,.0f} MiB"
            )
            start_text = await metrics()
            cpu_start = harness.cpu_seconds(pid)
            if args.profile_gateway:
                stack.procs.toggle_profile()  # on for the window
            start = time.perf_counter()
            wall_start = time.time()
            end = start + plan.measure_s
            live = [s for s in fleet if s.answers]
            # (seconds into the window, the gauge): only reads GAUGE_CLEAR_S in or later see
            # the window alone (the gauge is the worst of the last 60 s; the opening's first
            # turns came just before the window).
            gauge_reads: list[tuple[float, float]] = []

            async def agent(client: httpx.AsyncClient, session: Session) -> None:
                while True:
                    await asyncio.sleep(rng.uniform(*plan.think_s))
                    if time.perf_counter() >= end or not await load.turn(
                        client, session, record=True
                    ):
                        return

            async def arrivals() -> list[asyncio.Task[None]]:
                tasks, n = [], 0
                while (wait := start + n / plan.arrivals_per_s - time.perf_counter()) < end - start:
                    await asyncio.sleep(max(0.0, wait))
                    if time.perf_counter() >= end:
                        break
                    session = load.open(f"fleet{plan.suffix}-new-{n}")
                    client = clients[n % len(clients)]

                    async def newcomer(session: Session, client: httpx.AsyncClient) -> None:
                        if await load.turn(client, session, record=True):
                            await agent(client, session)

                    tasks.append(asyncio.create_task(newcomer(session, client)))
                    n += 1
                return tasks

            async def watch() -> None:
                due = start + GAUGE_CLEAR_S
                while due < end:
                    await asyncio.sleep(due - time.perf_counter())
                    gauge_reads.append((due - start, gauge(await metrics(), LAG_MAX_METRIC)))
                    due += GAUGE_EVERY_S

            watcher = asyncio.create_task(watch())
            agents = [
                asyncio.create_task(agent(clients[i % len(clients)], s)) for i, s in enumerate(live)
            ]
            newcomers = await arrivals()
            await asyncio.gather(*agents, *newcomers, watcher)
            end_text = await metrics()
            window_s = time.perf_counter() - start
            wall = (wall_start, time.time())
            cpu_s = harness.cpu_seconds(pid) - cpu_start
            if args.profile_gateway:
                stack.procs.toggle_profile()
            gauge_reads.append((window_s, gauge(end_text, LAG_MAX_METRIC)))
            rss_after = rss_bytes(pid)
            if args.tracemalloc_gateway:
                await memory_snapshot(stack.procs, args.tracemalloc_gateway)
        held = sum(1 for s in load.sessions if s.answers) - 2  # the warm-up's two left out
        sample = [s for s in load.sessions if len(s.answers) > 1][:CHECKED_SESSIONS]
        checked = await check_continued(stack.js, ((s.sid, s.answers) for s in sample))
    out = figures_of(
        plan,
        load,
        settings,
        window=(window_s, start_text, end_text, gauge_reads),
        rss=(rss_before, rss_after, held),
        direct_ms=direct_ms,
        tokens=tokens,
        checked=checked,
        args=args,
    )
    out["details"]["gateway_full_gcs"] = full_collections(tmp / "gc.json", wall)
    requests = max(1, len(load.requests))
    out["details"]["gateway_cpu_ms_per_request"] = round(1000 * cpu_s / requests, 2)
    out["details"]["gateway_cpu_share"] = round(cpu_s / window_s, 3)
    if args.profile_gateway:  # written when the gateway stopped
        cpu_ms = 1000 * cpu_s / requests  # under the profiler: its overhead included
        out["profile"] = harness.print_profile(
            args.profile_gateway, args.profile_top, requests, cpu_ms
        )
    return out


def figures_of(
    plan: FleetPlan,
    load: FleetLoad,
    settings: dict[str, int],
    *,
    window: tuple[float, str, str, list[tuple[float, float]]],
    rss: tuple[int, int, int],
    direct_ms: float,
    tokens: float,
    checked: int,
    args: argparse.Namespace,
) -> JSON:
    window_s, start_text, end_text, gauge_reads = window
    rss_before, rss_after, held = rss
    before, after = lag_buckets(start_text), lag_buckets(end_text)
    # Over what the backend itself took for a prompt this long, sent straight to it (its fixed
    # latency + reading the prompt's ids): the gateway's share; over --ttft-ms alone beside it.
    over_fixed = sorted(1000 * r.latency_s - args.ttft_ms for r in load.requests)
    added = {
        kind: sorted(1000 * r.latency_s - direct_ms for r in load.requests if keep(r))
        for kind, keep in (
            ("all", lambda r: True),
            ("first", lambda r: r.first),
            ("later", lambda r: not r.first),
        )
    }

    def p(values: list[float], q: float) -> float | None:
        if not values:
            return None
        value = values[min(len(values) - 1, int(q / 100 * len(values)))]
        return None if value == float("inf") else round(value, 2)

    growth = rss_after - rss_before
    per_session_mb = growth / max(1, held) / 2**20
    kept_bytes = gauge(end_text, KEPT_BYTES_METRIC)
    ids_bound = min(held, settings["max_open_sessions"]) * settings["session_tokens_kept"] * 4
    bound = ids_bound + settings["kept_body_bytes"]
    clear = [value for at, value in gauge_reads if at >= GAUGE_CLEAR_S]
    lag_max, lag_max_from = (
        (max(clear), "gauge") if clear else (highest_bucket(before, after), "histogram bucket")
    )
    s = plan.suffix
    figures: JSON = {
        f"fleet_loop_lag_max_ms{s}": round(1000 * lag_max, 2),
        f"fleet_loop_lag_p99_ms{s}": round(1000 * quantile(before, after, 0.99), 2),
        f"fleet_added_p99_ms{s}": p(added["all"], 99),
        f"fleet_timeouts{s}": load.timeouts,
        f"fleet_rss_mb_per_session{s}": round(per_session_mb, 3),
    }
    details = {
        "sessions_opened": plan.sessions,
        "sessions_held": held,
        "mean_first_prompt_tokens": round(tokens),
        "think_s": plan.think_s,
        "arrivals_per_s": plan.arrivals_per_s,
        "window_s": round(window_s, 1),
        "requests": len(load.requests),
        "errors_503": len(load.errors),
        "client_reconnects": load.reconnects,
        "first_error": load.errors[0] if load.errors else None,
        "first_turns": len(added["first"]),
        "later_turns": len(added["later"]),
        "turns_per_s": round(len(load.requests) / window_s, 1),
        "added_ms": {
            kind: {q: p(v, q) for q in (50, 90, 99)} | {"max": p(v, 100)}
            for kind, v in added.items()
        },
        "backend_direct_ms": round(direct_ms, 2),
        "added_over_ttft_ms_p99": p(over_fixed, 99),
        "loop_lag_p50_ms": round(1000 * quantile(before, after, 0.5), 3),
        "loop_lag_p999_ms": round(1000 * quantile(before, after, 0.999), 2),
        "loop_lag_highest_bucket_ms": round(1000 * highest_bucket(before, after), 1),
        "loop_lag_max_from": lag_max_from,
        "loop_lag_gauge_reads_ms": {f"{at:.0f}s": round(1000 * g, 1) for at, g in gauge_reads},
        "loop_lag_wakes": round(after[float("inf")] - before.get(float("inf"), 0.0)),
        "rss_before_mb": round(rss_before / 2**20, 1),
        "rss_after_mb": round(rss_after / 2**20, 1),
        "settings": settings,
        "kept_body_bytes_held": int(kept_bytes),
        "kept_bodies_within_budget": kept_bytes <= settings["kept_body_bytes"],
        "settings_bound_mb": round(bound / 2**20, 1),
        "rss_within_settings": growth <= bound,
        "checked_later_turns": checked,
    }
    say(
        f"  fleet{s or ' (256-style)'}: {held} sessions held, {len(load.requests)} requests in "
        f"{window_s:.0f} s ({details['turns_per_s']}/s), added p99 "
        f"{figures[f'fleet_added_p99_ms{s}']} ms (later {details['added_ms']['later'][99]}, "
        f"first {details['added_ms']['first'][99]}); loop lag p99 "
        f"{figures[f'fleet_loop_lag_p99_ms{s}']} ms, max {figures[f'fleet_loop_lag_max_ms{s}']} "
        f"ms; timeouts {load.timeouts}, 503s {len(load.errors)}; RSS {details['rss_before_mb']} -> "
        f"{details['rss_after_mb']} MiB = {per_session_mb:.3f} MiB a session; kept bodies "
        f"{kept_bytes / 2**20:.1f} MiB of {settings['kept_body_bytes'] / 2**20:.0f}"
    )
    return {"figures": figures, "details": details}


async def fleet_main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.compare_with is not None or args.backend_kind != "fixed-latency":
        parser.error("--fleet runs one gateway on the fixed-latency backend")
    if args.max_inflight_per_replica is None:
        args.max_inflight_per_replica = 64
    plans = QUICK if args.quick else FULL
    if args.measure_s:
        plans = tuple(
            FleetPlan(p.suffix, p.sessions, p.context, p.think_s, p.arrivals_per_s, args.measure_s)
            for p in plans
        )
    started = time.perf_counter()
    info = harness.gateway_machine_info()
    banner("a fleet on one gateway", args.quick, info)
    figures: JSON = {}
    details: JSON = {}
    for plan in plans:
        say(
            f"\n{plan.sessions} sessions of ~{plan.context:,} tokens, a turn every "
            f"{plan.think_s[0]:g}-{plan.think_s[1]:g} s, {plan.arrivals_per_s:g} new session(s) "
            f"a second, {plan.measure_s:g} s measured; backend {args.ttft_ms:g} ms"
        )
        traced = args.tracemalloc_gateway
        if traced is not None:  # one file per fleet
            traced = traced.with_stem(traced.stem + plan.suffix)
        profile = args.profile_gateway
        if profile is not None:
            profile = profile.with_stem(profile.stem + plan.suffix)
        fleet_args = argparse.Namespace(
            **{**vars(args), "tracemalloc_gateway": traced, "profile_gateway": profile}
        )
        with tempfile.TemporaryDirectory(prefix="ts-gwfleet-", dir=args.store_dir) as tmp:
            out = await run_fleet(fleet_args, plan, Path(tmp))
        figures.update(out["figures"])
        details[f"fleet{plan.suffix or '_256'}"] = out["details"]
        if "profile" in out:
            details[f"fleet{plan.suffix or '_256'}"]["profile"] = out["profile"]
    met = {}
    for s in ("", "_1000"):
        met[f"fleet{s or '_256'}"] = (
            figures[f"fleet_loop_lag_max_ms{s}"] <= TARGETS["loop_lag_max_ms"]
            and figures[f"fleet_loop_lag_p99_ms{s}"] <= TARGETS["loop_lag_p99_ms"]
            and (figures[f"fleet_added_p99_ms{s}"] or float("inf")) <= TARGETS["added_p99_ms"]
            and figures[f"fleet_timeouts{s}"] == 0
        )
    met["rss_100k"] = figures["fleet_rss_mb_per_session"] <= TARGET_RSS_MB_100K
    targets = {**TARGETS, "rss_mb_per_100k_session": TARGET_RSS_MB_100K, "met": met}
    say(f"\ntargets: {met}")
    figures.update(targets=targets, fleet=details, client_timeout_s=CLIENT_TIMEOUT_S)
    finish(figures, quick=args.quick, duration_s=time.perf_counter() - started, info=info)


if __name__ == "__main__":
    run_gateway_mode(__doc__, fleet_main, fleet=True)
