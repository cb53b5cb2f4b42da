"""A recorded run: the raw events of EVENTS in one portable, self-describing file (DESIGN §9).

A zstd Parquet file, one row per stored message, in stream order::

    seq int64 | subject string | stored_at timestamp[us, UTC] | msg_id string? | data binary

``data`` is the message's bytes exactly as the stream stored them (no decoding, so a recording
keeps what this build could not read, too). The footer's key-value metadata says what the file
is: ``turnstream.recording.format``, the source ``stream`` and ``run``, the ``first_seq`` /
``last_seq`` / ``count`` of the rows, the ``since`` / ``until`` bounds asked for, and ``sha256``:
the digest of every row's ``data`` in order, each prefixed by its length (8 bytes, little
endian), so a reordered, cut or altered file is told from the one recorded. Any Parquet tool
lists it; ``read_recording`` checks it.

>>> import tempfile, datetime as dt
>>> rows = [RecordedEvent(3, "ts.ev.r.s.open", 1.5, "r.s.open", b"abc")]
>>> path = Path(tempfile.mkdtemp()) / "r.parquet"
>>> meta = write_recording(path, rows, stream="EVENTS", run="r")
>>> meta.count, meta.first_seq, read_recording(path).events[0].data
(1, 3, b'abc')
"""

from __future__ import annotations

import datetime as dt
import hashlib
import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

import pyarrow as pa
import pyarrow.parquet as pq

from consumers.errors import RecordingDamaged

__all__ = [
    "RECORDING_FORMAT",
    "RECORDING_SCHEMA",
    "RecordedEvent",
    "Recording",
    "RecordingDamaged",
    "RecordingMeta",
    "RecordingWriter",
    "read_recording",
    "write_recording",
]

RECORDING_FORMAT = 1
_KEY = "turnstream.recording."

RECORDING_SCHEMA = pa.schema(
    [
        pa.field("seq", pa.int64(), nullable=False),
        pa.field("subject", pa.string(), nullable=False),
        pa.field("stored_at", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("msg_id", pa.string()),
        pa.field("data", pa.binary(), nullable=False),
    ]
)


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


@dataclass(frozen=True)
class Recording:
    meta: RecordingMeta
    events: list[RecordedEvent]


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
    ``finish`` (the footer) or ``abort``. The file appears under its name only when finished
    (a temporary name, then rename), so a recording cut short never looks whole.

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
        self.count = 0
        self.first_seq = 0
        self.last_seq = 0

    def append(self, events: Sequence[RecordedEvent]) -> None:
        if not events:
            return
        _feed(self._digest, (e.data for e in events))
        if not self.count:
            self.first_seq = events[0].seq
        self.count += len(events)
        self.last_seq = events[-1].seq
        self._writer.write_table(_events_table(events))

    def finish(
        self,
        *,
        stream: str,
        run: str,
        since: dt.datetime | None = None,
        until: dt.datetime | None = None,
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
        )
        self._writer.add_key_value_metadata({f"{_KEY}{k}": str(v) for k, v in asdict(meta).items()})
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
) -> RecordingMeta:
    """Write ``events`` (stream order) to ``path`` at once (``RecordingWriter`` in one go)."""
    writer = RecordingWriter(path)
    try:
        writer.append(events)
        return writer.finish(stream=stream, run=run, since=since, until=until)
    except BaseException:
        writer.abort()
        raise


def read_recording(path: Path) -> Recording:
    """The recording at ``path``, its checksum and counts verified (else RecordingDamaged)."""
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as exc:
        raise RecordingDamaged(f"{path} is not a readable Parquet file: {exc}") from exc
    raw = {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()}
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
        )
    except (KeyError, ValueError) as exc:
        raise RecordingDamaged(
            f"{path} has no turnstream recording footer ({exc}); record it with `turnstream record`"
        ) from exc
    if meta.format > RECORDING_FORMAT:
        raise RecordingDamaged(
            f"{path} is recording format {meta.format}; this build reads <= {RECORDING_FORMAT}"
        )
    if [(f.name, f.type) for f in table.schema] != [(f.name, f.type) for f in RECORDING_SCHEMA]:
        raise RecordingDamaged(f"{path}: columns {table.schema.names} are not a recording's")
    stored = table.column("stored_at").cast(pa.int64()).to_pylist()
    events = [
        RecordedEvent(seq, subject, at / 1e6, msg_id, data)
        for seq, subject, at, msg_id, data in zip(
            table.column("seq").to_pylist(),
            table.column("subject").to_pylist(),
            stored,
            table.column("msg_id").to_pylist(),
            table.column("data").to_pylist(),
            strict=True,
        )
    ]
    if len(events) != meta.count:
        raise RecordingDamaged(f"{path} holds {len(events)} events; its footer says {meta.count}")
    if digest(e.data for e in events) != meta.sha256:
        raise RecordingDamaged(
            f"{path}: the events' SHA-256 does not match the footer's ({meta.sha256[:12]}…): "
            f"the file was altered or damaged after it was recorded"
        )
    return Recording(meta, events)
