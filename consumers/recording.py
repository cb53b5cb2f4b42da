"""A recorded run: the raw events of EVENTS and the images they name, in one portable,
self-describing file (DESIGN §9).

A zstd Parquet file, one row per stored message, in stream order, then one row per image::

    seq int64? | subject string? | stored_at timestamp[us, UTC]? | msg_id string? | data binary
    | image string?

An event row has ``image`` null and ``data`` the message's bytes exactly as the stream stored
them (no decoding, so a recording keeps what this build could not read, too). An image row
(format 2, issue 39) has ``image`` = the SHA-256 its events name it by, ``data`` its bytes from
the log's image store, and the event columns null: events name images by digest only
(``schemas.images``), so without these rows a recording would not be self-contained. The two
kinds share a file rather than sit in two: one file to copy, one footer to check, and DuckDB or
pandas tell them apart by ``image is null``.

The footer's key-value metadata says what the file is: ``turnstream.recording.format``, the
source ``stream`` and ``run``, the ``first_seq`` / ``last_seq`` / ``count`` of the event rows,
the ``since`` / ``until`` bounds asked for, and ``sha256``: the digest of every event row's
``data`` in order, each prefixed by its length (8 bytes, little endian), so a reordered, cut or
altered file is told from the one recorded. Format 2 adds ``images`` (how many image rows),
``images_sha256`` (the same digest over the image rows' ``data``) and ``images_missing``: the
digests (JSON list) that events name but the store did not hold when recorded (expired,
deleted, altered), so a replay says which events will lack theirs. Each image row's bytes must
also hash to its ``image``. Any Parquet tool lists it; ``read_recording`` checks it, and reads
format 1 (events only) as a recording with no images.

>>> import tempfile, datetime as dt
>>> rows = [RecordedEvent(3, "ts.ev.r.s.open", 1.5, "r.s.open", b"abc")]
>>> path = Path(tempfile.mkdtemp()) / "r.parquet"
>>> meta = write_recording(path, rows, stream="EVENTS", run="r")
>>> meta.count, meta.first_seq, read_recording(path).events[0].data
(1, 3, b'abc')
>>> png = b"\\x89PNG..."
>>> meta = write_recording(path, rows, stream="EVENTS", run="r", images={content_digest(png): png})
>>> recording = read_recording(path)
>>> meta.images, list(recording.images.values()) == [png], recording.meta.images_missing
(1, True, ())
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

import pyarrow as pa
import pyarrow.parquet as pq

from consumers.errors import RecordingDamaged
from schemas.codec import Codec
from schemas.errors import SchemaError
from schemas.events import TurnCompleted
from schemas.images import content_digest, image_parts, part_digest

__all__ = [
    "IMAGE_BATCH_BYTES",
    "RECORDING_FORMAT",
    "RECORDING_SCHEMA",
    "RecordedEvent",
    "Recording",
    "RecordingDamaged",
    "RecordingMeta",
    "RecordingWriter",
    "images_named",
    "read_recording",
    "write_recording",
]

RECORDING_FORMAT = 2  # 2: image rows (issue 39); 1: events only, still read
_KEY = "turnstream.recording."

_FORMAT_1_SCHEMA = pa.schema(
    [
        pa.field("seq", pa.int64(), nullable=False),
        pa.field("subject", pa.string(), nullable=False),
        pa.field("stored_at", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("msg_id", pa.string()),
        pa.field("data", pa.binary(), nullable=False),
    ]
)
RECORDING_SCHEMA = pa.schema(
    [
        # null in image rows
        pa.field("seq", pa.int64()),
        pa.field("subject", pa.string()),
        pa.field("stored_at", pa.timestamp("us", tz="UTC")),
        pa.field("msg_id", pa.string()),
        pa.field("data", pa.binary(), nullable=False),
        pa.field("image", pa.string()),  # an image row's digest; null in event rows
    ]
)
IMAGE_BATCH_BYTES = 64 * 1024 * 1024  # image bytes per row group written


class RecordedEvent(NamedTuple):
    seq: int
    subject: str
    stored_at: float  # epoch seconds, the stream's clock
    msg_id: str | None
    data: bytes


@dataclass(frozen=True)
class RecordingMeta:
    stream: str
    run: str
    first_seq: int
    last_seq: int
    count: int
    sha256: str
    since: str = ""  # ISO time asked for, or ""
    until: str = ""
    format: int = RECORDING_FORMAT
    images: int = 0  # image rows
    images_sha256: str = ""
    images_missing: tuple[str, ...] = ()  # named by events, not in the store when recorded


@dataclass(frozen=True)
class Recording:
    meta: RecordingMeta
    events: list[RecordedEvent]
    images: dict[str, bytes]  # digest -> bytes, in recorded order (format 1: none)


def images_named(data: bytes, codec: Codec) -> list[str]:
    """The digests of the images a stored message names (its ``images`` and the image parts
    of its new messages), in order; none for bytes that are no event (a recording keeps those
    unread, and cannot know their images).

    >>> images_named(b"not an event", Codec())
    []
    """
    if b"sha256" not in data:  # an image ref's key and an image part's name both hold it
        return []  # most events: not decoded (a record reads every event of a run)
    try:
        event = codec.decode(data)
    except SchemaError:
        return []
    if not isinstance(event, TurnCompleted):
        return []
    named = [ref.sha256 for ref in event.images]
    named += [d for part in image_parts(event.new_messages) if (d := part_digest(part))]
    return list(dict.fromkeys(named))


def digest(datas: Iterable[bytes]) -> str:
    """SHA-256 over each event's bytes, length-prefixed, in order."""
    h = hashlib.sha256()
    _feed(h, datas)
    return h.hexdigest()


def _feed(h: hashlib._Hash, datas: Iterable[bytes]) -> None:
    for data in datas:
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)


class RecordingWriter:
    """Writes a recording while its events arrive: ``append`` batches in stream order, then
    ``append_images`` (after the last event), then ``finish`` (the footer) or ``abort``. The
    file appears under its name only when finished (a temporary name, then rename), so a
    recording cut short never looks whole.

    The footer's values are known only at the end, so they go into the Parquet file's
    key-value metadata when it is closed (``store_schema=False``: readers then take the schema
    from the Parquet columns and that metadata, as they would for any other tool's file).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._partial = path.with_name(f".{path.name}.tmp")
        self._writer = pq.ParquetWriter(
            self._partial, RECORDING_SCHEMA, compression="zstd", store_schema=False
        )
        self._digest = hashlib.sha256()
        self._images_digest = hashlib.sha256()
        self.count = 0
        self.first_seq = 0
        self.last_seq = 0
        self.images = 0

    def append(self, events: Sequence[RecordedEvent]) -> None:
        if not events:
            return
        if self.images:
            raise ValueError("a recording's events come before its images")
        _feed(self._digest, (e.data for e in events))
        if not self.count:
            self.first_seq = events[0].seq
        self.count += len(events)
        self.last_seq = events[-1].seq
        self._writer.write_table(_events_table(events))

    def append_images(self, images: Sequence[tuple[str, bytes]]) -> None:
        """Image rows, ``(digest, bytes)``, each checked against its digest."""
        if not images:
            return
        for name, data in images:
            if content_digest(data) != name:
                raise ValueError(f"image sha256:{name}: its bytes hash to {content_digest(data)}")
        _feed(self._images_digest, (data for _, data in images))
        self.images += len(images)
        self._writer.write_table(_images_table(images))

    def finish(
        self,
        *,
        stream: str,
        run: str,
        since: dt.datetime | None = None,
        until: dt.datetime | None = None,
        images_missing: Iterable[str] = (),
    ) -> RecordingMeta:
        meta = RecordingMeta(
            stream=stream,
            run=run,
            first_seq=self.first_seq,
            last_seq=self.last_seq,
            count=self.count,
            sha256=self._digest.hexdigest(),
            since=since.isoformat() if since else "",
            until=until.isoformat() if until else "",
            images=self.images,
            images_sha256=self._images_digest.hexdigest(),
            images_missing=tuple(images_missing),
        )
        footer = {
            k: json.dumps(list(v)) if isinstance(v, tuple) else str(v)
            for k, v in asdict(meta).items()
        }
        self._writer.add_key_value_metadata({f"{_KEY}{k}": v for k, v in footer.items()})
        self._writer.close()
        os.replace(self._partial, self.path)
        return meta

    def abort(self) -> None:
        self._writer.close()
        self._partial.unlink(missing_ok=True)


def _events_table(events: Sequence[RecordedEvent]) -> pa.Table:
    return pa.table(
        {
            "seq": pa.array([e.seq for e in events], pa.int64()),
            "subject": pa.array([e.subject for e in events], pa.string()),
            # Whole microseconds (the server's nanoseconds as nats-py rounds them).
            "stored_at": pa.array([int(e.stored_at * 1e6) for e in events], pa.int64()).cast(
                pa.timestamp("us", tz="UTC")
            ),
            "msg_id": pa.array([e.msg_id for e in events], pa.string()),
            "data": pa.array([e.data for e in events], pa.binary()),
            "image": pa.nulls(len(events), pa.string()),
        },
        schema=RECORDING_SCHEMA,
    )


def _images_table(images: Sequence[tuple[str, bytes]]) -> pa.Table:
    n = len(images)
    return pa.table(
        {
            "seq": pa.nulls(n, pa.int64()),
            "subject": pa.nulls(n, pa.string()),
            "stored_at": pa.nulls(n, pa.timestamp("us", tz="UTC")),
            "msg_id": pa.nulls(n, pa.string()),
            "data": pa.array([data for _, data in images], pa.binary()),
            "image": pa.array([name for name, _ in images], pa.string()),
        },
        schema=RECORDING_SCHEMA,
    )


def write_recording(
    path: Path,
    events: Sequence[RecordedEvent],
    *,
    stream: str,
    run: str,
    since: dt.datetime | None = None,
    until: dt.datetime | None = None,
    images: Mapping[str, bytes] | None = None,
    images_missing: Iterable[str] = (),
) -> RecordingMeta:
    """Write ``events`` (stream order) and ``images`` (digest -> bytes) to ``path`` at once
    (``RecordingWriter`` in one go)."""
    writer = RecordingWriter(path)
    try:
        writer.append(events)
        writer.append_images(list((images or {}).items()))
        return writer.finish(
            stream=stream, run=run, since=since, until=until, images_missing=images_missing
        )
    except BaseException:
        writer.abort()
        raise


def _footer(path: Path, metadata: Mapping[bytes, bytes] | None) -> RecordingMeta:
    raw = {k.decode(): v.decode() for k, v in (metadata or {}).items()}
    fields = {k[len(_KEY) :]: v for k, v in raw.items() if k.startswith(_KEY)}
    try:
        meta = RecordingMeta(
            stream=fields["stream"],
            run=fields["run"],
            first_seq=int(fields["first_seq"]),
            last_seq=int(fields["last_seq"]),
            count=int(fields["count"]),
            sha256=fields["sha256"],
            since=fields.get("since", ""),
            until=fields.get("until", ""),
            format=int(fields["format"]),
            images=int(fields.get("images", "0")),
            images_sha256=fields.get("images_sha256", ""),
            images_missing=tuple(json.loads(fields.get("images_missing", "[]"))),
        )
    except (KeyError, ValueError) as exc:
        raise RecordingDamaged(
            f"{path} has no turnstream recording footer ({exc}); record it with `turnstream record`"
        ) from exc
    if meta.format > RECORDING_FORMAT:
        raise RecordingDamaged(
            f"{path} is recording format {meta.format}; this build reads <= {RECORDING_FORMAT}"
        )
    return meta


def read_recording(path: Path) -> Recording:
    """The recording at ``path``, its checksums and counts verified (else RecordingDamaged)."""
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as exc:
        raise RecordingDamaged(f"{path} is not a readable Parquet file: {exc}") from exc
    meta = _footer(path, table.schema.metadata)
    schema = RECORDING_SCHEMA if meta.format >= 2 else _FORMAT_1_SCHEMA
    if [(f.name, f.type) for f in table.schema] != [(f.name, f.type) for f in schema]:
        raise RecordingDamaged(f"{path}: columns {table.schema.names} are not a recording's")
    names: list[str | None] = (
        table.column("image").to_pylist() if meta.format >= 2 else [None] * table.num_rows
    )
    stored = table.column("stored_at").cast(pa.int64()).to_pylist()
    events: list[RecordedEvent] = []
    images: dict[str, bytes] = {}
    for seq, subject, at, msg_id, data, name in zip(
        table.column("seq").to_pylist(),
        table.column("subject").to_pylist(),
        stored,
        table.column("msg_id").to_pylist(),
        table.column("data").to_pylist(),
        names,
        strict=True,
    ):
        if name is not None:
            images[name] = data
        elif seq is None or subject is None or at is None:
            raise RecordingDamaged(f"{path}: an event row without its seq, subject or stored time")
        else:
            events.append(RecordedEvent(seq, subject, at / 1e6, msg_id, data))
    if len(events) != meta.count:
        raise RecordingDamaged(f"{path} holds {len(events)} events; its footer says {meta.count}")
    if digest(e.data for e in events) != meta.sha256:
        raise RecordingDamaged(
            f"{path}: the events' SHA-256 does not match the footer's ({meta.sha256[:12]}…): "
            f"the file was altered or damaged after it was recorded"
        )
    if meta.format >= 2:
        _check_images(path, meta, images)
    return Recording(meta, events, images)


def _check_images(path: Path, meta: RecordingMeta, images: Mapping[str, bytes]) -> None:
    if len(images) != meta.images:
        raise RecordingDamaged(
            f"{path} holds {len(images)} distinct images; its footer says {meta.images}"
        )
    if digest(images.values()) != meta.images_sha256:
        raise RecordingDamaged(
            f"{path}: the images' SHA-256 does not match the footer's "
            f"({meta.images_sha256[:12]}…): the file was altered or damaged after it was recorded"
        )
    for name, data in images.items():
        if content_digest(data) != name:
            raise RecordingDamaged(
                f"{path}: image row sha256:{name} holds bytes that hash to {content_digest(data)}"
            )
