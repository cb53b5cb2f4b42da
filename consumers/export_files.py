"""The files of ``turnstream export``: a run's shard rows through a SQL predicate, in; an export
directory written whole or not at all, out. ``consumers.export`` turns the one into the other.

Selection: the run's committed shards (``FileShardStore``: a directory or any pyarrow URI) are
opened as one ``pyarrow.dataset``. With a predicate, DuckDB queries that dataset, pushing the
predicate and the projection into the scan; without one, pyarrow reads it alone (DuckDB's trip
through its own vectors doubles the cost of reading the token lists). The predicate is the
user's, on their own files, but it is taken as a single SQL *expression* (DuckDB's relation
``filter``), never as a statement, so ``;``, ``COPY`` or ``ATTACH`` cannot run; the connection
is opened with file access disabled and its configuration locked, so a subquery cannot read
(or write) other files either.

Output directory ``DIR``, laid out as the Hugging Face Hub lays out a dataset (the rule, and the
reads it lets each tool make, are ``consumers.export_layout``'s)::

    data/train-00000-of-00002.parquet       every ``rows_per_part`` rows a new part (or .jsonl)
    manifest.json                           run, kind, format, where, rows, tokens, parts,
                                            source shards, fidelity, fields dropped
    README.md                               a dataset card (``consumers.export_formats``):
                                            ``datasets.load_dataset(DIR)`` loads the parts with
                                            their exact types

Everything is written into a hidden sibling (``.DIR.export-<pid>-<token>``) that is renamed onto
``DIR`` when complete, so a failed or killed export never leaves half a dataset at ``DIR``; the
staging directory of an export whose process is gone is removed by the next export to ``DIR``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import BinaryIO, Literal

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from consumers.export import JSON, ExportError
from consumers.export_formats import jsonl_lines
from consumers.export_images import IMAGE_MENTION
from consumers.export_layout import data_file, part_file, staged_part_file
from eventlog.server import pid_alive
from schemas.shards import TRAJECTORY_SCHEMA
from shardstore import FileShardStore

__all__ = ["ExportDirectory", "ExportFormat", "Part", "Selection", "SourceShard"]

ExportFormat = Literal["parquet", "jsonl"]
# Dictionaries pay off for the few-valued columns only (as in the shards): on token ids they
# cost write time for nothing.
_DICTIONARY_COLUMNS = ["run", "session", "group", "status", "finish_reason"]
_READ_SCHEMA = pa.schema([f.with_nullable(True) for f in TRAJECTORY_SCHEMA])
_SQL_HINT = (
    '(SQL: quote reserved words, "group"; messages, tools and metadata are JSON text, e.g. '
    "json_extract_string(metadata, '$.task') = 'x'; len(input_ids) counts tokens)"
)


@dataclass(frozen=True)
class SourceShard:
    path: str  # as the user names the shard target
    first_seq: int
    last_seq: int


class Selection:
    """The rows of ``run``'s committed shards under ``shards`` for which ``where`` holds.

    Raises ExportError when the run has no shards there (naming the runs that do) or when
    ``where`` is not a predicate over the shard columns (naming them). The rows come in
    TRAJECTORY_SCHEMA's types, a batch at a time, in shard order.
    """

    def __init__(self, shards: str, run: str, where: str | None) -> None:
        self.run, self.where = run, where
        store = FileShardStore(shards)
        committed = store.committed()
        mine = [s for s in committed if s.run == run]
        if not mine:
            runs = sorted({s.run for s in committed})
            there = f"runs there: {', '.join(runs)}" if runs else "there are no shards there"
            raise ExportError(
                f"run {run} has no shards under {store.display(store.root)} ({there}); check "
                f"--run, and --shards or --data-dir"
            )
        self.target = store.display(store.root)
        self.sources = [SourceShard(store.display(s.path), s.first_seq, s.last_seq) for s in mine]
        dataset = ds.dataset(
            [s.path for s in mine], filesystem=store.fs, format="parquet", schema=TRAJECTORY_SCHEMA
        )
        self._dataset = dataset
        self._connection: duckdb.DuckDBPyConnection | None = None
        self._relation: duckdb.DuckDBPyRelation | None = None
        if where is not None:
            self._connection = duckdb.connect(
                config={"enable_external_access": False, "lock_configuration": True}
            )
            try:
                self._relation = self._connection.from_arrow(dataset).filter(where)
            except duckdb.Error as exc:
                raise self._bad_predicate(exc) from exc

    def _bad_predicate(self, exc: duckdb.Error) -> ExportError:
        return ExportError(
            f"--where {self.where!r} is not a predicate over the shard columns of run "
            f"{self.run}: {_first_line(exc)}. Columns: {', '.join(TRAJECTORY_SCHEMA.names)} "
            f"{_SQL_HINT}"
        )

    def _failed(self, exc: duckdb.Error) -> ExportError:
        """A predicate that binds but fails on the rows (a cast), or a shard DuckDB cannot read."""
        return ExportError(
            f"--where {self.where!r} failed on the shards of run {self.run} under "
            f"{self.target}: {_first_line(exc)}. Columns: {', '.join(TRAJECTORY_SCHEMA.names)} "
            f"{_SQL_HINT}"
        )

    def _unreadable(self, exc: Exception) -> ExportError:
        return ExportError(
            f"cannot read the shards of run {self.run} under {self.target}: {exc}. A damaged "
            f"shard must be restored, or moved out of the shard directory to export without it"
        )

    def count(self) -> int:
        """How many rows match (a scan of the predicate's columns only)."""
        if self._relation is None:
            try:
                return int(self._dataset.count_rows())  # from the footers
            except (OSError, pa.ArrowException) as exc:
                raise self._unreadable(exc) from exc
        try:
            [(rows,)] = self._relation.aggregate("count(*)").fetchall()
        except duckdb.Error as exc:
            raise self._failed(exc) from exc
        return int(rows)

    def mentioning_images(self) -> int:
        """How many matching rows may hold an image (their messages' JSON has an image part's
        opening, ``IMAGE_MENTION``): a scan of the messages, which decides the export's layout
        before its first row is written."""
        if self._relation is None:
            mentions = pc.match_substring(ds.field("messages"), IMAGE_MENTION)
            try:
                return int(self._dataset.count_rows(filter=mentions))
            except (OSError, pa.ArrowException) as exc:
                raise self._unreadable(exc) from exc
        try:
            found = self._relation.filter(f"contains(messages, '{IMAGE_MENTION}')")
            [(rows,)] = found.aggregate("count(*)").fetchall()
        except duckdb.Error as exc:
            raise self._failed(exc) from exc
        return int(rows)

    def batches(self, rows: int = 1024) -> Iterator[pa.Table]:
        """The matching rows, ``rows`` at a time (streamed; memory stays bounded)."""
        if self._relation is None:  # every row: pyarrow alone reads lists twice as fast
            try:
                for batch in self._dataset.to_batches(batch_size=rows):
                    if batch.num_rows:
                        yield pa.Table.from_batches([batch]).cast(_READ_SCHEMA)
            except (OSError, pa.ArrowException) as exc:
                raise self._unreadable(exc) from exc
            return
        try:
            reader = self._relation.to_arrow_reader(rows)
            for batch in reader:
                if batch.num_rows:
                    # DuckDB hands back its own spellings (time zone "Etc/UTC", nullable fields)
                    yield (
                        pa.Table.from_batches([batch]).select(_READ_SCHEMA.names).cast(_READ_SCHEMA)
                    )
        except duckdb.Error as exc:
            raise self._failed(exc) from exc

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


@dataclass(frozen=True)
class Part:
    file: str
    rows: int


class ExportDirectory:
    """``output`` written whole or not at all (see the module docstring); a context manager
    that discards the staging directory unless ``commit`` ran."""

    def __init__(
        self,
        output: Path,
        *,
        format: ExportFormat,
        schema: pa.Schema,
        rows_per_part: int,
        overwrite: bool,
    ) -> None:
        self.output, self.format, self.schema = output, format, schema
        self.rows_per_part, self.overwrite = rows_per_part, overwrite
        self._part_rows: list[int] = []  # the rows of each part written so far
        self._files: list[Part] = []  # written whole (add_file): not numbered parts
        self._writer: pq.ParquetWriter | None = None
        self._lines: BinaryIO | None = None  # the open JSON Lines part
        self._in_part = 0
        self._check_output()
        self.staging = output.parent / f".{output.name}.export-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        with self._writing():
            output.parent.mkdir(parents=True, exist_ok=True)
            self._remove_abandoned()
            self.staging.mkdir()

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        try:
            yield
        except (OSError, pa.ArrowException) as exc:
            raise ExportError(
                f"cannot write the export to {self.output}: {exc}; check the space and the "
                f"permissions there (nothing was left at {self.output})"
            ) from exc

    def _check_output(self) -> None:
        out = self.output
        if out.exists() and not out.is_dir():
            raise ExportError(f"output {out} is a file: name a directory (-o DIR)")
        if out.is_dir() and any(out.iterdir()) and not self.overwrite:
            raise ExportError(
                f"output directory {out} is not empty: name a new directory, or pass "
                f"--overwrite to replace it"
            )

    def _remove_abandoned(self) -> None:
        """Staging directories of exports to the same DIR whose process is gone (killed)."""
        for path in self.output.parent.glob(f".{self.output.name}.export-*"):
            pid = path.name.rsplit("-", 2)[-2]
            if pid.isdigit() and not pid_alive(int(pid)):
                shutil.rmtree(path, ignore_errors=True)

    def __enter__(self) -> ExportDirectory:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        with contextlib.suppress(OSError, pa.ArrowException):
            self._close_part()
        if self.staging.exists():
            shutil.rmtree(self.staging, ignore_errors=True)

    def write(self, table: pa.Table) -> None:
        """Append rows (of ``schema``), starting a new part every ``rows_per_part`` rows."""
        with self._writing():
            self._write(table)

    def _write(self, table: pa.Table) -> None:
        while table.num_rows:
            if self._writer is None and self._lines is None:
                self._open_part()
            take = min(table.num_rows, self.rows_per_part - self._in_part)
            chunk, table = table.slice(0, take), table.slice(take)
            if self._writer is not None:
                self._writer.write_table(chunk, row_group_size=max(chunk.num_rows, 1))
            elif self._lines is not None:
                self._lines.write(jsonl_lines(chunk))
            self._in_part += take
            self._part_rows[-1] += take
            if self._in_part >= self.rows_per_part:
                self._close_part()

    def _open_part(self) -> None:
        path = self.staging / staged_part_file(len(self._part_rows), self.format)
        path.parent.mkdir(exist_ok=True)
        if self.format == "parquet":
            self._writer = pq.ParquetWriter(
                path, self.schema, compression="zstd", use_dictionary=_DICTIONARY_COLUMNS
            )
        else:
            self._lines = path.open("wb")
        self._part_rows.append(0)
        self._in_part = 0

    @property
    def parts(self) -> list[Part]:
        """The parts written, by the names they have once committed."""
        count = len(self._part_rows)
        numbered = [
            Part(part_file(i, count, self.format), n) for i, n in enumerate(self._part_rows)
        ]
        return [*numbered, *self._files]

    def _close_part(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self._lines is not None:
            self._lines.close()
        self._writer = self._lines = None

    def add_file(self, name: str, content: bytes, rows: int) -> None:
        """A file written whole, under ``data/`` (``data_file``): an ATIF document, one per
        session, not a numbered part."""
        path = self.staging / data_file(name)
        with self._writing():
            path.parent.mkdir(exist_ok=True)
            path.write_bytes(content)
        self._files.append(Part(data_file(name), rows))

    def commit(self, manifest: JSON, readme: str) -> None:
        """Write the manifest and the card, then put the directory in place at ``output``."""
        with self._writing():
            self._commit(manifest, readme)

    def _commit(self, manifest: JSON, readme: str) -> None:
        self._close_part()
        count = len(self._part_rows)
        for index in range(count):  # the count is known now: the names take it
            staged = self.staging / staged_part_file(index, self.format)
            staged.rename(self.staging / part_file(index, count, self.format))
        (self.staging / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        (self.staging / "README.md").write_text(readme)
        self._check_output()  # again: something may have appeared there meanwhile
        replaced = None
        if self.output.is_dir():
            if any(self.output.iterdir()):
                replaced = self.output.parent / f".{self.output.name}.replaced-{uuid.uuid4().hex}"
                os.rename(self.output, replaced)
            else:
                self.output.rmdir()
        os.rename(self.staging, self.output)
        if replaced is not None:
            shutil.rmtree(replaced, ignore_errors=True)
