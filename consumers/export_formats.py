"""How an export's rows become files (PURE): JSON Lines, and the dataset card (README.md).

JSON Lines: one object per row; JSON columns (``metadata``, ``tools``, tool-call ``arguments``)
are written as JSON, not as text; number lists are printed by Arrow compute (float32 in its
shortest form, NaN and infinities as null), timestamps in RFC 3339.

The dataset card's YAML header names the parts (``configs``) and their exact types
(``dataset_info.features``, written from the Arrow schema), so ``datasets.load_dataset(DIR)``
loads Parquet and JSON Lines alike without guessing. Guessing is what
``load_dataset("json", data_files=...)`` does: it infers the types from the first block of the
first file, so a column that is null throughout that block (``tool_calls`` in a run whose first
samples called no tool) cannot hold the values that come later. The card's features avoid that;
so does Parquet, which carries its schema. Its body shows how each tool reads the export
(``consumers.export_layout``: the rows are under ``data/``), lines a unit test runs as printed.

>>> import pyarrow as pa
>>> schema = pa.schema([("ids", pa.list_(pa.int32())), ("meta", pa.json_(pa.string())),
...     ("m", pa.list_(pa.struct([("role", pa.string())])))])
>>> print("\\n".join(feature_lines(schema)))
- name: ids
  list: int32
- name: meta
  dtype: json
- name: m
  list:
  - name: role
    dtype: string
>>> table = pa.table({"ids": pa.array([[1, 2]], pa.list_(pa.int32())),
...     "meta": pa.ExtensionArray.from_storage(pa.json_(pa.string()), pa.array(['{"a": 1}']))})
>>> bytes(jsonl_lines(table))
b'{"ids":[1,2],"meta":{"a": 1}}\\n'
"""

from __future__ import annotations

import json
import re
from string import Template
from typing import Any

import msgspec
import pyarrow as pa
import pyarrow.compute as pc

from consumers.export import JSON_TYPE
from consumers.export_images import IMAGE_TYPE
from consumers.export_layout import DATA_DIR, data_files

__all__ = ["dataset_card", "feature_lines", "jsonl_lines"]

JSON = dict[str, Any]
_JSON_EXTENSION = "arrow.json"
_S = pa.string()
_encode = msgspec.json.Encoder()


def _numbers_json(column: pa.ChunkedArray | pa.Array) -> list[bytes]:
    """Each row's list of numbers as JSON text, built by Arrow compute (no per-number object);
    a NaN or infinity (not JSON) is written as null, as msgspec does."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    values = array.values
    text = pc.cast(values, _S)
    if pa.types.is_floating(values.type):
        text = pc.if_else(pc.is_finite(values), text, pa.scalar("null"))
    text = pc.fill_null(text, "null")  # null items (turn_rewards of turns nobody rewarded)
    lists = pa.ListArray.from_arrays(array.offsets, text)
    joined = pc.binary_join_element_wise("[", pc.binary_join(lists, ","), "]", "")
    rows: list[bytes] = joined.cast(pa.binary()).to_pylist()
    return rows


def _one_line(text: str) -> str:
    """JSON text with no line break in it (a JSON Lines row is one line)."""
    if "\n" not in text and "\r" not in text:
        return text
    return json.dumps(json.loads(text), ensure_ascii=False, separators=(",", ":"))


def _raw(text: str | None) -> msgspec.Raw | None:
    return None if text is None else msgspec.Raw(_one_line(text).encode())


def _with_raw_arguments(messages: list[JSON] | None) -> list[JSON] | None:
    for message in messages or ():
        for call in message.get("tool_calls") or ():
            call["function"]["arguments"] = _raw(call["function"]["arguments"])
    return messages


def _values(field: pa.Field, column: pa.ChunkedArray) -> list[Any]:
    type_ = field.type
    if pa.types.is_list(type_) and (
        pa.types.is_integer(type_.value_type) or pa.types.is_floating(type_.value_type)
    ):
        return [msgspec.Raw(b) for b in _numbers_json(column)]
    values: list[Any] = column.to_pylist()
    if type_ == JSON_TYPE:
        return [_raw(v) for v in values]
    if field.name == "tools":
        return [[_raw(t) for t in tools] for tools in values]
    if field.name == "messages":
        return [_with_raw_arguments(m) for m in values]
    return values


def jsonl_lines(table: pa.Table) -> bytearray:
    """The table as JSON Lines: one object per row, JSON columns written as JSON (not text),
    numbers as Arrow prints them (float32 in its shortest form), timestamps in RFC 3339."""
    columns: list[tuple[str, list[Any]]] = [
        (f.name, _values(f, table.column(f.name))) for f in table.schema
    ]
    out = bytearray()
    for i in range(table.num_rows):
        _encode.encode_into({name: values[i] for name, values in columns}, out, -1)
        out += b"\n"
    return out


# -- the dataset card ------------------------------------------------------------------------


def _dtype(type_: pa.DataType) -> str:
    """The ``datasets`` dtype name of an Arrow type that is not nested."""
    if getattr(type_, "extension_name", None) == _JSON_EXTENSION:
        return "json"
    if type_ == IMAGE_TYPE:  # datasets.Image()'s storage: decoded to a PIL image on access
        return "image"
    if pa.types.is_timestamp(type_):
        return f"timestamp[{type_.unit}" + (f", tz={type_.tz}]" if type_.tz else "]")
    names = {pa.float32(): "float32", pa.float64(): "float64", pa.bool_(): "bool"}
    return names.get(type_, str(type_))


def _nested(type_: pa.DataType) -> bool:
    return type_ != IMAGE_TYPE and bool(pa.types.is_list(type_) or pa.types.is_struct(type_))


def _scalar(text: str) -> str:
    """A YAML scalar: bare when it is a plain word, else quoted (``timestamp[us, tz=UTC]``)."""
    return text if re.fullmatch(r"\w+", text) else json.dumps(text)


def _type_lines(key: str, type_: pa.DataType, indent: str) -> list[str]:
    """``key: ...`` for one type: ``dtype: x``, ``list: x``, or ``list:``/``struct:`` + fields."""
    if pa.types.is_list(type_):
        value = type_.value_type
        if not _nested(value):
            return [f"{indent}list: {_scalar(_dtype(value))}"]
        if pa.types.is_struct(value):
            return [f"{indent}list:", *_field_lines(value, indent)]
        return [f"{indent}list:", *_type_lines("", value, indent + "  ")]  # list of lists
    if _nested(type_):
        return [f"{indent}struct:", *_field_lines(type_, indent)]
    return [f"{indent}{key}: {_scalar(_dtype(type_))}"]


def _field_lines(struct: pa.StructType | pa.Schema, indent: str) -> list[str]:
    lines: list[str] = []
    for field in struct:
        lines.append(f"{indent}- name: {_scalar(field.name)}")
        lines += _type_lines("dtype", field.type, indent + "  ")
    return lines


def feature_lines(schema: pa.Schema) -> list[str]:
    """The schema as the YAML list ``datasets`` reads under ``dataset_info.features``."""
    return _field_lines(schema, "")


# How each tool reads the export (consumers.export_layout): by the rows under data/, not by DIR,
# which holds this card too (pyarrow, pandas and polars would read it as data). The test runs
# these lines as the card prints them (tests/unit/test_export_layout.py).
_READS = {
    "parquet": Template(
        """import datasets, duckdb, pandas as pd, polars as pl, pyarrow.parquet as pq

DIR = "path/to/this/directory"
dataset = datasets.load_dataset(DIR, split="train")  # the types above, exactly
frame = pd.read_parquet(f"{DIR}/$data")  # $data/, not DIR: DIR holds this card too
table = pq.read_table(f"{DIR}/$data")
lazy = pl.scan_parquet(f"{DIR}/$files")  # or pl.read_parquet
relation = duckdb.sql(f"from '{DIR}/$files'")"""
    ),
    "jsonl": Template(
        """import datasets, duckdb

DIR = "path/to/this/directory"
dataset = datasets.load_dataset(DIR, split="train")  # the types above, exactly
frame = dataset.to_pandas()  # or .to_polars(), the same types
relation = duckdb.sql(f"from read_json('{DIR}/$files')")  # types inferred from the rows"""
    ),
}


def dataset_card(manifest: JSON, schema: pa.Schema) -> str:
    """README.md for the export described by ``manifest`` (``consumers.export_files``)."""
    format = manifest["format"]
    pattern = data_files(format)
    where = manifest["where"] or "true"
    shards = len(manifest["source"]["shards"])
    lines = [
        "---",
        "configs:",
        "- config_name: default",
        "  data_files:",
        "  - split: train",
        f'    path: "{pattern}"',
        "dataset_info:",
        "  features:",
        *("  " + line for line in feature_lines(schema)),
        "---",
        "",
        f"# turnstream export: run {manifest['run']}, {manifest['kind']}",
        "",
        f"{manifest['rows']:,} trajectories ({manifest['tokens']:,} tokens) of run "
        f"`{manifest['run']}` where `{where}`, from {shards} shard{'s' if shards != 1 else ''} "
        f"under `{manifest['source']['target']}`. `manifest.json` has the details.",
        "",
        "```python",
        _READS[format].substitute(data=DATA_DIR, files=data_files(format)),
        "```",
        "",
    ]
    fidelity = manifest.get("fidelity") or {}
    if "checked" in fidelity:
        lines += [
            f"Chat-template round trip: {fidelity['round_trips']:,} of {fidelity['checked']:,} "
            f"rows render to exactly their tokens (column `round_trips`).",
            "",
        ]
    if images := manifest.get("images"):
        lines += [
            f"{images['rows']:,} rows show {images['count']:,} images in all (column `images`, "
            f"`datasets.Image()`: PIL images once loaded; each message shows an image as "
            f'`{{"type": "image"}}` where it sits, the images in order of appearance).',
            "",
        ]
    dropped = manifest.get("dropped_message_fields") or {}
    if dropped:
        listed = ", ".join(f"{name} ({count})" for name, count in dropped.items())
        lines += [f"Message fields not exported: {listed}.", ""]
    return "\n".join(lines)
