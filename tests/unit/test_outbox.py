"""The fsynced outbox on real files: reopen, torn tails, corruption, the cursor, the byte limit."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest

from eventlog.outbox import Outbox, OutboxRecord
from schemas.errors import OutboxFull

LIMIT = 1 << 20
HEADER = 8  # <u32 length><u32 crc32>

RECORDS = [
    OutboxRecord("ts.ev.r.s.open", "r.s.open", b"\x81\xa4type\xabSessionOpened"),
    OutboxRecord("ts.ev.r.s.turn", "r.s.turn.0", bytes(range(256)) * 3),
    OutboxRecord("ts.ev.r.s.close", "r.s.close", b""),
]


def record_size(record: OutboxRecord) -> int:
    return HEADER + len(msgspec.msgpack.encode(list(record)))


def ends(records: list[OutboxRecord]) -> list[int]:
    """File offset just past each record when ``records`` are appended to an empty outbox."""
    offsets, end = [], 0
    for record in records:
        end += record_size(record)
        offsets.append(end)
    return offsets


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "spool" / "outbox.bin"


@pytest.fixture
def open_outbox(path: Path) -> Iterator[Callable[..., Outbox]]:
    """Opens ``path`` as an Outbox (again and again, as a restart would); closes them all."""
    opened: list[Outbox] = []

    def reopen(max_bytes: int = LIMIT) -> Outbox:
        outbox = Outbox(path, max_bytes)
        opened.append(outbox)
        return outbox

    yield reopen
    for outbox in opened:
        outbox.close()


def spooled(open_outbox: Callable[..., Outbox], records: list[OutboxRecord]) -> None:
    outbox = open_outbox()
    for record in records:
        outbox.append(record)
    outbox.close()


def pending(outbox: Outbox) -> list[OutboxRecord]:
    return [record for _, record in outbox.pending()]


def test_records_come_back_in_order_with_exact_bytes_after_reopen(
    path: Path, open_outbox: Callable[..., Outbox]
) -> None:
    spooled(open_outbox, RECORDS)

    outbox = open_outbox()

    assert pending(outbox) == RECORDS
    assert [type(r.payload) for r in pending(outbox)] == [bytes] * 3
    assert [end for end, _ in outbox.pending()] == ends(RECORDS)
    assert path.stat().st_size == ends(RECORDS)[-1] == outbox.pending_bytes
    assert len(outbox) == 3


def test_an_append_is_on_disk_before_it_returns(
    path: Path, open_outbox: Callable[..., Outbox]
) -> None:
    outbox = open_outbox()
    outbox.append(RECORDS[0])

    assert path.stat().st_size == record_size(RECORDS[0])
    assert pending(open_outbox()) == RECORDS[:1]


@pytest.mark.parametrize(
    "kept_of_third",
    [
        pytest.param(3, id="cut-in-header"),
        pytest.param(HEADER + 5, id="cut-in-body"),
        pytest.param(record_size(RECORDS[2]) - 1, id="last-byte-missing"),
    ],
)
def test_a_torn_third_record_is_cut_on_reopen(
    path: Path, open_outbox: Callable[..., Outbox], kept_of_third: int
) -> None:
    spooled(open_outbox, RECORDS)
    os.truncate(path, ends(RECORDS)[1] + kept_of_third)

    outbox = open_outbox()

    assert pending(outbox) == RECORDS[:2]
    assert path.stat().st_size == ends(RECORDS)[1]
    outbox.append(RECORDS[2])
    assert pending(open_outbox()) == RECORDS


@pytest.mark.parametrize(
    "garbage",
    [
        pytest.param(b"\x07", id="one-byte"),
        pytest.param(b"\x00" * 7, id="half-header"),
        pytest.param(b"\xff\xff\xff\x7f\x00\x00\x00\x00rest", id="huge-length"),
        pytest.param(b"\x04\x00\x00\x00\x00\x00\x00\x00abcd", id="whole-record-bad-crc"),
    ],
)
def test_garbage_after_the_last_record_is_cut_on_reopen(
    path: Path, open_outbox: Callable[..., Outbox], garbage: bytes
) -> None:
    spooled(open_outbox, RECORDS)
    with path.open("ab") as f:
        f.write(garbage)

    outbox = open_outbox()

    assert pending(outbox) == RECORDS
    assert path.stat().st_size == ends(RECORDS)[-1]


@pytest.mark.parametrize(
    "offset_in_record",
    [
        pytest.param(4, id="crc-field"),
        pytest.param(HEADER + 10, id="body-byte"),
    ],
)
def test_a_corrupt_record_stops_the_scan_there(
    path: Path, open_outbox: Callable[..., Outbox], offset_in_record: int
) -> None:
    spooled(open_outbox, RECORDS)
    data = bytearray(path.read_bytes())
    data[ends(RECORDS)[0] + offset_in_record] ^= 0xFF
    path.write_bytes(bytes(data))

    outbox = open_outbox()

    assert pending(outbox) == RECORDS[:1]
    assert path.stat().st_size == ends(RECORDS)[0]


def test_advance_persists_across_reopen(path: Path, open_outbox: Callable[..., Outbox]) -> None:
    spooled(open_outbox, RECORDS)
    outbox = open_outbox()
    first_end, first = next(outbox.pending())
    assert first == RECORDS[0]

    outbox.advance(first_end)
    assert pending(outbox) == RECORDS[1:]
    outbox.close()
    reopened = open_outbox()

    assert pending(reopened) == RECORDS[1:]
    assert len(reopened) == 2
    assert reopened.pending_bytes == ends(RECORDS)[-1] - first_end
    assert path.stat().st_size == ends(RECORDS)[-1]  # advancing never rewrites the spool


def test_records_appended_after_a_partial_drain_follow_the_cursor(
    open_outbox: Callable[..., Outbox],
) -> None:
    outbox = open_outbox()
    outbox.append(RECORDS[0])
    outbox.append(RECORDS[1])
    outbox.advance(ends(RECORDS)[0])
    outbox.append(RECORDS[2])
    outbox.close()

    assert pending(open_outbox()) == RECORDS[1:]


def test_reset_if_drained_keeps_the_file_while_records_are_pending(
    path: Path, open_outbox: Callable[..., Outbox]
) -> None:
    outbox = open_outbox()
    for record in RECORDS:
        outbox.append(record)
    outbox.advance(ends(RECORDS)[1])

    assert outbox.reset_if_drained() is False
    assert path.stat().st_size == ends(RECORDS)[-1]
    assert pending(outbox) == RECORDS[2:]


def test_reset_if_drained_truncates_once_everything_is_drained(
    path: Path, open_outbox: Callable[..., Outbox]
) -> None:
    outbox = open_outbox()
    for record in RECORDS:
        outbox.append(record)
    outbox.advance(ends(RECORDS)[-1])

    assert outbox.reset_if_drained() is True
    assert path.stat().st_size == 0
    assert outbox.pending_bytes == 0 and pending(outbox) == []

    outbox.append(RECORDS[1])
    assert path.stat().st_size == record_size(RECORDS[1])
    outbox.close()
    assert pending(open_outbox()) == RECORDS[1:2]


def test_reset_if_drained_on_an_empty_outbox(
    path: Path, open_outbox: Callable[..., Outbox]
) -> None:
    outbox = open_outbox()

    assert outbox.reset_if_drained() is True
    assert path.stat().st_size == 0


def test_a_cursor_left_past_a_reset_spool_does_not_hide_later_records(
    path: Path, open_outbox: Callable[..., Outbox]
) -> None:
    """A crash between reset_if_drained's truncate and its cursor write.

    The spool is empty but the cursor file still holds the old end. Records spooled after the
    restart (each acknowledged to its caller as durable) must all be drained after the next
    restart, not skipped because the stale cursor points into them.
    """
    outbox = open_outbox()
    for record in RECORDS:
        outbox.append(record)
    outbox.advance(ends(RECORDS)[-1])
    outbox.close()
    os.truncate(path, 0)  # the truncate reached the disk; the process died before advance(0)

    restarted = open_outbox()
    later = [OutboxRecord("ts.ev.r.s2.turn", f"r.s2.turn.{i}", b"x" * 300) for i in range(4)]
    for record in later:
        restarted.append(record)
    restarted.close()

    assert pending(open_outbox()) == later


def test_outbox_full_names_path_msg_id_and_limit_and_writes_nothing(
    path: Path, open_outbox: Callable[..., Outbox]
) -> None:
    limit = ends(RECORDS)[1] + record_size(RECORDS[2]) - 1
    outbox = open_outbox(max_bytes=limit)
    outbox.append(RECORDS[0])
    outbox.append(RECORDS[1])

    with pytest.raises(OutboxFull) as caught:
        outbox.append(RECORDS[2])

    message = str(caught.value)
    assert str(path) in message and "r.s.close" in message and f"{limit}-byte limit" in message
    assert path.stat().st_size == ends(RECORDS)[1]
    assert pending(outbox) == RECORDS[:2]
    outbox.close()
    assert pending(open_outbox(max_bytes=limit)) == RECORDS[:2]


def test_a_record_that_exactly_fills_the_limit_is_accepted(
    path: Path, open_outbox: Callable[..., Outbox]
) -> None:
    outbox = open_outbox(max_bytes=ends(RECORDS)[-1])
    for record in RECORDS:
        outbox.append(record)

    assert path.stat().st_size == ends(RECORDS)[-1]
    with pytest.raises(OutboxFull):
        outbox.append(RECORDS[0])


def test_draining_frees_room_only_after_reset(open_outbox: Callable[..., Outbox]) -> None:
    outbox = open_outbox(max_bytes=ends(RECORDS)[-1])
    for record in RECORDS:
        outbox.append(record)
    outbox.advance(ends(RECORDS)[-1])

    with pytest.raises(OutboxFull):
        outbox.append(RECORDS[0])
    assert outbox.reset_if_drained()
    outbox.append(RECORDS[0])
    assert pending(outbox) == RECORDS[:1]
