"""Benchmark: the gateway's CPU per generated token, issue 16 point 3 (also
``gateway_overhead.py --per-token``, and part of its default run).

One gateway on the fixed-latency backend, which answers every request with the same 460 tokens
(one SSE event per token when streamed, as vLLM sends them) or, when ``max_tokens`` is 16, the
first 16 of them. Each request is the first turn of a new session with the same ~1k-token prompt
(so nothing but the generated tokens differs between phases), sent by ``CONCURRENCY`` workers.
Four phases a round (460 and 16 tokens, a client that does not stream and one that does), their
order reversed every other round; the gateway's CPU (user + system, from /proc) is read around
each phase. CPU per generated token = (CPU per turn at 460 - CPU per turn at 16) / 444, per round,
and the median over the rounds is reported:

- ``cpu_us_per_output_token``: a client that does not stream (target <= 2 us);
- ``cpu_us_per_output_token_streamed``: a client that streams (target <= 6 us).

With ``--itl-ms 0`` (the default) the backend writes all its events at once, so the gateway reads
many in one network read; ``--itl-ms 1`` spaces them out as a real server's decode steps do (one
read per event): run both to see what reading events one by one costs.

Today's figures (2026-11-28, the 2-core VM with nothing else running, the backend transport of
31763df): full runs 0.94 and 0.61 us not streamed, 3.61 and 2.11 us streamed (targets 2 and 6;
2026-11-26: 0.56 / 0.38 and 3.43 / 3.80; the gateway before issue 16, on a loaded VM: 33.8 and
94.5). docs/PERFORMANCE.md, section 3, has the history.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import statistics
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import harness
import httpx
from harness import banner, finish, run_gateway_mode, say

from eventlog.server import NatsServer, free_port

JSON = dict[str, Any]

LONG, SHORT = 460, 16  # output tokens of the two kinds of phase
PROMPT_CHARS = 1_000  # ~1k tokens with the tiny byte-level tokenizer
CONCURRENCY = 8
TURNS = {True: 96, False: 240}  # per phase: quick, full
ROUNDS = {True: 2, False: 4}
TARGETS = {"cpu_us_per_output_token": 2.0, "cpu_us_per_output_token_streamed": 6.0}
SENTENCE = "The build passed after the cache was cleared and the tests were run again. "


def completion_ids(model_dir: Path) -> list[int]:
    """LONG tokens of plain prose, the last one the end of turn."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids: list[int] = tokenizer.encode(SENTENCE * 20, add_special_tokens=False)[: LONG - 1]
    assert len(ids) == LONG - 1, "the sentence is too short for the reply"
    return [*ids, int(tokenizer.eos_token_id)]


@dataclass
class Phase:
    tokens: int
    streamed: bool
    round: int
    turns: int
    cpu_s: float
    completion_tokens: int

    @property
    def cpu_ms_per_turn(self) -> float:
        return 1000 * self.cpu_s / self.turns


@dataclass
class Stack:
    url: str
    procs: harness.Procs
    model: str


@contextlib.asynccontextmanager
async def per_token_stack(args: argparse.Namespace, tmp: Path) -> AsyncIterator[Stack]:
    """nats-server, the fixed-latency backend answering LONG tokens, and one gateway."""
    from gateway.model import ensure_tiny_model

    model_dir = ensure_tiny_model(Path(args.model_cache))
    completion = completion_ids(model_dir)
    conv = harness.Conversation([], [], (completion[-1],), completion, len(completion))
    log_dir = tmp / "logs"
    log_dir.mkdir()
    nats = NatsServer(tmp / "nats").start()
    backend_port, gateway_port = free_port(), free_port()
    backend_url = f"http://127.0.0.1:{backend_port}"
    backend = harness.spawn(
        harness.backend_command(args, backend_port, conv, model_dir.name),
        log_dir / "backend.log",
        os.environ,
    )
    tree = None if args.after_tree == harness.REPO else args.after_tree
    gateway_cmd = harness.gateway_command(
        args, model_dir, nats.url, backend_url, gateway_port, tmp / "data", tmp / "gc.json", tree
    )
    gateway: Any = None
    try:
        await harness.wait_http(f"{backend_url}/health", backend, "fixed-latency backend", 30)
        gateway = harness.spawn(gateway_cmd, log_dir / "gateway.log", harness.gateway_env(args))
        url = f"http://127.0.0.1:{gateway_port}"
        await harness.wait_http(f"{url}/health", gateway, "gateway", 120)
        yield Stack(url, harness.Procs(backend, gateway, nats), model_dir.name)
    except BaseException:
        for log_file in sorted(log_dir.iterdir()):
            say(f"--- {log_file.name} (tail)\n{log_file.read_text()[-3000:]}")
        raise
    finally:
        if gateway is not None:
            harness.stop_process(gateway)
        harness.stop_process(backend)
        nats.stop()


class Load:
    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.sessions = 0
        self.prompt = [
            {"role": "system", "content": ("You are a careful coding agent. " * 40)[:PROMPT_CHARS]},
            {"role": "user", "content": "Summarize what happened in the last build."},
        ]

    async def turn(self, client: httpx.AsyncClient, tokens: int, streamed: bool) -> int:
        """One first turn of a new session; returns the completion tokens the client got."""
        self.sessions += 1
        body: JSON = {
            "model": self.stack.model,
            "messages": self.prompt,
            "max_tokens": tokens,
            "stream": streamed,
        }
        if streamed:
            body["stream_options"] = {"include_usage": True}
        headers = {"X-Session-Id": f"pt-{self.sessions}"}
        url = f"{self.stack.url}/v1/chat/completions"
        if not streamed:
            response = await client.post(url, json=body, headers=headers)
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {response.text[:600]}")
            return int(response.json()["usage"]["completion_tokens"])
        usage = None
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())!r}")
            async for line in response.aiter_lines():
                if line.startswith("data: {") and '"usage":{' in line:
                    usage = json.loads(line[6:])["usage"]
        if usage is None:
            raise RuntimeError("the stream ended without its usage chunk")
        return int(usage["completion_tokens"])

    async def phase(
        self, client: httpx.AsyncClient, tokens: int, streamed: bool, rnd: int, turns: int
    ) -> Phase:
        got: list[int] = []
        queue = iter(range(turns))

        async def worker() -> None:
            for _ in queue:
                got.append(await self.turn(client, tokens, streamed))

        cpu0 = self.stack.procs.cpu()["gateway"]
        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
        cpu1 = self.stack.procs.cpu()["gateway"]
        if any(n != tokens for n in got):
            raise RuntimeError(f"asked for {tokens} tokens, got {sorted(set(got))}")
        return Phase(tokens, streamed, rnd, turns, cpu1 - cpu0, sum(got))


def per_token_figures(phases: list[Phase]) -> JSON:
    """The two keys, the per-round values and the CPU per turn of each kind of phase."""
    figures: JSON = {}
    for streamed, key in (
        (False, "cpu_us_per_output_token"),
        (True, "cpu_us_per_output_token_streamed"),
    ):
        mine = [p for p in phases if p.streamed == streamed]
        rounds = sorted({p.round for p in mine})
        per_round = []
        for rnd in rounds:
            long = next(p for p in mine if p.round == rnd and p.tokens == LONG)
            short = next(p for p in mine if p.round == rnd and p.tokens == SHORT)
            per_round.append(1000 * (long.cpu_ms_per_turn - short.cpu_ms_per_turn) / (LONG - SHORT))
        figures[key] = round(statistics.median(per_round), 2)
        figures[f"{key}_rounds"] = [round(v, 2) for v in per_round]
        for tokens in (LONG, SHORT):
            cpu = [p.cpu_ms_per_turn for p in mine if p.tokens == tokens]
            mode = "streamed" if streamed else "whole"
            figures[f"cpu_ms_per_turn_{tokens}_tokens_{mode}"] = round(statistics.median(cpu), 3)
    return figures


async def measure_per_token(args: argparse.Namespace, tmp: Path) -> JSON:
    """Run the phases (``args.quick``: fewer turns and rounds) and return the figures."""
    quick = bool(args.quick)
    turns, rounds = TURNS[quick], args.rounds or ROUNDS[quick]
    kinds = [(LONG, False), (SHORT, False), (LONG, True), (SHORT, True)]
    phases: list[Phase] = []
    profiled_turns = 0
    async with per_token_stack(args, tmp) as stack:
        load = Load(stack)
        limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
        async with httpx.AsyncClient(timeout=120.0, limits=limits) as client:
            for tokens, streamed in kinds:  # warm-up
                await load.phase(client, tokens, streamed, -1, CONCURRENCY * 2)
            gc.collect()
            for rnd in range(rounds):
                order = kinds if rnd % 2 == 0 else kinds[::-1]
                line = []
                for tokens, streamed in order:
                    profiled = (
                        args.profile_gateway
                        and tokens == LONG
                        and streamed == (args.per_token_profile == "streamed")
                    )
                    if profiled:
                        stack.procs.toggle_profile()
                    phase = await load.phase(client, tokens, streamed, rnd, turns)
                    if profiled:
                        stack.procs.toggle_profile()
                        profiled_turns += turns
                    phases.append(phase)
                    line.append(
                        f"{tokens}{'s' if streamed else 'w'} {phase.cpu_ms_per_turn:5.2f} ms"
                    )
                say(f"  round {rnd + 1}/{rounds} (CPU/turn): " + " | ".join(line))
    figures = per_token_figures(phases)
    if args.profile_gateway:  # the gateway wrote it on its way out
        mode = "streamed" if args.per_token_profile == "streamed" else "whole"
        cpu_ms = figures[f"cpu_ms_per_turn_{LONG}_tokens_{mode}"]
        say(f"\nprofiled: the {LONG}-token phases, {mode} (cProfile slows them: shares only)")
        harness.print_profile(args.profile_gateway, args.profile_top, profiled_turns, cpu_ms)
    say(
        f"CPU per generated token: {figures['cpu_us_per_output_token']:.2f} us not streamed "
        f"(target <= 2), {figures['cpu_us_per_output_token_streamed']:.2f} us streamed "
        f"(target <= 6); rounds {figures['cpu_us_per_output_token_rounds']} / "
        f"{figures['cpu_us_per_output_token_streamed_rounds']}"
    )
    figures["per_token_settings"] = {
        "output_tokens": [LONG, SHORT],
        "prompt_chars": PROMPT_CHARS,
        "concurrency": CONCURRENCY,
        "turns_per_phase": turns,
        "rounds": rounds,
        "ttft_ms": args.ttft_ms,
        "itl_ms": args.itl_ms,
    }
    return figures


async def per_token_main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.compare_with is not None or args.backend_kind != "fixed-latency":
        parser.error("--per-token runs one gateway on the fixed-latency backend")
    if args.max_inflight_per_replica is None:
        args.max_inflight_per_replica = CONCURRENCY
    started = time.perf_counter()
    info = harness.gateway_machine_info()
    banner("gateway CPU per generated token", args.quick, info)
    with tempfile.TemporaryDirectory(prefix="ts-gwpt-", dir=args.store_dir) as tmp:
        figures = await measure_per_token(args, Path(tmp))
    figures["targets"] = {
        **TARGETS,
        "met": all(figures[key] <= limit for key, limit in TARGETS.items()),
    }
    finish(figures, quick=args.quick, duration_s=time.perf_counter() - started, info=info)


if __name__ == "__main__":
    run_gateway_mode(__doc__, per_token_main)
