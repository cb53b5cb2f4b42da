"""Where the files of an export go (PURE): the Hugging Face Hub's layout, one rule for every kind.

    DIR/
      README.md                            the dataset card (``consumers.export_formats``)
      manifest.json                        what was exported, from where
      data/train-00000-of-00002.parquet    the rows, and nothing but the rows, under data/
      data/train-00001-of-00002.parquet

Why ``data/``: a reader handed a directory takes every file in it for data. pyarrow (and so
pandas) skips only names that start with ``.`` or ``_`` (``ignore_prefixes``) and polars refuses
a directory of mixed extensions, so with the parts beside ``README.md`` (before issue 38) they
failed on the card. The card must stay ``README.md`` at the top, where the Hub and ``datasets``
look for it; so the parts move, and each tool reads the export by the path it takes. The card
prints most of these reads; tests/unit/test_export_layout.py runs them all::

    datasets.load_dataset(DIR)                   the card's exact types, JSON Lines too
    pd.read_parquet(f"{DIR}/data")               pyarrow.parquet.read_table(f"{DIR}/data")
    pl.scan_parquet(f"{DIR}/data/*.parquet")     pl.read_parquet(f"{DIR}/data") too
    duckdb.sql(f"from '{DIR}/data/*.parquet'")   DuckDB's read_parquet(DIR) too
    JSON Lines: dataset.to_pandas() / .to_polars() (the card's types), or DuckDB's
    read_json(f"{DIR}/data/*.jsonl") (types inferred from the rows)

``pd.read_parquet(DIR)``, ``pyarrow.parquet.read_table(DIR)`` and ``pl.read_parquet(DIR)`` still
fail (the card is not Parquet): name ``data``. polars' ``read_ndjson`` over several parts takes
the first part's types for all of them, so it fails where a later part has values in a column
that the first has null throughout (a first tool call); hence ``to_polars`` for JSON Lines.

Parts are named as ``datasets``' ``push_to_hub`` names them, ``train-<index>-of-<count>``, five
digits each (more when there are more parts), one split (``train``): the count tells a reader
that a part is missing. The count is known when the last part is closed, so a part is written
under its index alone (``staged_part_file``) and renamed (``part_file``) when the export is
committed. A kind whose files are not numbered parts (one file per session) puts them under
``data/`` all the same (``data_file``); the card's ``configs`` name every file there of the
export's extension (``data_files``).

An export written before issue 38 has its parts at the top (``part-00000.parquet``; manifest
``turnstream_export`` 1). Its card names them there, so the tools read it as they did; no
turnstream command reads an export back; ``--overwrite`` replaces one whole.

>>> part_file(0, 3, "parquet"), staged_part_file(2, "jsonl")
('data/train-00000-of-00003.parquet', 'data/train-00002.jsonl')
>>> data_file("s1.json"), data_files("jsonl")
('data/s1.json', 'data/*.jsonl')
"""

from __future__ import annotations

__all__ = ["DATA_DIR", "SPLIT", "data_file", "data_files", "part_file", "staged_part_file"]

DATA_DIR = "data"
SPLIT = "train"


def part_file(index: int, count: int, extension: str) -> str:
    """The ``index``-th of ``count`` parts, relative to the export directory."""
    return f"{DATA_DIR}/{SPLIT}-{index:05d}-of-{count:05d}.{extension}"


def staged_part_file(index: int, extension: str) -> str:
    """The ``index``-th part while it is written (the count not yet known)."""
    return f"{DATA_DIR}/{SPLIT}-{index:05d}.{extension}"


def data_file(name: str) -> str:
    """A file of the dataset that is not a numbered part (one per session), relative to DIR."""
    return f"{DATA_DIR}/{name}"


def data_files(extension: str) -> str:
    """Every file of the dataset, as the card's ``configs`` name them (a glob relative to DIR)."""
    return f"{DATA_DIR}/*.{extension}"
