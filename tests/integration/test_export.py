"""``turnstream export`` (issue 11, point 4) as a real process over real shards.

Both kinds, both formats, with and without ``--where``, loaded back with Hugging Face
``datasets``, polars and DuckDB; the errors a user meets (a bad predicate, an unknown run, an
output in the way, a damaged shard) as one clear line and no half dataset. The chat-template
round trip and TRL's ``SFTTrainer`` are tested on sessions served by a real ``turnstream up``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import datasets
import duckdb
import httpx
import msgspec
import numpy as np
import openai
import pandas as pd
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from consumers.export import convert_messages
from consumers.export_layout import data_files
from schemas.events import TrajectoryReady
from schemas.shards import ShardMetadata, trajectories_to_table
from shardstore import FileShardStore
from tests.helpers.agent_sessions import claude_code_session
from tests.helpers.services import shard_table_rows
from tests.helpers.tiny_model import WEATHER_QUESTION, WEATHER_RESULT, WEATHER_TOOLS
from tests.helpers.trajectories import folded
from tests.helpers.up_process import UpProcess
from tests.helpers.waiting import wait_for

pytestmark = pytest.mark.integration

JSON = dict[str, Any]
RUN = "r1"
WHERE = "reward > 0 and num_turns >= 3"
SEARCH_TOOL: JSON = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}, "n": {}}},
    },
}


def export(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "turnstream.cli", "export", *args],
        capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "COLUMNS": "400"},
    )  # fmt: skip


def _trajectories() -> list[TrajectoryReady]:
    samples = [
        folded(
            RUN, f"s{i}", turns=1 + i % 4, group=f"g{i // 4}",
            final_reward=None if i % 3 == 0 else float(i % 2),
        )
        for i in range(12)
    ]  # fmt: skip
    tooled = msgspec.structs.replace(
        folded(RUN, "tooled", turns=3, final_reward=2.0),
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Weather "},
                                         {"type": "text", "text": "in Paris, é?"}]},
            {"role": "assistant", "content": None, "reasoning_content": "…", "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": WEATHER_RESULT},
            {"role": "assistant", "content": "Sunny, 18°C."},
        ],
        tools=[*WEATHER_TOOLS, SEARCH_TOOL],
    )  # fmt: skip
    return [*samples, tooled]


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[TrajectoryReady]]:
    """Run r1 in two shards, run r2 in one: 13 + 3 trajectories."""
    root = tmp_path_factory.mktemp("data") / "shards"
    store = FileShardStore(str(root))
    mine = _trajectories()
    other = [folded("r2", f"o{i}") for i in range(3)]
    seqs = iter(range(1, 100))
    for run, rows in ((RUN, mine[:7]), (RUN, mine[7:]), ("r2", other)):
        items = [(next(seqs), t) for t in rows]
        meta = ShardMetadata(
            run=run, stream="TRAJ", stream_created="t", first_seq=items[0][0],
            last_seq=items[-1][0], rows=len(items), fold_versions=(items[0][1].fold_version,),
        )  # fmt: skip
        store.write(trajectories_to_table(items, meta), meta)
    return root, mine


def _load_hf(out: Path, cache: Path) -> list[JSON]:
    """The directory, as the README loads it: its dataset card names the parts under data/ and
    gives the types (from JSON Lines files alone ``datasets`` infers them from the first rows,
    and a column null there, such as tool_calls, cannot take the values of a later part)."""
    return list(datasets.load_dataset(str(out), split="train", cache_dir=str(cache)))


def _load_polars(out: Path, format: str) -> pl.DataFrame:
    if format == "parquet":
        return pl.read_parquet(out / "data" / "*.parquet")
    # polars takes the first file's types for all: one file at a time (the card says to_polars)
    files = sorted((out / "data").glob("*.jsonl"))
    return pl.concat([pl.read_ndjson(f) for f in files], how="diagonal_relaxed")


def _load_duckdb(out: Path, format: str) -> duckdb.DuckDBPyRelation:
    reader = "read_parquet" if format == "parquet" else "read_json_auto"
    return duckdb.sql(f"select * from {reader}('{out}/data/*.{format}')")


@pytest.mark.parametrize("where", [None, WHERE])
@pytest.mark.parametrize("format", ["parquet", "jsonl"])
@pytest.mark.parametrize("kind", ["tokens", "messages"])
def test_an_export_loads_back_in_datasets_polars_and_duckdb(
    shards: tuple[Path, list[TrajectoryReady]],
    tmp_path: Path,
    kind: str,
    format: str,
    where: str | None,
) -> None:
    root, trajectories = shards
    out = tmp_path / "out"
    done = export(
        "--data-dir", str(root.parent), "--run", RUN, "--kind", kind, "--format", format,
        "-o", str(out), *(["--where", where] if where else []), "--rows-per-part", "4",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr

    def selected(t: TrajectoryReady) -> bool:
        return where is None or (t.reward is not None and t.reward > 0 and t.num_turns >= 3)

    expected = {t.trajectory_id: t for t in trajectories if selected(t)}
    assert 0 < len(expected) < len(trajectories) or where is None
    manifest = json.loads((out / "manifest.json").read_text())
    assert (manifest["run"], manifest["kind"], manifest["format"]) == (RUN, kind, format)
    assert manifest["where"] == where and manifest["rows"] == len(expected)
    assert manifest["tokens"] == sum(len(t.input_ids) for t in expected.values())
    assert [p["rows"] for p in manifest["parts"]] == [
        min(4, len(expected) - i) for i in range(0, len(expected), 4)
    ]
    assert [s["first_seq"] for s in manifest["source"]["shards"]] == [1, 8]  # r1's, not r2's
    assert f"exported {len(expected)} trajectories" in done.stderr
    assert f"in {out / 'data'}, its card and manifest beside" in done.stderr

    assert [p["file"] for p in manifest["parts"]] == [
        f"data/train-{i:05d}-of-{len(manifest['parts']):05d}.{format}"
        for i in range(len(manifest["parts"]))
    ]
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "data", "manifest.json"]
    rows = _load_hf(out, tmp_path / "hf-cache")
    assert sorted(r["trajectory_id"] for r in rows) == sorted(expected)
    for row in rows:
        t = expected[row["trajectory_id"]]
        assert (row["run"], row["session"], row["group"]) == (t.run, t.session, t.group)
        assert row["reward"] == t.reward and row["num_turns"] == t.num_turns
        assert row["metadata"] == t.metadata  # JSON: an object, not its text
        if kind == "tokens":
            assert row["input_ids"] == t.input_ids.tolist()
            assert row["loss_mask"] == t.loss_mask.tolist()
            assert row["versions"] == t.versions.tolist()
            assert np.array_equal(np.float32(row["logprobs"]), t.logprobs)
            assert row["turn_rewards"] == t.turn_rewards
        else:
            assert "input_ids" not in row  # TRL would skip its own tokenization
            want = convert_messages(t.messages).messages
            for message in want:  # datasets decodes the JSON arguments
                for call in message["tool_calls"] or ():
                    call["function"]["arguments"] = json.loads(call["function"]["arguments"])
            assert row["messages"] == want
            assert row["tools"] == t.tools
            assert row["round_trips"] is None  # no tokenizer under --data-dir: not checked
    tooled = [r for r in rows if r["session"] == "tooled"]
    if kind == "messages" and tooled:  # the conversation as the model saw it, OpenAI-shaped
        [row] = tooled
        assert row["messages"][1]["content"] == "Weather in Paris, é?"
        assert row["messages"][2]["tool_calls"][0]["function"] == {
            "name": "get_weather", "arguments": {"city": "Paris"}
        }  # fmt: skip
        assert "reasoning_content (1)" in done.stderr  # what the shape has no room for

    frame = _load_polars(out, format)
    assert sorted(frame["trajectory_id"].to_list()) == sorted(expected)
    if format == "parquet":  # pandas and pyarrow: the directory of the rows, as the README says
        assert sorted(pd.read_parquet(out / "data")["trajectory_id"]) == sorted(expected)
        assert pq.read_table(out / "data").num_rows == len(expected)
    if kind == "tokens":
        by_id = dict(zip(frame["trajectory_id"], frame["input_ids"].to_list(), strict=True))
        assert by_id == {i: t.input_ids.tolist() for i, t in expected.items()}

    relation = _load_duckdb(out, format)
    assert relation.aggregate("count(*)").fetchall() == [(len(expected),)]
    if kind == "tokens":
        [(tokens,)] = relation.aggregate("sum(len(input_ids))").fetchall()
        assert tokens == manifest["tokens"]
    else:
        [(role,)] = relation.aggregate("max(messages[1].role)").fetchall()
        assert role in {"system", "user"}


def test_the_dataset_card_loads_the_directory_with_datasets(
    shards: tuple[Path, list[TrajectoryReady]], tmp_path: Path
) -> None:
    root, trajectories = shards
    out = tmp_path / "card"
    done = export("--shards", str(root), "--run", RUN, "--kind", "messages", "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == [
        "README.md",
        "data",
        "data/train-00000-of-00001.parquet",
        "manifest.json",
    ]
    loaded = datasets.load_dataset(str(out), split="train", cache_dir=str(tmp_path / "cache"))
    assert len(loaded) == len(trajectories) and "messages" in loaded.column_names
    assert "not checked: no tokenizer" in done.stderr


def test_a_predicate_reads_the_json_columns_and_the_token_lists(
    shards: tuple[Path, list[TrajectoryReady]], tmp_path: Path
) -> None:
    root, _ = shards
    out = tmp_path / "out"
    where = "json_extract_string(metadata, '$.task') = 'task-tooled' and len(input_ids) > 3"
    done = export("--shards", str(root), "--run", RUN, "--kind", "messages", "--format", "jsonl",
                  "-o", str(out), "--where", where)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "exported 1 trajectory (" in done.stderr
    [line] = (out / "data" / "train-00000-of-00001.jsonl").read_text().splitlines()
    row = json.loads(line)
    assert row["session"] == "tooled" and row["tools"] == [*WEATHER_TOOLS, SEARCH_TOOL]
    [call] = row["messages"][2]["tool_calls"]
    assert call["function"]["arguments"] == {"city": "Paris"}  # JSON, not its text


@pytest.mark.parametrize(
    ("where", "why"),
    [
        ("nope > 1", 'column "nope" not found'),
        ("reward >", "syntax error"),
        ("group = 'g1'", "syntax error"),  # a reserved word: the hint says to quote it
        ("reward > 0; COPY (SELECT 1) TO '{out}.csv'", "Parser Error"),
        ("(SELECT count(*) FROM read_text('/etc/hostname')) > 0", "disabled by configuration"),
        ("CAST(session AS INTEGER) > 0", "Conversion Error"),  # binds, fails on the rows
    ],
)
def test_a_bad_predicate_is_one_clear_error_and_nothing_is_written(
    shards: tuple[Path, list[TrajectoryReady]], tmp_path: Path, where: str, why: str
) -> None:
    root, _ = shards
    out = tmp_path / "out"
    done = export("--shards", str(root), "--run", RUN, "--kind", "tokens", "-o", str(out),
                  "--where", where.format(out=out))  # fmt: skip
    assert done.returncode == 1
    assert f"--where {where.format(out=out)!r}" in done.stderr and why in done.stderr
    assert "Columns: trajectory_id, run, session, group" in done.stderr and '"group"' in done.stderr
    assert "Traceback" not in done.stderr
    assert not out.exists() and not Path(f"{out}.csv").exists()
    assert list(tmp_path.iterdir()) == []  # no staging directory either


def test_unknown_runs_empty_selections_and_outputs_in_the_way_are_refused(
    shards: tuple[Path, list[TrajectoryReady]], tmp_path: Path
) -> None:
    root, _ = shards
    out = tmp_path / "out"
    nobody = export("--shards", str(root), "--run", "nobody", "--kind", "tokens", "-o", str(out))
    assert nobody.returncode == 1
    assert (
        "run nobody has no shards under" in nobody.stderr and "runs there: r1, r2" in nobody.stderr
    )
    none = export("--shards", str(root), "--run", RUN, "--kind", "tokens", "-o", str(out),
                  "--where", "reward > 100")  # fmt: skip
    assert none.returncode == 1 and "no trajectory of run r1 matches" in none.stderr
    assert not out.exists()

    out.mkdir()
    (out / "mine.txt").write_text("keep")
    # and an export of an older turnstream, its part at the top: replaced whole, none of it
    # left beside data/ for a reader of the directory to count twice
    pq.write_table(pa.table({"trajectory_id": ["old"]}), out / "part-00000.parquet")
    (out / "manifest.json").write_text('{"turnstream_export": 1}')
    refused = export("--shards", str(root), "--run", "r2", "--kind", "tokens", "-o", str(out))
    assert (
        refused.returncode == 1
        and "is not empty" in refused.stderr
        and "--overwrite" in refused.stderr
    )
    assert (out / "mine.txt").read_text() == "keep"
    replaced = export("--shards", str(root), "--run", "r2", "--kind", "tokens", "-o", str(out),
                      "--overwrite")  # fmt: skip
    assert replaced.returncode == 0, replaced.stderr
    assert json.loads((out / "manifest.json").read_text())["rows"] == 3
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == [
        "README.md", "data", "data/train-00000-of-00001.parquet", "manifest.json"
    ]  # fmt: skip
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    inside = export("--shards", str(root), "--run", "r2", "--kind", "tokens", "-o",
                    str(blocker / "out"))  # fmt: skip
    assert inside.returncode == 1 and f"cannot write the export to {blocker}" in inside.stderr
    assert "Traceback" not in inside.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "out"]


def test_side_calls_are_exported_only_when_asked(tmp_path: Path) -> None:
    """A coding agent's session: main, a fork, a fresh sub-agent and a compaction call (the
    fold's side call, segment 3). The export leaves the side call out by default and says so."""
    root = tmp_path / "shards"
    rows = list(enumerate(claude_code_session("cc", "s1", 1.0), start=1))
    meta = ShardMetadata(
        run="cc", stream="TRAJ", stream_created="t", first_seq=1, last_seq=len(rows),
        rows=len(rows), fold_versions=(rows[0][1].fold_version,),
    )  # fmt: skip
    FileShardStore(str(root)).write(trajectories_to_table(rows, meta), meta)
    base = ["--shards", str(root), "--run", "cc", "--kind", "tokens"]

    default = export(*base, "-o", str(tmp_path / "default"))
    kept = export(*base, "-o", str(tmp_path / "kept"), "--keep-side-calls")
    only = export(*base, "-o", str(tmp_path / "only"), "--where", "segment = 3")

    assert default.returncode == 0 and kept.returncode == 0, default.stderr + kept.stderr
    assert "1 side-call trajectory (compaction, auxiliary, ...) left out" in default.stderr
    for name, segments, left_out in (("default", [0, 1, 2], 1), ("kept", [0, 1, 2, 3], 0)):
        manifest = json.loads((tmp_path / name / "manifest.json").read_text())
        assert manifest["side_calls"] == {"kept": name == "kept", "left_out": left_out}
        exported = pl.read_parquet(tmp_path / name / "data")
        assert exported["segment"].to_list() == segments
    side = json.loads(pl.read_parquet(tmp_path / "kept" / "data")["metadata"][3])
    assert side["side"] is True and side["request_class"] == "compaction"
    assert only.returncode == 1 and "--keep-side-calls" in only.stderr
    assert "all 1 trajectories of run cc that match --where are side calls" in only.stderr
    assert not (tmp_path / "only").exists()


def test_a_damaged_shard_fails_the_export_whole(
    shards: tuple[Path, list[TrajectoryReady]], tmp_path: Path
) -> None:
    root, _ = shards
    damaged = tmp_path / "shards"
    store = FileShardStore(str(damaged))
    for shard in FileShardStore(str(root)).committed():
        target = damaged / Path(shard.path).relative_to(root)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(Path(shard.path).read_bytes())
    second = [s for s in store.committed() if s.run == RUN][1]
    data = bytearray(Path(second.path).read_bytes())
    footer = int.from_bytes(data[-8:-4], "little") + 8  # the footer, its length, b"PAR1"
    data[4 : len(data) - footer] = bytes(len(data) - footer - 4)  # the pages zeroed
    Path(second.path).write_bytes(bytes(data))
    # an export killed earlier left its staging directory: removed, its process being gone
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (tmp_path / f".out.export-{gone.pid}-0badcafe").mkdir()
    out = tmp_path / "out"

    done = export("--shards", str(damaged), "--run", RUN, "--kind", "tokens", "-o", str(out),
                  "--rows-per-part", "2")  # fmt: skip

    assert done.returncode == 1, done.stderr
    assert f"cannot read the shards of run {RUN}" in done.stderr and "Traceback" not in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shards"]  # no half dataset, no staging


# -- real sessions through the gateway: the chat-template round trip, and TRL ---------------------


def _chat(up: UpProcess, turns: list[JSON]) -> str:
    """A session: the weather question, then each of ``turns`` (request overrides) in order,
    feeding back the reply and the tool's result as an agent does; closed with reward 1."""
    opened = httpx.post(f"{up.url}/v1/sessions", json={}, timeout=30).json()
    client = openai.OpenAI(base_url=opened["base_url"], api_key="unused", max_retries=0)
    messages: list[JSON] = [*WEATHER_QUESTION]
    for overrides in turns:
        reply = client.chat.completions.create(
            **{"model": "tiny", "messages": messages, "tools": WEATHER_TOOLS, "temperature": 0,
               "max_tokens": 96, **overrides}
        )  # fmt: skip
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        messages += [
            {"role": "tool", "tool_call_id": c.id, "content": WEATHER_RESULT}
            for c in message.tool_calls or ()
        ]
    closed = httpx.post(f"{up.url}/v1/sessions/{opened['session_id']}/close",
                        json={"reward": 1.0}, timeout=30)  # fmt: skip
    assert closed.status_code == 200, closed.text
    return str(opened["session_id"])


def test_served_sessions_round_trip_through_the_chat_template_and_train_with_trl(
    tmp_path: Path, tool_model_dir: Path
) -> None:
    up = UpProcess(tmp_path / "data", tool_model_dir)
    try:
        up.wait_healthy()
        sessions = {
            # the fitted transcript: a tool call, then the answer, each ended by <|im_end|>
            "answered": _chat(up, [{}, {}]),
            # the tool call cut off by max_tokens: the template closes the turn the model did not
            "cut": _chat(up, [{"max_tokens": 10}]),
            # a stop string: cut from the text the client got, not from the sampled tokens
            "stopped": _chat(up, [{}, {"stop": ["sunny"]}]),
        }

        def all_in_shards() -> bool:
            rows = shard_table_rows(tmp_path / "data" / "shards")
            return set(sessions.values()) <= {r["session"] for r in rows}

        wait_for(all_in_shards, 60, "the three sessions in the shards")
    finally:
        assert up.stop() == 0, up.output()[-4000:]
        up.cleanup()
    shard_rows = {r["session"]: r for r in shard_table_rows(tmp_path / "data" / "shards")}
    assert shard_rows[sessions["cut"]]["finish_reason"] == "length"
    tokenizer = AutoTokenizer.from_pretrained(tool_model_dir)
    [im_end] = tokenizer.encode("<|im_end|>", add_special_tokens=False)
    newline = tokenizer.encode("\n", add_special_tokens=False)

    def closed(session: str) -> list[int]:
        """The sample, then the template's closing: after a sampled <|im_end|>, only "\\n"."""
        ids: list[int] = shard_rows[session]["input_ids"]
        return [*ids, *(newline if ids[-1] == im_end else [im_end, *newline])]

    for format in ("parquet", "jsonl"):
        out = tmp_path / f"sft-{format}"
        done = export(
            "--data-dir", str(tmp_path / "data"), "--run", "up", "--kind", "messages",
            "--format", format, "--tokenizer", str(tool_model_dir), "-o", str(out),
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        fidelity = json.loads((out / "manifest.json").read_text())["fidelity"]
        assert (fidelity["checked"], fidelity["round_trips"]) == (3, 2), fidelity
        [failed] = fidelity["examples"]
        assert failed["trajectory_id"] == f"up/{sessions['stopped']}/0"
        assert "2 of 3 rows render to exactly their tokens" in done.stderr
        assert "1 do not" in done.stderr

        rows = {r["session"]: r for r in _load_hf(out, tmp_path / "hf-cache")}
        answered = rows[sessions["answered"]]
        assert answered["num_turns"] == 2 and answered["tools"] == WEATHER_TOOLS
        [call] = answered["messages"][1]["tool_calls"]  # the model's real tool call
        assert call["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
        for name, session in sessions.items():
            row = rows[session]
            assert row["round_trips"] is (name != "stopped")
            # what TRL does: the chat template on the loaded messages and tools, as they are
            text = tokenizer.apply_chat_template(
                row["messages"], tools=row["tools"], tokenize=False
            )
            ids = tokenizer.encode(text, add_special_tokens=False)
            assert (ids == closed(session)) is (name != "stopped"), name

        trained = _sft_two_steps(tool_model_dir, out, format, tmp_path / f"trl-{format}")
        for name, session in sessions.items():
            if name != "stopped":  # TRL trained on exactly the tokens the policy saw and sampled
                assert trained[session] == closed(session), name


def _sft_two_steps(model_dir: Path, out: Path, format: str, work: Path) -> dict[str, list[int]]:
    """Two steps of TRL's SFTTrainer on the export as loaded by ``datasets``; the token ids TRL
    made of each row, by session."""
    from trl import SFTConfig, SFTTrainer

    loaded = datasets.load_dataset(
        "json" if format == "jsonl" else "parquet", data_files=str(out / data_files(format)),
        split="train", cache_dir=str(work / "cache"),
    )  # fmt: skip
    config = SFTConfig(
        output_dir=str(work), max_steps=2, per_device_train_batch_size=2, max_length=None,
        report_to=[], save_strategy="no", use_cpu=True, logging_steps=1, dataset_num_proc=None,
        # TRL sets the deprecated gradient_checkpointing (transformers warns); the new name, off.
        activation_checkpointing=False,
    )  # fmt: skip
    trainer = SFTTrainer(model=str(model_dir), args=config, train_dataset=loaded,
                         processing_class=AutoTokenizer.from_pretrained(model_dir))  # fmt: skip
    result = trainer.train()
    assert result.global_step == 2 and np.isfinite(result.training_loss)
    tokenized = trainer.train_dataset
    return dict(zip(tokenized["session"], tokenized["input_ids"], strict=True))
