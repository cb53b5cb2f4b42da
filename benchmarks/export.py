"""Benchmark: ``turnstream export`` throughput, rows/s and tokens/s, for both kinds and formats.

Run it from the repository root::

    .venv/bin/python benchmarks/export.py           # full run, 10,000 trajectories
    .venv/bin/python benchmarks/export.py --quick   # 4,000 trajectories, ~1.5 minutes

What it measures
----------------
Seeded synthetic agent trajectories in real shards: each a tool-using conversation (a system
prompt, a task of 100-600 characters, then 1-6 turns: the assistant writes 20-300 characters and,
in 80% of turns, a tool call with JSON arguments answered by a tool result of 50-800 characters;
otherwise a user message follows; the last turn is a reply) with the 4 tool schemas of
``benchmarks/storage.py``. ``input_ids`` are the conversation rendered by the built-in tiny
model's chat template (the gateway's ``ChatTemplate``; a byte-level tokenizer, so one token per
byte) and encoded, ending with the ``<|im_end|>`` the model sampled, so every row round-trips by
construction; ``logprobs``, ``versions``, rewards are random. 1,000 distinct conversations are
rendered (that is the slow part of making the data) and the trajectories cycle through them, each
with its own ids, reward and logprobs. They are written as shards of 2,000 rows with
``FileShardStore`` (the shard writer's own path; no NATS needed).

Then ``turnstream.data.export.export_run`` (what ``turnstream export`` runs, in process, no
progress bar) exports the run into a fresh directory, once per case, timed whole (shard scan
through DuckDB, conversion, writing, manifest, rename):

* ``tokens`` and ``messages`` (no fidelity check) × ``parquet`` and ``jsonl``;
* ``tokens`` / ``parquet`` with ``--where "reward > 0 and num_turns >= 3"``;
* ``messages`` / ``parquet`` with the fidelity check (each row rendered again with the chat
  template and compared token for token), on the first 2,000 rows (``--where "traj_seq <=
  2000"``: rendering is by far the slowest step); it must report every row as round-tripping,
  or the benchmark exits 1.

``rows/s`` = rows exported / seconds; ``tokens/s`` = the exported rows' ``input_ids`` / seconds
(the messages kind holds no token column, but it is the same samples); ``MB`` = the output's size.

Reading the output: one line per case, then the LAST line: one JSON object with every case's
figures, the machine and the date.

Today's figures (2026-11-25, the 2-core VM shared with other work), rows/s of two full runs
(10,000 rows) 25 minutes apart, the second at load ~10: tokens_parquet 808 / 549 (2.9 M /
2.0 M tokens/s), tokens_jsonl 322 / 231, tokens_parquet_where 375 / 134, messages_parquet
1,000 / 492, messages_jsonl 946 / 625, messages_parquet_where_fidelity 69 / 25. The per-case
times of a 1,000-row and a 10,000-row run fit time = a + b x rows with a = 0.6-2.2 s, so at
4,000 rows (``--quick``) the fixed part moves the rates by 15% at most; the one quick run of
the new size ran at load 13-15 and was 0.45-1.04 of the full run beside it.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from harness.reporting import arguments, banner, finish, machine_info, say
from harness.synthetic_sessions import TOOLS

from gateway.model import ensure_tiny_model
from schemas.events import JSON, TrajectoryReady
from schemas.shards import ShardMetadata, trajectories_to_table
from shardstore import FileShardStore
from turnstream.data.export import FidelityCheck, TemplateRenderer, export_run, load_renderer

RUN = "bench"
SHARD_ROWS = 2_000
WHERE = "reward > 0 and num_turns >= 3"
DISTINCT = 1_000  # conversations rendered; the trajectories cycle through them
FIDELITY_ROWS = 2_000  # rows the fidelity case checks (it renders each one again)
FULL_COUNT = 10_000
# Large enough that an export's fixed costs (DuckDB's plan, the output's setup: ~0.5-2 s) do
# not move the rates by more than ~20%; the fidelity case checks FIDELITY_ROWS in both modes.
QUICK_COUNT = 4_000


class Maker:
    """Seeded trajectories whose tokens are their conversation rendered by the template."""

    def __init__(self, rng: np.random.Generator, renderer: TemplateRenderer) -> None:
        self.rng = rng
        self.template = renderer.template
        words = [
            "".join(rng.choice(list("abcdefghij"), int(rng.integers(2, 9)))) for _ in range(500)
        ]
        self.corpus = " ".join(rng.choice(words, 50_000).tolist())
        self.newline = self.template.encode("\n")
        self._rendered: dict[int, tuple[list[JSON], int, np.ndarray]] = {}

    def text(self, low: int, high: int) -> str:
        n = int(self.rng.integers(low, high + 1))
        start = int(self.rng.integers(0, len(self.corpus) - n))
        return self.corpus[start : start + n].strip() or "ok"

    def conversation(self, index: int) -> tuple[list[JSON], int]:
        rng = self.rng
        messages: list[JSON] = [
            {"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": self.text(100, 600)},
        ]
        turns = int(rng.integers(1, 7))
        for t in range(turns):
            calls = t < turns - 1 and rng.random() < 0.8
            if calls:
                tool = TOOLS[int(rng.integers(0, len(TOOLS)))]["function"]
                [arg] = tool["parameters"]["properties"]
                call = {
                    "id": f"call_{index}_{t}",
                    "type": "function",
                    "function": {
                        "name": tool["name"],
                        "arguments": json.dumps({arg: self.text(10, 60)}),
                    },
                }
                messages.append(
                    {"role": "assistant", "content": self.text(20, 300), "tool_calls": [call]}
                )
                messages.append(
                    {"role": "tool", "tool_call_id": call["id"], "content": self.text(50, 800)}
                )
            else:
                messages.append({"role": "assistant", "content": self.text(20, 300)})
                if t < turns - 1:
                    messages.append({"role": "user", "content": self.text(20, 200)})
        return messages, turns

    def rendered(self, index: int) -> tuple[list[JSON], int, np.ndarray]:
        """Conversation ``index % DISTINCT``: rendering is the slow part of making the data."""
        key = index % DISTINCT
        if key not in self._rendered:
            messages, turns = self.conversation(key)
            ids = self.template.encode(self.template.render(messages, TOOLS, generation=False))
            assert ids[-1:] == self.newline, "ChatML closes a turn with <|im_end|> and a newline"
            # the sample ends on the <|im_end|> the model sampled
            self._rendered[key] = (messages, turns, np.asarray(ids[:-1], dtype=np.int32))
        return self._rendered[key]

    def trajectory(self, index: int) -> TrajectoryReady:
        rng = self.rng
        messages, turns, ids = self.rendered(index)
        n = len(ids)
        prompt_len = n // 3
        mask = np.zeros(n, dtype=np.int8)
        mask[prompt_len:] = 1
        logprobs = np.where(mask == 1, -rng.random(n, dtype=np.float32), 0).astype(np.float32)
        return TrajectoryReady(
            run=RUN,
            session=f"s{index}",
            trajectory_id=f"{RUN}/s{index}/0",
            group=f"g{index // 8}",
            segment=0,
            status="completed",
            input_ids=ids,
            loss_mask=mask,
            logprobs=logprobs,
            versions=np.where(mask == 1, 3, -1).astype(np.int32),
            prompt_len=prompt_len,
            turn_ends=np.linspace(prompt_len, n, turns + 1, dtype=np.int32)[1:],
            turn_rewards=[None] * turns,
            reward=float(rng.integers(0, 2)),
            num_turns=turns,
            finish_reason="stop",
            messages=messages,
            tools=TOOLS,
            metadata={"task": f"task-{index}", "forks": 0},
            fold_version=3,
            created_at=1_700_000_000.0 + index,
        )


def write_shards(root: Path, maker: Maker, count: int) -> int:
    """``count`` trajectories as shards of SHARD_ROWS rows; their total tokens."""
    store = FileShardStore(str(root))
    tokens = 0
    for first in range(0, count, SHARD_ROWS):
        items = [(i + 1, maker.trajectory(i)) for i in range(first, min(first + SHARD_ROWS, count))]
        tokens += sum(len(t.input_ids) for _, t in items)
        meta = ShardMetadata(
            run=RUN,
            stream="TRAJ",
            stream_created="bench",
            first_seq=items[0][0],
            last_seq=items[-1][0],
            rows=len(items),
            fold_versions=(3,),
        )
        store.write(trajectories_to_table(items, meta), meta)
    return tokens


def size_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 1e6  # data/ too


def main() -> int:
    parser = arguments(__doc__, "4,000 trajectories instead of 10,000", seed="seed of the data")
    args = parser.parse_args()
    count = QUICK_COUNT if args.quick else FULL_COUNT
    started = time.perf_counter()
    info = machine_info("duckdb", "pyarrow", "msgspec")
    banner(
        "export", args.quick, info, versions=f"duckdb {info['duckdb']}, pyarrow {info['pyarrow']}"
    )
    work = Path(tempfile.mkdtemp(prefix="turnstream-export-bench-"))
    try:
        model_dir = ensure_tiny_model(work / "models")
        renderer = load_renderer(model_dir)
        t0 = time.perf_counter()
        tokens = write_shards(
            work / "shards", Maker(np.random.default_rng(args.seed), renderer), count
        )
        shard_mb = sum(p.stat().st_size for p in (work / "shards").rglob("*.parquet")) / 1e6
        say(
            f"{count:,} trajectories, {tokens:,} tokens ({tokens / count:,.0f} per row), "
            f"{shard_mb:.1f} MB of shards, made in {time.perf_counter() - t0:.1f} s"
        )
        cases: list[tuple[str, str, str | None, bool]] = [
            ("tokens", "parquet", None, False),
            ("tokens", "jsonl", None, False),
            ("tokens", "parquet", WHERE, False),
            ("messages", "parquet", None, False),
            ("messages", "jsonl", None, False),
            ("messages", "parquet", f"traj_seq <= {FIDELITY_ROWS}", True),
        ]
        figures: dict[str, Any] = {
            "trajectories": count,
            "tokens": tokens,
            "shard_mb": round(shard_mb, 1),
        }
        # Untimed warm-up: DuckDB's import and first connection are paid once, not by case 1.
        export_run(
            str(work / "shards"), RUN, work / "warm-up", kind="tokens", format="parquet",
            where="traj_seq <= 100", fidelity=FidelityCheck(skipped="benchmark"), progress=False,
        )  # fmt: skip
        shutil.rmtree(work / "warm-up")
        say(f"\n  {'case':<34} {'rows':>7} {'s':>7} {'rows/s':>9} {'tokens/s':>12} {'MB':>8}")
        for kind, fmt, where, check in cases:
            out = work / "out"
            fidelity = (
                FidelityCheck(renderer=renderer, tokenizer=str(model_dir))
                if check
                else FidelityCheck(skipped="benchmark")
            )
            t0 = time.perf_counter()
            manifest = export_run(
                str(work / "shards"), RUN, out, kind=kind, format=fmt, where=where,  # type: ignore[arg-type]
                fidelity=fidelity, progress=False,
            )  # fmt: skip
            seconds = time.perf_counter() - t0
            name = f"{kind}_{fmt}" + ("_where" if where else "") + ("_fidelity" if check else "")
            rows, exported_tokens = manifest["rows"], manifest["tokens"]
            figures[name] = {
                "rows": rows,
                "seconds": round(seconds, 2),
                "rows_per_s": round(rows / seconds),
                "tokens_per_s": round(exported_tokens / seconds),
                "output_mb": round(size_mb(out), 1),
            }
            say(
                f"  {name:<34} {rows:>7,} {seconds:>7.2f} {rows / seconds:>9,.0f} "
                f"{exported_tokens / seconds:>12,.0f} {size_mb(out):>8.1f}"
            )
            if check and manifest["fidelity"]["round_trips"] != rows:
                say(f"FIDELITY CHECK FAILED: {json.dumps(manifest['fidelity'])[:2000]}")
                return 1
            shutil.rmtree(out)
        say("fidelity check: every row round-trips through the chat template")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    finish(figures, quick=args.quick, duration_s=time.perf_counter() - started, info=info)
    return 0


if __name__ == "__main__":
    sys.exit(main())
