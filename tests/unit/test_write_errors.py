"""The supervisor's reading of nats-server's log for a critical write error (a full disk): only
what the log gains from now on, whole lines, across the log's growth in pieces."""

from __future__ import annotations

from pathlib import Path

from eventlog.server.supervisor import WriteErrors

ERROR = (
    "[1] 2026/11/29 23:38:16.579284 [ERR] Filestore [EVENTS] Critical write error: write "
    "/data/nats/jetstream/$G/streams/EVENTS/msgs/1.blk: no space left on device"
)


def test_only_what_the_log_gains_counts(tmp_path: Path) -> None:
    log = tmp_path / "nats-server.log"
    log.write_text(ERROR + "\n[1] [INF] Server is ready\n")  # before a restart: over
    errors = WriteErrors(log)
    assert errors.seen() is None
    with log.open("a") as out:
        out.write("[1] [INF] something else\n")
    assert errors.seen() is None
    with log.open("a") as out:
        out.write(ERROR[:40])  # a line half written when the supervisor looks
    assert errors.seen() is None
    with log.open("a") as out:
        out.write(ERROR[40:] + "\n")
    assert errors.seen() == ERROR
    assert errors.seen() is None  # said once


def test_skip_forgets_and_a_new_log_is_read_from_its_start(tmp_path: Path) -> None:
    log = tmp_path / "nats-server.log"
    log.write_text("")
    errors = WriteErrors(log)
    with log.open("a") as out:
        out.write(ERROR + "\n[1] [INF] Server is ready\n")
    errors.skip()  # a restart ended it
    assert errors.seen() is None
    log.write_text(ERROR + "\n")  # a new, shorter file (rotated by an operator)
    assert errors.seen() == ERROR


def test_a_missing_log_is_no_error(tmp_path: Path) -> None:
    assert WriteErrors(tmp_path / "absent.log").seen() is None
