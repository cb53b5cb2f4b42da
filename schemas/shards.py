"""Trajectories as Arrow tables: the shard schema (DESIGN §6) and the conversions (pure).

One row per TrajectoryReady, plus ``traj_seq``, the TRAJ stream sequence the row came from. A
row holds the trajectory in its wire form (``CompactTrajectory``: ids once, generated spans).
The token columns are built for all rows at once from one concatenated buffer and an offsets
array (``pa.ListArray.from_arrays``): the per-token mask, logprobs and versions are written
into preallocated buffers at the spans' positions (vectorized over every row of the shard),
so there is no per-token Python object and no per-row expansion. ``messages``,
``metadata`` and ``tools`` are JSON text (msgspec), encoded when a row is buffered, so a row
that cannot be encoded is found before it can spoil a whole shard.

Types: ids and enums ``string``; token columns ``list<int32>`` / ``list<int8>`` /
``list<float32>``; counts and versions ``int32``; ``reward`` nullable ``float64``;
``turn_rewards`` ``list<float64>`` with null items (a turn nobody rewarded); ``created_at``
``timestamp[us, UTC]`` (the event's float seconds rounded to microseconds: readers get a real
timestamp, DuckDB and pandas included); ``images`` ``list<struct<sha256, offset, length, width,
height, mime, grid>>`` (``IMAGE_TYPE``; null in shards older than the column). JSON turns
non-string map keys into strings, so a metadata key ``1`` reads back as ``"1"``.

>>> t = TrajectoryReady(run="r", session="s", trajectory_id="r/s/0", group="g", segment=0,
...     status="completed", input_ids=[1, 2, 3], loss_mask=[0, 1, 1], logprobs=[0, -0.5, -1],
...     versions=[-1, 4, 4], prompt_len=1, turn_ends=[3], turn_rewards=[None], reward=1.0,
...     num_turns=1, finish_reason="stop", messages=[{"role": "user", "content": "hi"}],
...     metadata={}, fold_version=1)
>>> table = trajectories_to_table([(7, t)])
>>> table.column("input_ids").to_pylist(), table.column("traj_seq").to_pylist()
([[1, 2, 3]], [7])
>>> [(seq, back)] = table_to_trajectories(table)
>>> seq, back.input_ids.tolist(), back.messages
(7, [1, 2, 3], [{'role': 'user', 'content': 'hi'}])

A row whose values do not fit the schema is left out of the table, and said why:

>>> bad = msgspec.structs.replace(t, trajectory_id="r/s/1", fold_version=2**40)
>>> table, unwritable = writable_table([shard_row(7, t), shard_row(8, bad)])
>>> table.column("traj_seq").to_pylist(), unwritable[8][:45]
([7], 'fold_version 1099511627776 does not fit int32')
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import pyarrow as pa

from schemas.events import CompactTrajectory, TrajectoryReady
from schemas.images import ImageRef
from schemas.spans import token_arrays

__all__ = [
    "IMAGE_TYPE",
    "ROW_ERRORS",
    "SHARD_FORMAT",
    "TRAJECTORY_SCHEMA",
    "ShardMetadata",
    "ShardRow",
    "row_problem",
    "rows_to_table",
    "shard_row",
    "table_to_trajectories",
    "trajectories_to_table",
    "writable_table",
]

SHARD_FORMAT = 1
"""Bumped when the columns change incompatibly; stored in every shard's metadata."""


def _required(name: str, type_: pa.DataType) -> pa.Field:
    return pa.field(name, type_, nullable=False)


IMAGE_TYPE = pa.struct(
    [
        _required("sha256", pa.string()),
        _required("offset", pa.int32()),
        _required("length", pa.int32()),
        _required("width", pa.int32()),
        _required("height", pa.int32()),
        _required("mime", pa.string()),
        _required("grid", pa.list_(pa.int32())),
    ]
)
"""One ``schemas.images.ImageRef`` of a row's ``images``."""


TRAJECTORY_SCHEMA = pa.schema(
    [
        _required("trajectory_id", pa.string()),
        _required("run", pa.string()),
        _required("session", pa.string()),
        _required("group", pa.string()),
        _required("segment", pa.int32()),
        _required("status", pa.string()),
        _required("input_ids", pa.list_(pa.int32())),
        _required("loss_mask", pa.list_(pa.int8())),
        _required("logprobs", pa.list_(pa.float32())),
        _required("versions", pa.list_(pa.int32())),
        _required("prompt_len", pa.int32()),
        _required("response_len", pa.int32()),
        _required("turn_ends", pa.list_(pa.int32())),
        pa.field("reward", pa.float64(), nullable=True),
        _required("turn_rewards", pa.list_(pa.float64())),
        _required("min_weight_version", pa.int32()),
        _required("max_weight_version", pa.int32()),
        _required("num_turns", pa.int32()),
        _required("finish_reason", pa.string()),
        _required("messages", pa.string()),  # JSON: the conversation, for SFT export
        _required("metadata", pa.string()),  # JSON: the session's metadata (task, env, ...)
        _required("tools", pa.string()),  # JSON: the tool schemas the model was given, for SFT
        # The sample's images (fold v8): where each one's placeholder tokens sit in input_ids.
        # Nullable: shards written before the column read back null, as no images.
        pa.field("images", pa.list_(IMAGE_TYPE), nullable=True),
        _required("created_at", pa.timestamp("us", tz="UTC")),
        _required("fold_version", pa.int32()),
        _required("traj_seq", pa.int64()),  # TRAJ stream sequence of the row's message
    ]
)

_TOKEN_COLUMNS: tuple[tuple[str, pa.DataType], ...] = (
    ("input_ids", pa.int32()),
    ("loss_mask", pa.int8()),
    ("logprobs", pa.float32()),
    ("versions", pa.int32()),
    ("turn_ends", pa.int32()),
)
_NUMPY_DTYPE = {"input_ids": "<i4", "loss_mask": "i1", "logprobs": "<f4", "versions": "<i4"}
_NUMPY_DTYPE["turn_ends"] = "<i4"

_json = msgspec.json.Encoder()
_NO_SPANS = np.empty(0, dtype=np.int32)
_NO_LOGPROBS = np.empty(0, dtype=np.float32)
_ROW_OVERHEAD = 256  # ids, scalars and the Python objects around them, roughly


@dataclass(frozen=True, slots=True)
class ShardRow:
    """One trajectory ready for a shard.

    ``trajectory`` is the compact form and keeps its arrays (views onto the message that
    carried it) but its ``messages``, ``metadata`` and ``tools`` are emptied: they are held as
    JSON text only, which is several times smaller than the Python objects while a shard fills
    up.
    """

    traj_seq: int
    trajectory: CompactTrajectory
    messages: bytes
    metadata: bytes
    tools: bytes

    @property
    def nbytes(self) -> int:
        """What the row holds in memory, roughly: arrays, JSON text and a fixed overhead."""
        t = self.trajectory
        arrays = sum(
            a.nbytes
            for a in (t.input_ids, t.turn_ends, t.spans, t.span_versions, t.gen_logprobs)
            if a is not None
        )
        arrays += sum(a.nbytes for a in (t.loss_mask, t.logprobs, t.versions) if a is not None)
        text = len(self.messages) + len(self.metadata) + len(self.tools)
        return arrays + text + _ROW_OVERHEAD


def shard_row(traj_seq: int, trajectory: CompactTrajectory | TrajectoryReady) -> ShardRow:
    """The row of ``trajectory``; ValueError when its messages, metadata or tools are not
    JSON-able."""
    if isinstance(trajectory, TrajectoryReady):
        trajectory = trajectory.compact()
    try:
        messages = _json.encode(trajectory.messages)
        metadata = _json.encode(trajectory.metadata)
        tools = _json.encode(trajectory.tools)
    except (TypeError, msgspec.EncodeError) as exc:
        raise ValueError(
            f"trajectory {trajectory.trajectory_id}: messages/metadata/tools cannot be JSON: {exc}"
        ) from exc
    # A shallow copy, not ``structs.replace``: the sample was checked when it was decoded.
    lean = copy.copy(trajectory)
    lean.messages, lean.metadata, lean.tools = [], {}, []
    return ShardRow(traj_seq, lean, messages, metadata, tools)


def _offsets(lengths: np.ndarray) -> np.ndarray:
    """int32 list offsets of rows of ``lengths`` values; ValueError past list<>'s limit."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if offsets[-1] > np.iinfo(np.int32).max:
        raise ValueError(
            f"{offsets[-1]} list values in one column exceed list<> offsets (2^31 - 1): "
            f"lower the shard writer's max_bytes"
        )
    return offsets.astype(np.int32)


def _list_array(offsets: np.ndarray, values: np.ndarray, value_type: pa.DataType) -> pa.Array:
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=value_type))


def _list_column(arrays: Sequence[np.ndarray], value_type: pa.DataType, dtype: str) -> pa.Array:
    lengths = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(arrays))
    offsets = _offsets(lengths)
    values = np.concatenate(arrays) if arrays else np.empty(0, dtype=dtype)
    return _list_array(offsets, values.astype(dtype, copy=False), value_type)


def _token_columns(rows: Sequence[ShardRow]) -> dict[str, pa.Array]:
    """input_ids, loss_mask, logprobs and versions of every row, each as one list array.

    One concatenation of the ids; the other three start as their default (0, 0.0, -1) and the
    generated tokens are written at once for all the rows with spans (their positions shifted
    by each row's offset). Rows in the per-token form (older messages) are copied in whole.
    """
    trajectories = [r.trajectory for r in rows]
    lengths = np.fromiter((t.n_tokens for t in trajectories), dtype=np.int64, count=len(rows))
    offsets = _offsets(lengths)
    total = int(offsets[-1])
    ids = (
        np.concatenate([t.input_ids for t in trajectories])
        if trajectories
        else np.empty(0, dtype=np.int32)
    )
    spanned: list[int] = []
    spans, span_versions, gen_logprobs = [_NO_SPANS], [_NO_SPANS], [_NO_LOGPROBS]
    for i, t in enumerate(trajectories):
        if t.spans is not None:
            assert t.span_versions is not None and t.gen_logprobs is not None
            spanned.append(i)
            spans.append(t.spans)
            span_versions.append(t.span_versions)
            gen_logprobs.append(t.gen_logprobs)
    counts = np.fromiter((len(s) for s in spans[1:]), dtype=np.int64, count=len(spanned))
    shift = np.repeat(offsets[spanned].astype(np.int64), counts)  # each row's first token
    mask, logprobs, versions = token_arrays(
        total,
        np.concatenate(spans).astype(np.int64) + shift,
        np.concatenate(span_versions),
        np.concatenate(gen_logprobs),
    )
    for i, t in enumerate(trajectories):
        if t.spans is None:
            lo, hi = offsets[i], offsets[i + 1]
            mask[lo:hi], logprobs[lo:hi], versions[lo:hi] = t.token_arrays()
    return {
        "input_ids": _list_array(offsets, ids, pa.int32()),
        "loss_mask": _list_array(offsets, mask, pa.int8()),
        "logprobs": _list_array(offsets, logprobs, pa.float32()),
        "versions": _list_array(offsets, versions, pa.int32()),
    }


ROW_ERRORS: tuple[type[Exception], ...] = (
    pa.ArrowInvalid,
    pa.ArrowTypeError,
    OverflowError,
    TypeError,
    ValueError,
)
"""What ``rows_to_table`` raises when a row's values do not fit the schema (a scalar outside
int32, a ``created_at`` beyond the timestamp range, ...)."""


def _column(
    name: str, type_: pa.DataType, rows: Sequence[ShardRow], tokens: dict[str, pa.Array]
) -> pa.Array:
    if name in tokens:
        return tokens[name]
    if name == "turn_ends":
        arrays = [r.trajectory.turn_ends for r in rows]
        return _list_column(arrays, type_.value_type, _NUMPY_DTYPE[name])
    if name in ("messages", "metadata", "tools", "traj_seq"):
        return pa.array([getattr(r, name) for r in rows], type_)
    if name == "images":
        return pa.array(
            [[msgspec.structs.asdict(i) for i in r.trajectory.images] for r in rows], type_
        )
    if name == "created_at":
        micros = [round(r.trajectory.created_at * 1e6) for r in rows]
        return pa.array(np.array(micros, dtype=np.int64), type_)
    # The rest are the trajectory's own attributes (or properties) under the column's name.
    return pa.array([getattr(r.trajectory, name) for r in rows], type_)


def rows_to_table(rows: Sequence[ShardRow], metadata: ShardMetadata | None = None) -> pa.Table:
    """The rows as a table of TRAJECTORY_SCHEMA, ``metadata`` in its schema metadata.

    One of ``ROW_ERRORS`` when a value does not fit its column: ``writable_table`` then finds
    the rows at fault.
    """
    schema = TRAJECTORY_SCHEMA
    if metadata is not None:
        schema = schema.with_metadata(metadata.to_metadata())
    tokens = _token_columns(rows)
    columns = [_column(f.name, f.type, rows, tokens) for f in TRAJECTORY_SCHEMA]
    return pa.Table.from_arrays(columns, schema=schema)


def row_problem(row: ShardRow) -> str | None:
    """Why ``row`` cannot be in a shard, naming the column and the value; None when it can.

    Builds a one-row array per column: for finding the culprits once a whole table failed.
    """
    try:
        tokens = _token_columns([row])
    except ROW_ERRORS as exc:
        return f"token columns do not fit: {type(exc).__name__}: {exc}"
    for field in TRAJECTORY_SCHEMA:
        try:
            _column(field.name, field.type, [row], tokens)
        except ROW_ERRORS as exc:
            value = getattr(row.trajectory, field.name, None)
            shown = f" {value!r:.60}" if isinstance(value, int | float | str) else ""
            return f"{field.name}{shown} does not fit {field.type}: {type(exc).__name__}: {exc}"
    return None


def writable_table(rows: Sequence[ShardRow]) -> tuple[pa.Table | None, dict[int, str]]:
    """The table of the rows that fit the schema, and why each other one does not, by traj_seq.

    The rows are converted all at once; only when that fails is each tried alone, so the
    common case costs one conversion. The table is None when no row fits. Raises one of
    ``ROW_ERRORS`` when no row is at fault on its own (too many list values for one shard).
    """
    try:
        return rows_to_table(rows), {}
    except ROW_ERRORS:
        unwritable = {r.traj_seq: why for r in rows if (why := row_problem(r)) is not None}
        if not unwritable:
            raise
    rest = [r for r in rows if r.traj_seq not in unwritable]
    return (rows_to_table(rest) if rest else None), unwritable


def trajectories_to_table(
    items: Sequence[tuple[int, TrajectoryReady]], metadata: ShardMetadata | None = None
) -> pa.Table:
    """``(traj_seq, trajectory)`` pairs as a table of TRAJECTORY_SCHEMA."""
    return rows_to_table([shard_row(seq, t) for seq, t in items], metadata)


def _list_values(table: pa.Table, name: str) -> list[np.ndarray]:
    """Each row's list of column ``name`` as a numpy view (no per-token objects)."""
    column = table.column(name).combine_chunks()
    if isinstance(column, pa.ChunkedArray):  # an empty table
        column = pa.array([], column.type)
    offsets = column.offsets.to_numpy()
    values = column.values.to_numpy(zero_copy_only=False)
    return [values[offsets[i] : offsets[i + 1]] for i in range(len(column))]


def table_to_trajectories(table: pa.Table) -> list[tuple[int, TrajectoryReady]]:
    """The inverse of ``trajectories_to_table``: ``(traj_seq, trajectory)`` per row.

    Exact except ``created_at`` (microseconds) and JSON's string keys in ``metadata``.
    """
    lists = {name: _list_values(table, name) for name, _ in _TOKEN_COLUMNS}
    created = table.column("created_at").cast(pa.int64()).to_pylist()
    scalars = table.drop_columns([*lists, "created_at"]).to_pylist()
    out: list[tuple[int, TrajectoryReady]] = []
    for i, row in enumerate(scalars):
        seq = row.pop("traj_seq")
        for derived in ("response_len", "min_weight_version", "max_weight_version"):
            row.pop(derived)
        row["messages"] = msgspec.json.decode(row["messages"])
        row["metadata"] = msgspec.json.decode(row["metadata"])
        # Shards written before the column existed read back with tools null.
        row["tools"] = msgspec.json.decode(row["tools"]) if row["tools"] is not None else []
        row["images"] = [_image_ref(image) for image in row["images"] or ()]
        arrays = {name: lists[name][i] for name in lists}
        out.append(
            (seq, TrajectoryReady(**row, **arrays, created_at=created[i] / 1e6))  # type: ignore[arg-type]
        )
    return out


def _image_ref(image: dict[str, Any]) -> ImageRef:
    return ImageRef(**{**image, "grid": tuple(image["grid"])})


_KEY = "turnstream."


@dataclass(frozen=True)
class ShardMetadata:
    """What a shard's Parquet footer says about it (its Arrow schema metadata).

    ``stream`` and ``stream_created`` identify the TRAJ stream the sequences belong to: a
    stream deleted and made again restarts at sequence 1, and its sequences must not be taken
    for the old one's.
    """

    run: str
    stream: str
    stream_created: str
    first_seq: int
    last_seq: int
    rows: int
    fold_versions: tuple[int, ...]
    format: int = SHARD_FORMAT

    def to_metadata(self) -> dict[bytes, bytes]:
        fields: dict[str, Any] = {
            "shard_format": self.format,
            "run": self.run,
            "stream": self.stream,
            "stream_created": self.stream_created,
            "traj_first_seq": self.first_seq,
            "traj_last_seq": self.last_seq,
            "rows": self.rows,
            "fold_versions": ",".join(map(str, self.fold_versions)),
        }
        return {f"{_KEY}{k}".encode(): str(v).encode() for k, v in fields.items()}

    @classmethod
    def from_metadata(cls, metadata: dict[bytes, bytes] | None) -> ShardMetadata:
        """Read it back; ValueError when a key is missing or malformed."""
        meta = {
            k.decode()[len(_KEY) :]: v.decode()
            for k, v in (metadata or {}).items()
            if k.startswith(_KEY.encode())
        }
        try:
            versions = meta["fold_versions"]
            return cls(
                run=meta["run"],
                stream=meta["stream"],
                stream_created=meta["stream_created"],
                first_seq=int(meta["traj_first_seq"]),
                last_seq=int(meta["traj_last_seq"]),
                rows=int(meta["rows"]),
                fold_versions=tuple(int(v) for v in versions.split(",")) if versions else (),
                format=int(meta["shard_format"]),
            )
        except (KeyError, ValueError) as exc:
            raise ValueError(f"not turnstream shard metadata ({exc!r})") from exc

    @classmethod
    def of_rows(
        cls, rows: Sequence[ShardRow], *, run: str, stream: str, stream_created: str
    ) -> ShardMetadata:
        seqs = [r.traj_seq for r in rows]
        return cls(
            run=run,
            stream=stream,
            stream_created=stream_created,
            first_seq=min(seqs),
            last_seq=max(seqs),
            rows=len(rows),
            fold_versions=tuple(sorted({r.trajectory.fold_version for r in rows})),
        )
