"""Benchmark: interrupted turns (issue 37): what a weight update in the middle of a turn costs.

A trainer updating the policy pauses its inference servers (vLLM's ``/pause?mode=abort``), which
end the generations in flight with ``finish_reason: "abort"``; it loads the new weights,
publishes the new version to the policy bucket, and resumes them (``/resume``). The gateway
resubmits each aborted turn's prompt plus the tokens generated so far (ids), with what is left
of ``max_tokens``, and joins the two parts into one answer (``gateway.serving.engine``).

Run it from the repository root (nats-server on PATH, or in the venv's bin)::

    .venv/bin/python benchmarks/interrupted_turns.py           # 6 rounds of 8 turns a phase, ~85 s
    .venv/bin/python benchmarks/interrupted_turns.py --quick   # 2 rounds of 4, ~35 s

What it measures
----------------
A real ``turnstream gateway --backend vllm`` (the tiny model's tokenizer; a real nats-server)
in front of the fixed-latency stand-in for vLLM (``harness/fixed_latency_backend.py``), whose
answer is ``--tokens`` tokens (default 128: prose, then the end-of-turn token) at ``--itl-ms``
per token after ``--ttft-ms`` (default both 2 ms). Turns one at a time, each the first of a
session of its own (the same prompt length), on Chat Completions through httpx, two phases:

- **plain**: the turn runs uninterrupted;
- **interrupted**: before the turn the benchmark arms the stand-in's ``POST /interrupt``: the
  generation ends after token ``--abort-at`` (default half) with ``finish_reason: "abort"`` (an
  event without tokens, as vLLM ends an aborted request; not streamed, the tokens so far) and
  the stand-in pauses, queueing what arrives as a paused vLLM does. As a trainer does, the
  benchmark then publishes the next weight version to the policy bucket
  (``turnstream.integrations.policy.put_weight_version``) and, ``--pause-ms`` (default 100)
  after the abort, resumes the stand-in (``POST /resume``), which serves the queued continuation
  the rest of the answer, so that the two parts are the plain turn's tokens.

Streamed (``stream: true``, usage included) and not, each a pair of phases per round, the pair's
order alternating from round to round. Per phase: the client's wall time per turn (request sent
to last byte read), the gateway's CPU per turn (all its threads' on-CPU time over the phase, from
``/proc/PID/task/*/schedstat``), and for interrupted turns the pause as the stand-in measured it
(abort sent to resume). Per mode, each the median over rounds of the round's figure:

- ``added_latency_ms``: interrupted - pause - plain - (``ttft`` - ``itl``): the time an
  interruption adds beyond the pause itself. The stand-in's continuation starts with a first
  token (``ttft``) where the plain turn had a next one (``itl``), which is subtracted (0 with
  the defaults); a real server's continuation also prefills the prompt and the tokens so far,
  which the stand-in does not (docs/PERFORMANCE.md, "Interrupted turns");
- ``cpu_ms_per_resubmission``: the gateway's CPU per interrupted turn - per plain turn, and
  ``cpu_ratio`` = interrupted / plain.

Checked (exits 1 otherwise): every answer is the plain turn's text and ``completion_tokens``; every
turn's ``TurnCompleted`` in EVENTS holds exactly the stand-in's tokens (token-exact), an
interrupted one with ``sampling["continued"] == [{"at": k, ...}]`` and ``version_spans`` the version
before the update for its first k tokens and the published one for the rest; **tokens thrown
away** = the tokens the stand-in generated in interrupted phases - the tokens recorded for their
turns = 0; the gateway's ``turnstream_gateway_interrupted_generations_total{outcome="continued"}``
counts every interrupted turn, ``gave_up`` and ``version_limit`` none. Reported, not checked (a
timing): how many continuations reached the stand-in during the pause (resubmitted before the
resume).

``--after-tree DIR``: the gateway runs that checkout's code (``git worktree add DIR REV``: a
revision before a change), as in ``gateway_overhead.py``. ``--gateway-log-level WARNING`` and
``--no-version-update`` take the log lines and the version update out of the CPU figure.

The LAST line is one JSON object of these figures and the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import harness
import httpx
from harness import banner, finish, fixed_latency_stack, say, session_turns, thread_cpu_ns

from eventlog import Bucket, LogSettings
from schemas.events import TurnCompleted
from turnstream.integrations.policy import put_weight_version

JSON = dict[str, Any]
MAX_CONTEXT = 4096
MODES = ("streamed", "whole")
KINDS = ("plain", "interrupted")
# The answer's text (the tiny model's tokenizer is byte-level: about one token a character).
PROSE = (
    "The gateway records every token the policy sampled, and a weight update in the middle of a "
    "turn costs the agent nothing: the tokens so far are sent again with the prompt, and the new "
    "policy carries on where the old one stopped. "
)
QUESTION = "Explain, in one paragraph, what happens to a turn when the trainer updates weights."


@dataclass(frozen=True)
class Plan:
    rounds: int
    turns: int  # turns a phase


FULL = Plan(rounds=6, turns=8)
QUICK = Plan(rounds=2, turns=4)


@dataclass
class Answer:
    session: str
    wall_s: float
    paused_s: float = 0.0  # the pause as the stand-in measured it (interrupted turns)
    queued: int = 0  # continuations waiting when it resumed
    version: int | None = None  # the version published during the pause


@dataclass
class Phase:
    mode: str
    kind: str
    round: int
    answers: list[Answer]
    cpu_s: float  # the gateway's, all threads
    backend_tokens: int  # tokens the stand-in generated during the phase
    waited_s: float = 0.0  # the gateway's interrupted_wait_seconds over the phase, summed

    # Medians of the phase's turns: one turn a loaded machine delays must not move the phase.
    @property
    def wall_ms(self) -> float:
        return 1000 * statistics.median(a.wall_s for a in self.answers)

    @property
    def paused_ms(self) -> float:
        return 1000 * statistics.median(a.paused_s for a in self.answers)

    @property
    def beyond_pause_ms(self) -> float:
        """The turn's wall time less its own pause."""
        return 1000 * statistics.median(a.wall_s - a.paused_s for a in self.answers)

    @property
    def cpu_ms(self) -> float:
        return 1000 * self.cpu_s / len(self.answers)


@dataclass
class Turns:
    """Turns through the gateway, plain or interrupted on cue, and what they are checked by."""

    gateway_url: str
    backend_url: str
    model: str
    bucket: Bucket
    abort_at: int
    pause_s: float
    completion: list[int]
    update: bool  # publish a new version during each pause
    question: str  # the user message (--prompt-chars long)
    client: httpx.AsyncClient = field(default_factory=lambda: httpx.AsyncClient(timeout=60))
    control: httpx.AsyncClient = field(default_factory=lambda: httpx.AsyncClient(timeout=60))
    version: int = 0
    count: int = 0
    reply: str | None = None  # the plain turn's text, every answer's
    sent: dict[str, tuple[str, Answer]] = field(default_factory=dict)  # session: kind, answer
    recorded: dict[str, Any] = field(default_factory=dict)  # session: its prompt's ids

    async def close(self) -> None:
        await self.client.aclose()
        await self.control.aclose()

    async def ask(self, session: str, stream: bool) -> tuple[str, int]:
        """One turn's request; its text and ``completion_tokens``."""
        messages = [{"role": "user", "content": self.question}]
        body: JSON = {"model": self.model, "messages": messages}
        headers = {"X-Session-Id": session}
        url = f"{self.gateway_url}/v1/chat/completions"
        if not stream:
            response = await self.client.post(url, json=body, headers=headers)
            if response.status_code != 200:
                raise RuntimeError(f"{session}: HTTP {response.status_code}: {response.text[:300]}")
            answer = response.json()
            return answer["choices"][0]["message"]["content"], answer["usage"]["completion_tokens"]
        body |= {"stream": True, "stream_options": {"include_usage": True}}
        text, tokens = [], 0
        async with self.client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                detail = (await response.aread())[:300]
                raise RuntimeError(f"{session}: HTTP {response.status_code}: {detail!r}")
            async for line in response.aiter_lines():
                if not line.startswith("data:") or line.endswith("[DONE]"):
                    continue
                event = json.loads(line[5:])
                for choice in event.get("choices") or ():
                    text.append(choice["delta"].get("content") or "")
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
        return "".join(text), tokens

    async def turn(self, tag: str, stream: bool, interrupted: bool) -> Answer:
        self.count += 1
        session = f"{tag}-{self.count}"
        backend = self.backend_url
        if interrupted:
            await self.control.post(f"{backend}/interrupt", json={"after_tokens": self.abort_at})
        started = time.perf_counter()
        asked = asyncio.ensure_future(self.ask(session, stream))
        answer = Answer(session, 0.0)
        if interrupted:
            paused = asyncio.ensure_future(self.control.get(f"{backend}/paused"))
            await asyncio.wait({asked, paused}, return_when=asyncio.FIRST_COMPLETED)
            if not paused.done():
                paused.cancel()
                await asked  # raises what failed
                raise RuntimeError(f"{session}: the turn ended, the backend never paused")
            seen = time.perf_counter()
            if self.update:  # the contract (gateway.core.versions): publish, then resume
                self.version += 1
                await put_weight_version(self.bucket, harness.RUN, self.version)
            await asyncio.sleep(max(0.0, self.pause_s - (time.perf_counter() - seen)))
            resumed = (await self.control.post(f"{backend}/resume")).json()
            answer.paused_s, answer.queued = resumed["paused_s"], resumed["queued"]
            answer.version = self.version
        text, tokens = await asked
        answer.wall_s = time.perf_counter() - started
        if self.reply is None and not interrupted:
            self.reply = text
        if text != self.reply or tokens != len(self.completion):
            raise RuntimeError(
                f"{session}: answer of {tokens} tokens {text[:80]!r}..., expected "
                f"{len(self.completion)} tokens {str(self.reply)[:80]!r}..."
            )
        self.sent[session] = ("interrupted" if interrupted else "plain", answer)
        return answer

    async def phase(
        self, procs: harness.Procs, mode: str, kind: str, rnd: int, turns: int
    ) -> Phase:
        stats = f"{self.backend_url}/stats"
        tokens0 = (await self.control.get(stats)).json()["tokens"]
        waited0 = await self.waited_s()  # read outside the CPU window
        cpu0 = thread_cpu_ns(procs.gateway.pid)
        answers = [
            await self.turn(f"{mode}-{kind}-r{rnd}", mode == "streamed", kind == "interrupted")
            for _ in range(turns)
        ]
        cpu = (thread_cpu_ns(procs.gateway.pid) - cpu0) / 1e9
        tokens = (await self.control.get(stats)).json()["tokens"] - tokens0
        waited = await self.waited_s() - waited0
        return Phase(mode, kind, rnd, answers, cpu, tokens, waited)

    async def metrics(self) -> JSON:
        return interrupted_metrics((await self.control.get(f"{self.gateway_url}/metrics")).text)

    async def waited_s(self) -> float:
        return float((await self.metrics()).get("wait_sum", 0.0))


async def check_log(js: Any, turns: Turns) -> JSON:
    """Every turn's record: the stand-in's tokens exactly; an interrupted one continued once at
    ``abort_at``, its tokens' versions split there. Raises at the first that is not."""
    k, n = turns.abort_at, len(turns.completion)
    checked = {"plain": 0, "interrupted": 0}
    for session, (kind, answer) in turns.sent.items():
        events = [e for e in (await session_turns(js, session)).values()]
        if len(events) != 1 or not isinstance(events[0], TurnCompleted):
            raise RuntimeError(f"{session}: {len(events)} turns recorded, expected 1")
        event = events[0]
        turns.recorded[session] = event.prompt_ids
        if event.completion_ids.tolist() != turns.completion:
            raise RuntimeError(
                f"{session}: recorded {len(event.completion_ids)} tokens, not the backend's {n}"
            )
        continued = event.sampling.get("continued")
        if kind == "plain" or not turns.update:
            if (kind == "plain") != (not continued) or event.version_spans is not None:
                raise RuntimeError(f"{session}: a plain turn recorded {continued}, spans")
        else:
            spans = event.version_spans or []
            at = [c["at"] for c in continued or ()]
            split = [count for _, count in spans] == [k, n - k]
            if at != [k] or not split or spans[-1][0] != answer.version:
                raise RuntimeError(
                    f"{session}: continued {continued}, version spans {spans}; expected one "
                    f"continuation at {k}, spans [(<{answer.version}, {k}), "
                    f"({answer.version}, {n - k})]"
                )
        checked[kind] += 1
    return checked


def interrupted_metrics(text: str) -> JSON:
    """The gateway's interruption counters by outcome, and the wait histogram's sum and count
    (``wait_sum``, ``wait_count``)."""
    out: JSON = {}
    wait = "turnstream_gateway_interrupted_wait_seconds"
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name.startswith("turnstream_gateway_interrupted_generations_total{"):
            out[name.split('"')[1]] = float(value)
        elif name in (f"{wait}_sum", f"{wait}_count"):
            out[name.replace(wait, "wait")] = float(value)
    return out


async def bench(args: argparse.Namespace, plan: Plan, tmp: Path) -> JSON:
    from transformers import AutoTokenizer

    from gateway.model import ensure_tiny_model

    model_dir = ensure_tiny_model(Path(args.model_cache))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer.encode(PROSE * (1 + args.tokens // 64), add_special_tokens=False)
    completion = [*ids[: args.tokens - 1], int(tokenizer.eos_token_id)]
    question = QUESTION + " " + (PROSE * (1 + args.prompt_chars // len(PROSE)))[: args.prompt_chars]
    max_context = max(MAX_CONTEXT, 2 * len(question) + 2 * args.tokens)
    tree = None if args.after_tree == harness.REPO else args.after_tree
    async with fixed_latency_stack(
        args, tmp, max_context, "bench-interrupted-turns", completion=completion, source_tree=tree
    ) as stack:
        bucket = await Bucket.open(stack.js, LogSettings().names.policy_bucket)
        turns = Turns(
            stack.gateway_url,
            stack.backend_url,
            stack.model_dir.name,
            bucket,
            args.abort_at,
            args.pause_ms / 1000,
            completion,
            not args.no_version_update,
            question,
        )
        phases: list[Phase] = []
        try:
            for mode in MODES:  # warm-up, unmeasured (the first is the plain answer's text)
                for kind in KINDS:
                    await turns.phase(stack.procs, mode, kind, -1, 2)
            for rnd in range(plan.rounds):
                for mode in MODES if rnd % 2 == 0 else MODES[::-1]:
                    pair = []
                    for kind in KINDS if (rnd + (mode == "whole")) % 2 == 0 else KINDS[::-1]:
                        pair.append(await turns.phase(stack.procs, mode, kind, rnd, plan.turns))
                    plain, cut = sorted(pair, key=lambda p: p.kind != "plain")
                    say(
                        f"  round {rnd + 1}/{plan.rounds} {mode:<8}: plain {plain.wall_ms:7.1f} "
                        f"ms, interrupted {cut.wall_ms:7.1f} ms (paused {cut.paused_ms:6.1f}); "
                        f"gateway CPU/turn {plain.cpu_ms:6.2f} / {cut.cpu_ms:6.2f} ms"
                    )
                    phases += pair
            checks = await check_log(stack.js, turns)
            metrics = await turns.metrics()
            policy_read_ms = await policy_read(bucket)
        finally:
            await turns.close()
    return {
        "phases": phases,
        "checks": checks,
        "metrics": metrics,
        "t": turns,
        "policy_read_ms": policy_read_ms,
        "prompt_tokens": len(next(iter(turns.recorded.values()))),
    }


async def policy_read(bucket: Bucket, n: int = 200) -> float:
    """For scale: one read of the run's entry in the policy bucket, as the gateway reads it for a
    continuation's version (``kv.get``), from this process: the median of ``n``, in ms."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        await bucket.get(harness.RUN)
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def report(args: argparse.Namespace, result: JSON) -> JSON:
    phases: list[Phase] = result["phases"]
    turns: Turns = result["t"]
    backend_extra_ms = args.ttft_ms - args.itl_ms  # the stand-in's continuation's first token
    figures: JSON = {}
    say(
        f"\n{'mode':<9}{'plain ms':>10}{'interrupted':>13}{'paused':>9}{'added ms':>10}"
        f"{'ratio':>8}{'CPU ms plain':>14}{'interrupted':>13}{'+CPU ms':>9}{'ratio':>8}"
        f"{'gateway wait ms':>17}"
    )
    for mode in MODES:
        mine = [p for p in phases if p.mode == mode]
        plain = {p.round: p for p in mine if p.kind == "plain"}
        cut = {p.round: p for p in mine if p.kind == "interrupted"}
        rounds = sorted(plain)
        added = [cut[r].beyond_pause_ms - plain[r].wall_ms - backend_extra_ms for r in rounds]
        # The gateway's own wait (abort read -> the continuation's first chunk) beyond the
        # pause and the stand-in's delay of that chunk (not streamed: the whole rest).
        rest = args.tokens - args.abort_at
        chunk_ms = args.ttft_ms + (0 if mode == "streamed" else (rest - 1) * args.itl_ms)
        waits = [
            1000 * cut[r].waited_s / len(cut[r].answers) - cut[r].paused_ms - chunk_ms
            for r in rounds
        ]
        cpu = [cut[r].cpu_ms - plain[r].cpu_ms for r in rounds]
        row = {
            "latency_ms_plain": statistics.median(plain[r].wall_ms for r in rounds),
            "latency_ms_interrupted": statistics.median(cut[r].wall_ms for r in rounds),
            "paused_ms": statistics.median(cut[r].paused_ms for r in rounds),
            "added_latency_ms": statistics.median(added),
            "added_latency_ratio": statistics.median(
                a / plain[r].wall_ms for a, r in zip(added, rounds, strict=True)
            ),
            "cpu_ms_per_turn_plain": statistics.median(plain[r].cpu_ms for r in rounds),
            "cpu_ms_per_turn_interrupted": statistics.median(cut[r].cpu_ms for r in rounds),
            "cpu_ms_per_resubmission": statistics.median(cpu),
            "cpu_ratio": statistics.median(cut[r].cpu_ms / plain[r].cpu_ms for r in rounds),
            "gateway_wait_beyond_pause_ms": statistics.median(waits),
        }
        say(
            f"{mode:<9}{row['latency_ms_plain']:>10.1f}{row['latency_ms_interrupted']:>13.1f}"
            f"{row['paused_ms']:>9.1f}{row['added_latency_ms']:>10.2f}"
            f"{row['added_latency_ratio']:>8.4f}{row['cpu_ms_per_turn_plain']:>14.2f}"
            f"{row['cpu_ms_per_turn_interrupted']:>13.2f}{row['cpu_ms_per_resubmission']:>9.2f}"
            f"{row['cpu_ratio']:>8.3f}{row['gateway_wait_beyond_pause_ms']:>17.2f}"
        )
        figures |= {f"{mode}_{key}": round(value, 4) for key, value in row.items()}
        figures[f"{mode}_round_added_latency_ms"] = [round(a, 2) for a in added]
        figures[f"{mode}_round_cpu_ms_per_resubmission"] = [round(c, 3) for c in cpu]
    cut_phases = [p for p in phases if p.kind == "interrupted"]
    generated = sum(p.backend_tokens for p in cut_phases)
    recorded = sum(len(p.answers) for p in cut_phases) * len(turns.completion)
    queued = [a.queued for p in cut_phases for a in p.answers]
    metrics = result["metrics"]
    figures |= {
        "tokens_thrown_away": generated - recorded,
        "continuations_queued_during_pause": f"{sum(q == 1 for q in queued)} of {len(queued)}",
        "gateway_interrupted_total": {k: v for k, v in metrics.items() if not k.startswith("wait")},
        "checks": result["checks"],
        "policy_read_ms": round(result["policy_read_ms"], 3),
        "prompt_tokens": result["prompt_tokens"],
    }
    say(
        f"\ntokens thrown away: {figures['tokens_thrown_away']} ({generated} generated by the "
        f"backend in interrupted phases, {recorded} recorded); continuations queued during the "
        f"pause: {figures['continuations_queued_during_pause']}; gateway counters "
        f"{figures['gateway_interrupted_total']}; prompt {figures['prompt_tokens']} tokens; "
        f"a policy-bucket read from here {figures['policy_read_ms']:.3f} ms"
    )
    failed = []
    if figures["tokens_thrown_away"] != 0:
        failed.append("tokens were thrown away")
    sent = turns.count - sum(1 for kind, _ in turns.sent.values() if kind == "plain")
    total = figures["gateway_interrupted_total"]
    if total.get("continued") != sent or total.get("gave_up") or total.get("version_limit"):
        failed.append(f"the gateway's counters {total}, {sent} interrupted turns sent")
    figures["failed"] = failed
    return figures


async def interrupted_main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.compare_with is not None or args.backend_kind != "fixed-latency":
        parser.error("interrupted_turns.py runs one gateway on the fixed-latency backend")
    if args.max_inflight_per_replica is None:
        args.max_inflight_per_replica = 32  # the gateway's default
    if args.abort_at is None:
        args.abort_at = args.tokens // 2
    if not 0 < args.abort_at < args.tokens - 1:
        parser.error("--abort-at must fall inside the answer (0 < k < --tokens - 1)")
    base = QUICK if args.quick else FULL
    plan = Plan(args.rounds or base.rounds, args.turns or base.turns)
    started = time.perf_counter()
    info = harness.gateway_machine_info()
    banner("interrupted turns", args.quick, info)
    say(
        f"turns of {args.tokens} tokens (itl {args.itl_ms:g} ms, first token {args.ttft_ms:g} "
        f"ms), plain vs aborted at token {args.abort_at} and continued after a {args.pause_ms:g} "
        f"ms pause; {plan.turns} turns a phase, {plan.rounds} rounds, streamed and not"
    )
    with tempfile.TemporaryDirectory(prefix="ts-it-", dir=args.store_dir) as tmp:
        result = await bench(args, plan, Path(tmp))
    figures = report(args, result)
    figures["settings"] = {
        "tokens": args.tokens,
        "abort_at": args.abort_at,
        "pause_ms": args.pause_ms,
        "ttft_ms": args.ttft_ms,
        "itl_ms": args.itl_ms,
        "backend_extra_ms": args.ttft_ms - args.itl_ms,
        "version_update": not args.no_version_update,
        "prompt_chars": args.prompt_chars,
        "gateway_tree": str(args.after_tree),
        "rounds": plan.rounds,
        "turns_per_phase": plan.turns,
        "gateway_log_level": args.gateway_log_level or "as shipped",
    }
    finish(figures, quick=args.quick, duration_s=time.perf_counter() - started, info=info)
    if figures["failed"]:
        raise SystemExit(f"checks failed: {'; '.join(figures['failed'])}")


def main() -> None:
    logging.basicConfig(level=logging.ERROR)
    parser = harness.gateway_arguments(__doc__)
    parser.add_argument("--tokens", type=int, default=128, help="tokens an answer (N)")
    parser.add_argument(
        "--abort-at", type=int, default=None, help="the abort's token (k; default N/2)"
    )
    parser.add_argument("--pause-ms", type=float, default=100.0, help="the trainer's pause (P)")
    parser.add_argument(
        "--prompt-chars",
        type=int,
        default=0,
        help="prose added to the user message (~1 token a character): a long prompt's resubmission",
    )
    parser.add_argument(
        "--turns", type=int, default=None, help="turns a phase (default 8; --quick 4)"
    )
    parser.add_argument(
        "--no-version-update",
        action="store_true",
        help="pause and resume without publishing a new version (the update's share of the CPU)",
    )
    parser.set_defaults(ttft_ms=2.0, itl_ms=2.0)
    asyncio.run(interrupted_main(parser, parser.parse_args()))


if __name__ == "__main__":
    main()
