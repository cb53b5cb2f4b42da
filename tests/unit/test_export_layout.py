"""An export's layout (issue 38, point 2): the Hub's, parts under ``data/``, and every tool reads it
by the lines its dataset card prints: ``datasets``, pandas, pyarrow, polars and DuckDB, run here as
written (``consumers.export_layout``). The files are written by the export's own
``ExportDirectory``; ``turnstream export`` as a process is tests/integration/test_export.py's."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import datasets
import duckdb
import msgspec
import polars as pl
import pyarrow as pa
import pytest

from consumers.export import messages_table, tokens_table
from consumers.export_files import ExportDirectory
from consumers.export_formats import dataset_card
from consumers.export_layout import part_file
from schemas.shards import trajectories_to_table
from tests.helpers.tiny_model import WEATHER_TOOLS
from tests.helpers.trajectories import folded

JSON = dict[str, Any]


def _shard_rows() -> pa.Table:
    """Five samples; the last, in the last part, the only one that called a tool (so a reader
    that guesses types from the first part's rows would guess ``tool_calls`` wrong)."""
    plain = [folded("r1", f"s{i}", turns=1 + i % 3) for i in range(4)]
    tooled = msgspec.structs.replace(
        folded("r1", "tooled", turns=1),
        messages=[
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        ],
        tools=WEATHER_TOOLS,
    )  # fmt: skip
    return trajectories_to_table(list(enumerate([*plain, tooled], start=1)))


def _export(out: Path, kind: str, format: str) -> pa.Table:
    """The rows of ``kind`` written to ``out`` as ``turnstream export`` writes them, 2 a part."""
    shard = _shard_rows()
    table = tokens_table(shard) if kind == "tokens" else messages_table(shard)
    with ExportDirectory(
        out, format=format, schema=table.schema, rows_per_part=2, overwrite=False
    ) as directory:  # type: ignore[arg-type]
        directory.write(table)
        manifest = {
            "run": "r1", "kind": kind, "format": format, "where": None, "rows": table.num_rows,
            "tokens": 0, "parts": [p.file for p in directory.parts],
            "source": {"target": "shards", "shards": []},
        }  # fmt: skip
        directory.commit(manifest, dataset_card(manifest, table.schema))
    return table


def test_parts_are_named_as_the_hub_names_them() -> None:
    assert part_file(0, 3, "parquet") == "data/train-00000-of-00003.parquet"
    assert part_file(123_456, 200_000, "jsonl") == "data/train-123456-of-200000.jsonl"


@pytest.mark.parametrize("format", ["parquet", "jsonl"])
@pytest.mark.parametrize("kind", ["tokens", "messages"])
def test_every_tool_reads_the_export_as_its_card_says(
    kind: str, format: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "export"
    table = _export(out, kind, format)
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == [
        "README.md",
        "data",
        *(f"data/train-0000{i}-of-00003.{format}" for i in range(3)),
        "manifest.json",
    ]
    card = (out / "README.md").read_text()
    [code] = re.findall(r"```python\n(.*?)```", card, re.S)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    read: JSON = {}
    exec(code.replace("path/to/this/directory", str(out)), read)

    ids = table.column("trajectory_id").to_pylist()
    dataset = read["dataset"]
    assert dataset.features == datasets.Features.from_arrow_schema(table.schema)  # exactly
    assert dataset["trajectory_id"] == ids
    frame = read["frame"]  # pandas: by pyarrow from data/, or by datasets
    assert frame["trajectory_id"].tolist() == ids
    assert sorted(r[0] for r in read["relation"].select("trajectory_id").fetchall()) == sorted(ids)
    if format == "parquet":
        assert read["table"].schema == table.schema  # pyarrow: the very types written
        assert read["table"].column("trajectory_id").to_pylist() == ids
        assert read["lazy"].collect()["trajectory_id"].to_list() == ids
        # and as the module docstring says they do too
        assert pl.read_parquet(out / "data")["trajectory_id"].to_list() == ids
        assert duckdb.sql(f"select count(*) from read_parquet('{out}')").fetchall() == [(5,)]
    if kind == "tokens":
        input_ids = table.column("input_ids").to_pylist()
        assert dataset["input_ids"] == input_ids
        assert [list(row) for row in frame["input_ids"]] == input_ids
        if format == "parquet":
            assert read["lazy"].collect()["input_ids"].to_list() == input_ids
    else:  # the tool call of the last part's row, whose first part called none
        assert dataset[-1]["messages"][1]["tool_calls"][0]["function"]["arguments"] == {
            "city": "Paris"
        }
        [call] = frame["messages"].iloc[-1][1]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        [(name,)] = (
            read["relation"].aggregate("max(messages[2].tool_calls[1].function.name)").fetchall()
        )
        assert name == "get_weather"
