"""Where shards live: the ``ShardStore`` port and its pyarrow-filesystem adapter.

Layout (hive partitioning, DESIGN §6)::

    <root>/run=<run>/part-<first_seq:012d>-<last_seq:012d>-<token>.parquet

``first_seq``/``last_seq`` are the TRAJ stream sequences of the shard's first and last rows (its
footer says the same, with the exact sequences in the ``traj_seq`` column); ``token`` is random,
so two shards never share a name, even across a TRAJ stream made again from sequence 1.

Committing is atomic on every kind of target, so a reader never sees half a shard:

- local directories and HDFS: the Parquet bytes go to ``.part-….parquet.tmp`` in the same
  directory, are fsynced (local), then renamed onto the final name (and the directory fsynced:
  the rename is the commit, so a failure of that last fsync is logged, not raised).
  Temporary names start with ``.`` (``pyarrow.dataset`` skips them) and do not end in
  ``.parquet`` (so DuckDB's ``*.parquet`` globs, which do match dot-files, skip them too).
  Leftovers of a killed writer are removed by ``remove_partial`` when the writer starts.
- object stores (``s3://``, ``gs://``, ``abfs://``...): "rename" there is copy + delete, twice
  the upload and not atomic. An object instead appears atomically when its upload completes,
  so the shard is uploaded straight to its final key; a writer killed mid-upload leaves no
  object (only an incomplete multipart upload, for the bucket's lifecycle rule to reap). The
  shard is encoded to memory first, so an encoding error can never complete a partial upload.

pyarrow's errors (OSError, ArrowException) are translated here into ``ShardStoreError``s that
name the shard and what to do. The methods block: the writer runs them in a thread.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import uuid
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from schemas.ids import ID_PATTERN
from schemas.shards import TRAJECTORY_SCHEMA, ShardMetadata
from shardstore.errors import ShardUnreadable, ShardWriteFailed

__all__ = [
    "RUN_PARTITIONING",
    "CommittedShard",
    "FileShardStore",
    "ShardStore",
    "filesystem_of",
    "open_shards_dataset",
]

log = logging.getLogger(__name__)

_SHARD = re.compile(
    rf"^run=(?P<run>{ID_PATTERN})/part-(?P<first>\d+)-(?P<last>\d+)(?:-[0-9a-f]+)?\.parquet$"
)
_PARTIAL = re.compile(rf"^run={ID_PATTERN}/\.part-[^/]*\.tmp$")
_RENAME_ATOMIC = frozenset({"local", "hdfs"})


@dataclass(frozen=True)
class CommittedShard:
    """A shard under its final name; the range is read from the name, no I/O."""

    path: str  # as the store's filesystem names it
    run: str
    first_seq: int
    last_seq: int


class ShardStore(Protocol):
    """The port the shard writer commits shards through."""

    def committed(self) -> list[CommittedShard]:
        """Every committed shard, of every run (temporary files excluded)."""
        ...

    def read_metadata(self, shard: CommittedShard) -> ShardMetadata:
        """The shard's footer metadata (reads the footer only)."""
        ...

    def read_seqs(self, shard: CommittedShard) -> np.ndarray:
        """The exact TRAJ sequences in the shard (reads the ``traj_seq`` column only)."""
        ...

    def write(self, table: pa.Table, metadata: ShardMetadata) -> CommittedShard:
        """Commit ``table`` as one shard: all of it visible under its final name, or nothing."""
        ...

    def remove_partial(self) -> list[str]:
        """Delete what a killed writer left half-written; return the paths removed."""
        ...

    def display(self, path: str) -> str:
        """``path`` as the user would name it (with the target's scheme), for messages."""
        ...


def _filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    try:
        return filesystem_of(uri)
    except ValueError as exc:
        raise ShardWriteFailed(f"{exc} (shards.target / TURNSTREAM_SHARDS__TARGET)") from exc


class FileShardStore:
    """Shards on any pyarrow filesystem: a directory, ``file://``, ``s3://``, ``gs://``, ..."""

    def __init__(
        self,
        uri: str,
        *,
        compression_level: int | None = None,
        filesystem: pafs.FileSystem | None = None,
    ) -> None:
        if filesystem is None:
            self.fs, self.root = _filesystem(uri)
        else:  # tests: a filesystem object with ``uri`` as the path in it
            self.fs, self.root = filesystem, uri
        self.root = self.root.rstrip("/")
        self.uri = uri.rstrip("/")
        self.compression_level = compression_level
        self.rename_commits = self.fs.type_name in _RENAME_ATOMIC
        self._local = self.fs.type_name == "local"

    def __repr__(self) -> str:
        return f"FileShardStore({self.uri!r})"

    def display(self, path: str) -> str:
        """``path`` as the user named the target: ``s3://bucket/prefix/run=r/part-….parquet``."""
        rel = path[len(self.root) :].lstrip("/") if path.startswith(self.root) else path
        return f"{self.uri}/{rel}" if rel else self.uri

    def _listing(self) -> list[str]:
        selector = pafs.FileSelector(self.root, recursive=True, allow_not_found=True)
        try:
            infos = self.fs.get_file_info(selector)
        except (OSError, pa.ArrowException) as exc:
            raise ShardUnreadable(
                f"cannot list the shards under {self.uri}: {exc}; check the target exists and "
                f"is readable (credentials, permissions)"
            ) from exc
        return [i.path for i in infos if i.type == pafs.FileType.File]

    def _relative(self, path: str) -> str:
        return path[len(self.root) :].lstrip("/")

    def committed(self) -> list[CommittedShard]:
        shards = []
        for path in self._listing():
            match = _SHARD.match(self._relative(path))
            if match:
                shards.append(
                    CommittedShard(path, match["run"], int(match["first"]), int(match["last"]))
                )
        return sorted(shards, key=lambda s: (s.first_seq, s.last_seq, s.path))

    def remove_partial(self) -> list[str]:
        removed = []
        for path in self._listing():
            if _PARTIAL.match(self._relative(path)):
                with contextlib.suppress(FileNotFoundError):
                    self.fs.delete_file(path)
                removed.append(path)
        return removed

    def _unreadable(self, shard: CommittedShard, what: str, exc: Exception) -> ShardUnreadable:
        return ShardUnreadable(
            f"committed shard {self.display(shard.path)}: cannot read its {what} ({exc}). "
            f"Its TRAJ sequences {shard.first_seq}..{shard.last_seq} cannot be checked, so "
            f"the writer stops rather than risk writing them twice: restore the file, or move "
            f"it out of {self.uri} if its trajectories should be written again"
        )

    def read_metadata(self, shard: CommittedShard) -> ShardMetadata:
        try:
            with self.fs.open_input_file(shard.path) as f:
                footer = pq.read_metadata(f)
            return ShardMetadata.from_metadata(footer.metadata)
        except (OSError, ValueError, pa.ArrowException) as exc:
            raise self._unreadable(shard, "footer", exc) from exc

    def read_seqs(self, shard: CommittedShard) -> np.ndarray:
        try:
            with self.fs.open_input_file(shard.path) as f:
                column = pq.ParquetFile(f).read(columns=["traj_seq"]).column(0)
            return np.asarray(column.to_numpy(), dtype=np.int64)
        except (OSError, KeyError, ValueError, pa.ArrowException) as exc:
            raise self._unreadable(shard, "traj_seq column", exc) from exc

    def _encode(self, table: pa.Table) -> pa.Buffer:
        sink = pa.BufferOutputStream()
        pq.write_table(
            table,
            sink,
            compression="zstd",
            compression_level=self.compression_level,
            # Dictionaries pay off for the few-valued columns only: on token ids (~150k
            # distinct) they double the write time for a few percent of size.
            use_dictionary=_DICTIONARY_COLUMNS,
            # A shard is at most max_bytes: one row group keeps whole-shard scans simple;
            # readers that stream get it row group by row group anyway.
            row_group_size=max(table.num_rows, 1),
        )
        return sink.getvalue()

    def write(self, table: pa.Table, metadata: ShardMetadata) -> CommittedShard:
        name = f"part-{metadata.first_seq:012d}-{metadata.last_seq:012d}-{uuid.uuid4().hex[:8]}"
        directory = f"{self.root}/run={metadata.run}"
        final = f"{directory}/{name}.parquet"
        target = final
        try:
            table = table.replace_schema_metadata(
                {**(table.schema.metadata or {}), **metadata.to_metadata()}
            )
            data = self._encode(table)
            self.fs.create_dir(directory, recursive=True)
            if self.rename_commits:
                target = f"{directory}/.{name}.parquet.tmp"
            with self.fs.open_output_stream(target) as out:
                out.write(data)
            if self.rename_commits:
                if self._local:
                    _fsync(target)
                self.fs.move(target, final)
        except (OSError, ValueError, pa.ArrowException) as exc:
            with contextlib.suppress(OSError, pa.ArrowException):
                self.fs.delete_file(target)
            raise ShardWriteFailed(
                f"cannot write shard {self.display(final)} ({metadata.rows} trajectories of run "
                f"{metadata.run}, TRAJ seq {metadata.first_seq}..{metadata.last_seq}): {exc}. "
                f"Nothing was acknowledged: they are redelivered once the target is writable "
                f"(space, permissions, credentials) and the shard writer runs again"
            ) from exc
        if self.rename_commits and self._local:
            self._sync_directory(directory, final)
        return CommittedShard(final, metadata.run, metadata.first_seq, metadata.last_seq)

    def _sync_directory(self, directory: str, final: str) -> None:
        # The rename is done: the shard is committed. Raising now would have the writer write
        # its rows again under another name (twice in the shards); an unsynced directory entry
        # only puts the shard at risk on power loss, not on a kill.
        try:
            _fsync(directory)
        except OSError as exc:
            log.warning(
                "shard %s is committed, but fsync of its directory failed (%s): it survives a "
                "crash of the writer, maybe not a power loss",
                self.display(final),
                exc,
            )


_DICTIONARY_COLUMNS = ["run", "group", "status", "finish_reason", "session"]


def _fsync(path: str) -> None:
    """Make a renamed file (or a directory entry) survive power loss, not only a kill -9."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


RUN_PARTITIONING = ds.partitioning(pa.schema([("run", pa.string())]), flavor="hive")
"""``run=<run>`` directories read as strings: the inferred hive partitioning would read a run
named ``123`` as an int32 and clash with the ``run`` column inside the files."""


def filesystem_of(uri: str) -> tuple[pafs.FileSystem, str]:
    """The pyarrow filesystem and root path of a shard target (a directory or a URI)."""
    if "://" not in uri:  # a plain path, relative or absolute
        return pafs.LocalFileSystem(), os.path.abspath(uri)
    try:
        fs, path = pafs.FileSystem.from_uri(uri)
    except (OSError, pa.ArrowException) as exc:
        raise ValueError(
            f"shard target {uri!r} is not a usable pyarrow filesystem URI ({exc}); use a "
            f"directory or e.g. s3://bucket/prefix"
        ) from exc
    return fs, str(path)


def open_shards_dataset(uri: str, *, filesystem: pafs.FileSystem | None = None) -> ds.Dataset:
    """All committed shards under ``uri`` as one ``pyarrow.dataset`` (filter on ``run``)."""
    fs, root = (filesystem, uri) if filesystem is not None else filesystem_of(uri)
    return ds.dataset(
        root,
        filesystem=fs,
        format="parquet",
        schema=TRAJECTORY_SCHEMA,
        partitioning=RUN_PARTITIONING,
    )
