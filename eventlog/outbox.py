"""A bounded, append-only, fsynced file of events the log could not take in time.

Each record is ``<u32 length><u32 crc32><msgpack [subject, msg_id, payload]>``. An append
returns only after fsync, so a spooled event is as durable as a JetStream ack. A torn tail (a
crash mid-append, never acknowledged) is cut off on open. Draining publishes records in file
order with their original Msg-Id and records progress in a cursor file, so a crash mid-drain
resumes where it stopped; a record sent twice is absorbed by the stream's duplicate window.
The file is truncated once everything in it has been acknowledged by the log.
"""

from __future__ import annotations

import logging
import os
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, NamedTuple

import msgspec

from schemas.errors import OutboxFull

__all__ = ["Outbox", "OutboxRecord"]

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<II")


class OutboxRecord(NamedTuple):
    subject: str
    msg_id: str
    payload: bytes


class Outbox:
    """The spool file at ``path`` (and its cursor at ``path.cursor``)."""

    def __init__(self, path: Path, max_bytes: int) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        self._cursor_path = self.path.with_name(self.path.name + ".cursor")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("ab")
        self._end = self._recover()
        self._cursor = self._read_cursor()
        if self._cursor > self._end:
            # The file was truncated after a drain but the cursor was not reset (a crash in
            # between): a stale cursor would hide every record appended from now on.
            self.advance(0)

    @property
    def pending_bytes(self) -> int:
        return self._end - self._cursor

    def __len__(self) -> int:
        """Number of records not yet drained (reads the file: for stats, not hot paths)."""
        return sum(1 for _ in self.pending())

    def _recover(self) -> int:
        """Length of the valid prefix of the file; a torn or corrupt tail is truncated."""
        valid = 0
        with self.path.open("rb") as f:
            for end, _ in _records(f, 0):
                valid = end
        size = self.path.stat().st_size
        if valid != size:
            log.warning("outbox %s: cutting %d bytes of torn tail", self.path, size - valid)
            os.truncate(self.path, valid)
            self._fsync_dir()
        return valid

    def _read_cursor(self) -> int:
        try:
            return int(self._cursor_path.read_text().strip() or 0)
        except (FileNotFoundError, ValueError):
            return 0

    def append(self, record: OutboxRecord) -> None:
        """Durably append ``record`` (fsync), or raise OutboxFull."""
        body = msgspec.msgpack.encode(list(record))
        size = _HEADER.size + len(body)
        if self._end + size > self.max_bytes:
            raise OutboxFull(
                f"outbox {self.path} holds {self._end} bytes; {record.msg_id} ({size} bytes) "
                f"would pass its {self.max_bytes}-byte limit while the log is unavailable"
            )
        self._file.write(_HEADER.pack(len(body), zlib.crc32(body)) + body)
        self._file.flush()
        os.fsync(self._file.fileno())
        self._end += size

    def pending(self) -> Iterator[tuple[int, OutboxRecord]]:
        """Undrained records in order, each with the file offset just past it."""
        with self.path.open("rb") as f:
            for end, body in _records(f, self._cursor):
                if end > self._end:
                    return
                subject, msg_id, payload = msgspec.msgpack.decode(body)
                yield end, OutboxRecord(subject, msg_id, payload)

    def advance(self, offset: int) -> None:
        """Mark everything before ``offset`` as acknowledged by the log."""
        self._cursor = offset
        tmp = self._cursor_path.with_suffix(".tmp")
        tmp.write_text(str(offset))
        with tmp.open("rb") as f:
            os.fsync(f.fileno())
        tmp.replace(self._cursor_path)

    def reset_if_drained(self) -> bool:
        """Truncate the file once every record is drained; True if it is now empty."""
        if self._cursor < self._end:
            return False
        if self._end:
            # Cursor first: a crash between the two re-drains records (deduplicated by their
            # Msg-Id) rather than hiding new ones behind a stale cursor.
            self.advance(0)
            self._file.truncate(0)
            os.fsync(self._file.fileno())
            self._end = 0
        return True

    def close(self) -> None:
        self._file.close()

    def _fsync_dir(self) -> None:
        fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _records(f: BinaryIO, start: int) -> Iterator[tuple[int, bytes]]:
    """(end offset, body) of each intact record from ``start``; stops at the first bad one."""
    f.seek(start)
    offset = start
    while True:
        header = f.read(_HEADER.size)
        if len(header) < _HEADER.size:
            return
        length, crc = _HEADER.unpack(header)
        body = f.read(length)
        if len(body) < length or zlib.crc32(body) != crc:
            return
        offset += _HEADER.size + length
        yield offset, body
