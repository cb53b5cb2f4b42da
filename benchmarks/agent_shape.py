"""Benchmark: gateway CPU per turn as an agent's context grows (also
``gateway_overhead.py --agent-shape``, and part of its default run).

Issue 16, point 4: the cost of a turn should grow with its new tokens, not with its context.
Coding agents' sessions (the trace set the issue cites: median ~99k input tokens, 31 turns,
~460 output tokens a turn) are mostly later turns of a long context, each adding the model's
reply and a tool result. This measures the gateway's CPU per later turn at contexts of ~1k, ~32k
and ~100k tokens, with the first turn's cost beside it (target: 100k <= 1.5x 1k), once with the
tiny model's byte-level tokenizer (a token per byte) and once with a BPE tokenizer of ~4 bytes a
token trained here (``bpe_model``), so that costs proportional to bytes of text show::

    .venv/bin/python benchmarks/gateway_overhead.py --agent-shape           # ~30 s
    .venv/bin/python benchmarks/gateway_overhead.py --agent-shape --quick   # ~20 s

* Per tokenizer, one stack (``api_surfaces.fixed_latency_stack``: nats-server, the fixed-latency
  backend, one gateway; ``--max-context`` 262144). The backend answers every request with ~460
  tokens: a text of ~440 tokens, then on a line of its own (as the template writes a reply, so
  that its render is what was sampled) the Bash tool call of ``--api-surfaces``, then the end of
  turn. Chat Completions with ``X-Session-Id`` and one small ``Bash`` tool, not streamed.
* A session: a system message and a first user message of ``C`` tokens' worth of source text
  (the repository's own ``.py`` files), C = 1k, 32k, 100k; its first turn, then ``later`` turns,
  each appending the reply as the gateway returned it (text and tool call) and a ~300-character
  tool result, as an agent does.
* Per round, one phase per context, the order reversed every other round; a phase runs
  ``sessions`` whole sessions one request at a time. The gateway's CPU (all its threads' on-CPU
  time, ``/proc/PID/task/*/schedstat``, in ns) is read before and after every request: its first
  turns and its later turns are summed apart.
  ``later_turn_ratio_100k_to_1k``: the median over rounds of the phase's CPU per later turn at
  100k over the same round's at 1k.
* ``--after-tree DIR``: the gateway runs that checkout's code (e.g. ``git archive HEAD`` unpacked
  somewhere: today's figures before a change), as in ``--compare-with``.
* Checked at the end, from EVENTS: every later turn has its previous turn as ``parent_turn`` and
  that turn's whole context as ``prefix_len`` (continued token-exact, no fork).

Today (2026-11-28 11:59-12:01, the 2-core VM with nothing else running, commit 794ba96, full,
three runs alternating with the code before it): CPU per later turn 4.39-4.77 / 4.51-4.96 /
4.96-6.00 ms at 1k / 32k / 100k (tiny tokenizer, ratio 1.17-1.31), 4.73-5.33 / 5.29-5.96 /
6.21-6.82 ms (BPE, ratio 1.29-1.42, against 1.54-1.62 before it); first turn at 100k 89-122 ms
(tiny), 248-300 ms (BPE). ``kept_bodies``: the gateway's count of bodies of 64 KiB or more by how
it decoded them (every later turn at 32k and 100k "reused"). docs/PERFORMANCE.md, section 4, has
the history.

Keys: ``cpu_ms_per_later_turn_ctx_{1k,32k,100k}``, ``cpu_ms_first_turn_ctx_{1k,32k,100k}``,
``later_turn_ratio_100k_to_1k``, the same with ``_bpe`` for the BPE tokenizer, and
``bytes_per_token`` of each.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import harness
import httpx
from harness import (
    REPLY_TEXT,
    ChatSurface,
    ClaudeCodeShape,
    banner,
    dumps,
    finish,
    fixed_latency_stack,
    run_gateway_mode,
    say,
    tool_output,
)

from eventlog import read_session

JSON = dict[str, Any]

CONTEXTS = {"1k": 1_000, "32k": 32_000, "100k": 100_000}  # tokens of the first prompt
OUTPUT_TOKENS = 460
MAX_CONTEXT = 262_144
TARGET_RATIO = 1.5
BPE_VOCAB = 16_384
BASH = {
    "name": "Bash",
    "description": "Run a shell command and return what it printed.",
    "input_schema": {
        "type": "object",
        "properties": {"command": {"type": "string", "description": "the command"}},
        "required": ["command"],
    },
}
SYSTEM = "You are a coding agent. Use the Bash tool to look at files; answer briefly."


@dataclass(frozen=True)
class AgentPlan:
    rounds: int  # even: the order of the contexts is reversed in every other round
    sessions: int  # per phase
    later: int  # later turns per session


FULL = AgentPlan(rounds=4, sessions=2, later=6)
QUICK = AgentPlan(rounds=2, sessions=1, later=5)


# -- the tokenizers -------------------------------------------------------------------------------


def source_text() -> str:
    """The repository's own Python source: what an agent reads into its context."""
    roots = ("gateway", "schemas", "eventlog", "turnstream", "consumers", "trainer_sink")
    files = sorted(p for root in roots for p in (harness.REPO / root).rglob("*.py"))
    return "".join(p.read_text(errors="replace") for p in files)


def bpe_model(cache: Path, tiny_dir: Path) -> Path:
    """A model directory whose tokenizer is a byte-level BPE of BPE_VOCAB tokens trained on the
    repository's source (~4 bytes a token on it) with the tiny model's chat template, special
    and tool-call tokens, and end-of-turn ids: what the gateway needs to serve it against a
    remote backend. Made once under ``cache`` (a few seconds)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from gateway.model.tiny import (
        CHATML_TOOLS_TEMPLATE,
        ENDOFTEXT,
        IM_END,
        IM_START,
        TOOL_CALL_END,
        TOOL_CALL_START,
    )

    target = cache / f"bpe-{BPE_VOCAB}-chatml-v1"
    if (target / "generation_config.json").is_file():
        return target
    staging = Path(tempfile.mkdtemp(prefix=".bpe-", dir=cache))
    try:
        core = Tokenizer(models.BPE())
        core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        core.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=BPE_VOCAB,
            special_tokens=[ENDOFTEXT, IM_START, IM_END],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        text = source_text()
        core.train_from_iterator((text[i : i + 4096] for i in range(0, len(text), 4096)), trainer)
        core.add_tokens(
            [
                AddedToken(t, special=False, normalized=False)
                for t in (TOOL_CALL_START, TOOL_CALL_END)
            ]
        )
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=core, eos_token=IM_END, pad_token=ENDOFTEXT
        )
        tokenizer.chat_template = CHATML_TOOLS_TEMPLATE
        tokenizer.save_pretrained(staging)
        ends = [tokenizer.convert_tokens_to_ids(t) for t in (IM_END, ENDOFTEXT)]
        generation = json.loads((tiny_dir / "generation_config.json").read_text())
        generation.update(bos_token_id=ends[1], eos_token_id=ends, pad_token_id=ends[1])
        (staging / "generation_config.json").write_text(json.dumps(generation))
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


@dataclass(frozen=True)
class Tokenized:
    """One tokenizer's side of the run: its model directory and what it makes of the shape."""

    name: str  # "tiny" or "bpe"
    model_dir: Path
    completion: list[int]  # the backend's reply
    users: dict[str, str]  # per context: the first user message
    bytes_per_token: float


def tokenized(name: str, model_dir: Path) -> Tokenized:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.model_max_length = MAX_CONTEXT

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    source = source_text()
    sample = source[:200_000]
    per_token = len(sample.encode()) / count(sample)
    # A reply of OUTPUT_TOKENS: words before the tool call, then the end of turn.
    words = "Let me look at the files of the project first, then decide what to change. "
    call = count(REPLY_TEXT)
    # The text and the call on lines of their own, as the template writes an assistant message
    # (and a model trained on it answers): the gateway's render of the reply is what it sampled.
    call += count("\n")
    prose = ""
    while count(prose) + call + 1 < OUTPUT_TOKENS:
        prose += words
    while count(prose.rstrip()) + call + 1 > OUTPUT_TOKENS:
        prose = prose[:-1]
    completion = [
        *tokenizer.encode(prose.rstrip() + "\n" + REPLY_TEXT, add_special_tokens=False),
        int(tokenizer.eos_token_id),
    ]
    users: dict[str, str] = {}
    for label, tokens in CONTEXTS.items():
        chars = int(tokens * per_token)
        text = (source * (chars // len(source) + 1))[:chars]
        # Trimmed so that the whole first prompt is about ``tokens`` long.
        overhead_tokens = count(SYSTEM) + count(json.dumps(BASH)) + 40
        cut = int(overhead_tokens * per_token)
        users[label] = "Read this and fix the bug:\n" + text[: max(0, len(text) - cut)]
    return Tokenized(name, model_dir, completion, users, per_token)


# -- the load -------------------------------------------------------------------------------------


@dataclass
class Session:
    sid: str
    history: list[bytes]
    turns: list[str] = field(default_factory=list)  # the replies' ids (TurnCompleted.reply)
    prompt_tokens: list[int] = field(default_factory=list)


@dataclass
class Phase:
    context: str
    round: int
    first_cpu_s: float = 0.0
    first_turns: int = 0
    later_cpu_s: float = 0.0
    later_turns: int = 0
    later_prompt_tokens: list[int] = field(default_factory=list)

    def later_ms(self) -> float:
        return 1000 * self.later_cpu_s / self.later_turns


class AgentLoad:
    def __init__(self, tok: Tokenized, url: str) -> None:
        shape = ClaudeCodeShape(system=(SYSTEM,), tools=(BASH,), user=("",))
        self.surface = ChatSurface(shape, tok.model_dir.name)
        self.tok = tok
        self.url = url + self.surface.path
        self.head = self.surface.head(False)
        self.sessions: list[Session] = []

    def open(self, sid: str, context: str) -> Session:
        system = {"role": "system", "content": SYSTEM}
        user = {"role": "user", "content": self.tok.users[context]}
        session = Session(sid, [dumps(system), dumps(user)])
        self.sessions.append(session)
        return session

    async def turn(self, client: httpx.AsyncClient, session: Session) -> None:
        body = self.head + b"[" + b",".join(session.history) + b"]}"
        headers = {"X-Session-Id": session.sid, "content-type": "application/json"}
        response = await client.post(self.url, content=body, headers=headers)
        if response.status_code != 200:
            raise RuntimeError(
                f"session {session.sid}: HTTP {response.status_code}: {response.text[:600]}"
            )
        answer = response.json()
        reply = self.surface.reply(answer)
        session.turns.append(harness.reply_of(answer["id"]))
        session.prompt_tokens.append(int(answer["usage"]["prompt_tokens"]))
        if answer["usage"]["completion_tokens"] != len(self.tok.completion):
            raise RuntimeError(f"session {session.sid}: {answer['usage']} (a reply cut short?)")
        session.history += [dumps(item) for item in reply.echo]
        result = self.surface.tool_result(reply.call_id, tool_output(len(session.turns)))
        session.history += [dumps(item) for item in result]


def cpu_ns(pid: int) -> int:
    """On-CPU time of all of a process's threads in ns (``/proc/PID/task/*/schedstat``): the
    10 ms ticks of ``/proc/PID/stat`` are too coarse to split one request's CPU from the next.
    (A thread that ended takes its time with it; the gateway's worker threads stay.)"""
    total = 0
    for task in os.scandir(f"/proc/{pid}/task"):
        # A thread that ended just now is skipped.
        with contextlib.suppress(OSError), open(f"{task.path}/schedstat") as f:
            total += int(f.read().split()[0])
    return total


async def run_phase(
    load: AgentLoad,
    client: httpx.AsyncClient,
    procs: harness.Procs,
    plan: AgentPlan,
    context: str,
    rnd: int,
    *,
    profiled: bool = False,
) -> Phase:
    """``plan.sessions`` sessions of this context, one request at a time; with ``profiled``,
    the gateway's profiler runs during the later turns (``--profile-gateway``)."""
    phase = Phase(context, rnd)
    pid = procs.gateway.pid
    for k in range(plan.sessions):
        session = load.open(f"agent-{load.tok.name}-{context}-r{rnd}-s{k}", context)
        for t in range(1 + plan.later):
            if profiled and t == 1:
                procs.toggle_profile()  # on for the later turns
            before = cpu_ns(pid)
            await load.turn(client, session)
            spent = (cpu_ns(pid) - before) / 1e9
            if profiled and t == plan.later:
                procs.toggle_profile()
            if t == 0:
                phase.first_cpu_s += spent
                phase.first_turns += 1
            else:
                phase.later_cpu_s += spent
                phase.later_turns += 1
                phase.later_prompt_tokens.append(session.prompt_tokens[-1])
    return phase


async def check(js: Any, load: AgentLoad) -> int:
    """Every later turn continues its session's previous turn, its whole context."""
    from schemas.events import TurnCompleted

    checked = 0
    for session in load.sessions:
        events = await read_session(js, harness.RUN, session.sid, stream=harness.STREAM)
        by_reply = {e.reply: e for e in events if isinstance(e, TurnCompleted)}
        indices = [by_reply[reply].turn for reply in session.turns]
        turns = {e.turn: e for e in by_reply.values()}
        for previous, index in itertools.pairwise(indices):
            event, parent = turns[index], turns[previous]
            whole = parent.prefix_len + len(parent.prompt_ids) + len(parent.completion_ids)
            if event.parent_turn != previous or event.prefix_len != whole:
                raise RuntimeError(
                    f"session {session.sid}: turn {index} has parent_turn {event.parent_turn} "
                    f"and prefix_len {event.prefix_len}; expected {previous} and {whole}"
                )
            checked += 1
    return checked


async def bench_tokenizer(
    args: argparse.Namespace, plan: AgentPlan, tok: Tokenized, tmp: Path
) -> JSON:
    name = f"gateway-bench-agent-{tok.name}"
    tree = None if args.after_tree == harness.REPO else args.after_tree
    async with fixed_latency_stack(
        args,
        tmp,
        MAX_CONTEXT,
        name,
        model_dir=tok.model_dir,
        completion=tok.completion,
        source_tree=tree,
    ) as stack:
        load = AgentLoad(tok, stack.gateway_url)
        phases: list[Phase] = []
        labels = list(CONTEXTS)
        async with httpx.AsyncClient(timeout=300.0) as client:
            warm = load.open(f"agent-{tok.name}-warm", "32k")
            for _ in range(3):
                await load.turn(client, warm)
            gc.collect()
            for rnd in range(plan.rounds):
                order = labels if rnd % 2 == 0 else labels[::-1]
                line = []
                profiled = bool(args.profile_gateway) and rnd % 2 == 1
                for context in order:
                    phase = await run_phase(
                        load, client, stack.procs, plan, context, rnd, profiled=profiled
                    )
                    phases.append(phase)
                    line.append(
                        f"{context:>4}: first {1000 * phase.first_cpu_s / phase.first_turns:6.1f}"
                        f" later {phase.later_ms():5.2f} ms"
                    )
                say(f"  {tok.name} round {rnd + 1}/{plan.rounds}: " + " | ".join(line))
            kept = await kept_bodies(client, stack.gateway_url)
        checked = await check(stack.js, load)
        say(f"  checked: {checked} later turns continue their previous turn token-exact")
        say(f"  bodies of 64 KiB or more, by how the gateway decoded them: {kept}")
    out = report(tok, phases, checked)
    out["kept_bodies"] = kept
    if args.profile_gateway:  # written when the gateway stopped, at the end of the stack
        profiled = [p for p in phases if p.round % 2 == 1]
        plain = [p for p in phases if p.round % 2 == 0]
        out["profile"] = harness.print_profile(
            args.profile_gateway,
            args.profile_top,
            sum(p.later_turns for p in profiled),
            1000 * sum(p.later_cpu_s for p in plain) / sum(p.later_turns for p in plain),
        )
    return out


async def kept_bodies(client: httpx.AsyncClient, url: str) -> dict[str, int]:
    """The gateway's count of large bodies by how they were decoded: "reused" (only what
    follows the messages they resend) or "full" (gateway.http.kept_bodies); {} before it."""
    counts = {}
    for line in (await client.get(f"{url}/metrics")).text.splitlines():
        if line.startswith("turnstream_gateway_kept_bodies_total{"):
            how = line.split('"')[1]
            counts[how] = int(float(line.split()[-1]))
    return counts


def report(tok: Tokenized, phases: list[Phase], checked: int) -> JSON:
    suffix = "" if tok.name == "tiny" else f"_{tok.name}"
    figures: JSON = {}
    rows = []
    by_round = {(p.context, p.round): p for p in phases}
    for context in CONTEXTS:
        mine = [p for p in phases if p.context == context]
        later = 1000 * sum(p.later_cpu_s for p in mine) / sum(p.later_turns for p in mine)
        first = 1000 * sum(p.first_cpu_s for p in mine) / sum(p.first_turns for p in mine)
        ratios = [p.later_ms() / by_round[("1k", p.round)].later_ms() for p in mine]
        tokens = round(statistics.mean(t for p in mine for t in p.later_prompt_tokens))
        figures[f"cpu_ms_per_later_turn_ctx_{context}{suffix}"] = round(later, 3)
        figures[f"cpu_ms_first_turn_ctx_{context}{suffix}"] = round(first, 3)
        rows.append(
            {
                "context": context,
                "cpu_ms_per_later_turn": round(later, 3),
                "cpu_ms_first_turn": round(first, 3),
                "ratio_to_1k": round(statistics.median(ratios), 3),
                "round_ratios_to_1k": [round(r, 3) for r in ratios],
                "mean_later_prompt_tokens": tokens,
                "later_turns": sum(p.later_turns for p in mine),
            }
        )
        say(
            f"  {tok.name:>4} {context:>5}{later:>12.2f}{first:>12.1f}"
            f"{statistics.median(ratios):>9.3f}{tokens:>14,}  "
            + " ".join(f"{r:.2f}" for r in ratios)
        )
    figures[f"later_turn_ratio_100k_to_1k{suffix}"] = rows[-1]["ratio_to_1k"]
    figures[f"bytes_per_token{suffix}"] = round(tok.bytes_per_token, 2)
    return {"figures": figures, "rows": rows, "checked_later_turns": checked}


async def agent_shape_figures(args: argparse.Namespace) -> JSON:
    """The issue keys of both tokenizers (and their rows); for the default run as well."""
    from gateway.model import ensure_tiny_model

    plan = QUICK if args.quick else FULL
    if args.rounds:
        plan = AgentPlan(args.rounds, plan.sessions, plan.later)
    cache = Path(args.model_cache)
    tiny = ensure_tiny_model(cache)
    t0 = time.perf_counter()
    bpe = bpe_model(cache, tiny)
    say(f"BPE tokenizer ready in {time.perf_counter() - t0:.1f} s ({bpe})")
    figures: JSON = {}
    rows: JSON = {}
    say(
        f"\n  {'tok':>4} {'ctx':>5}{'later ms':>12}{'first ms':>12}{'vs 1k':>9}"
        f"{'later tokens':>14}  vs 1k per round"
    )
    for name, model_dir in (("tiny", tiny), ("bpe", bpe)):
        tok = tokenized(name, model_dir)
        profile = args.profile_gateway
        if profile is not None:  # one profile per tokenizer: FILE and FILE's stem + "_bpe"
            profile = profile if name == "tiny" else profile.with_stem(profile.stem + "_bpe")
        args = argparse.Namespace(**{**vars(args), "profile_gateway": profile})
        say(
            f"{name}: {tok.bytes_per_token:.2f} bytes a token, reply {len(tok.completion)} "
            f"tokens; {plan.rounds} rounds of {plan.sessions} sessions x (1 + {plan.later}) "
            "turns per context"
        )
        with tempfile.TemporaryDirectory(prefix="ts-gwagent-", dir=args.store_dir) as tmp:
            out = await bench_tokenizer(args, plan, tok, Path(tmp))
        figures.update(out["figures"])
        rows[name] = {
            key: out[key] for key in ("rows", "checked_later_turns", "profile") if key in out
        }
    for suffix in ("", "_bpe"):
        ratio = figures[f"later_turn_ratio_100k_to_1k{suffix}"]
        say(
            f"target{suffix or ' (tiny)'}: later turn at 100k / 1k = {ratio:.3f} "
            f"(<= {TARGET_RATIO}): {'met' if ratio <= TARGET_RATIO else 'NOT met'}"
        )
    figures["agent_shape"] = {
        "rows": rows,
        "settings": {
            "contexts": CONTEXTS,
            "output_tokens": OUTPUT_TOKENS,
            "rounds": plan.rounds,
            "sessions_per_phase": plan.sessions,
            "later_turns_per_session": plan.later,
            "max_context": MAX_CONTEXT,
            "bpe_vocab": BPE_VOCAB,
            "ttft_ms": args.ttft_ms,
        },
    }
    return figures


async def agent_shape_main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.compare_with is not None or args.backend_kind != "fixed-latency":
        parser.error("--agent-shape runs one gateway on the fixed-latency backend")
    started = time.perf_counter()
    info = harness.gateway_machine_info()
    banner("gateway CPU per turn at agent contexts (1k, 32k, 100k tokens)", args.quick, info)
    if args.max_inflight_per_replica is None:
        args.max_inflight_per_replica = 1
    if args.profile_gateway and (args.rounds or 2) < 2:
        parser.error("--profile-gateway profiles odd rounds and needs at least 2")
    figures = await agent_shape_figures(args)
    finish(figures, quick=args.quick, duration_s=time.perf_counter() - started, info=info)


if __name__ == "__main__":
    run_gateway_mode(__doc__, agent_shape_main)
