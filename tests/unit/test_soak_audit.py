"""The chaos soak's sink audit on hand-written journals: it must see every way a commit fails."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos.audit import SinkAudit, SinkJournal, audit_sink

TRAJ = {1: "r/a/0", 2: "r/b/0", 3: "r/c/0"}


def audit(tmp_path: Path, journal: str, acked_all: bool = True) -> SinkAudit:
    path = tmp_path / "journal"
    path.write_text(journal)
    return audit_sink(TRAJ, SinkJournal.read(path), acked_all)


CLEAN = """\
started 10
delivered 1 1 r/a/0
delivered 2 1 r/b/0
committing 10-1 1,2
committed 10-1
delivered 3 1 r/c/0
committing 10-2 3
committed 10-2
"""


@pytest.mark.parametrize(
    ("journal", "acked_all", "after", "before", "never", "unconfirmed"),
    [
        pytest.param(CLEAN, True, 0, 0, [], 0, id="clean"),
        pytest.param(
            CLEAN + "started 11\ndelivered 2 2 r/b/0\ncommitting 11-1 2\ncommitted 11-1\n",
            True,
            1,
            0,
            [],
            0,
            id="delivered again after its commit",
        ),
        pytest.param(
            "delivered 1 1 r/a/0\nstarted 11\ndelivered 1 2 r/a/0\ndelivered 2 1 r/b/0\n"
            "delivered 3 1 r/c/0\ncommitting 11-1 1,2,3\ncommitted 11-1\n",
            True,
            0,
            1,
            [],
            0,
            id="killed before the commit: redelivered, then committed",
        ),
        pytest.param(
            CLEAN.replace("committed 10-2\n", ""),
            True,
            0,
            0,
            [],
            1,
            id="killed after the ack was confirmed, before the journal said so",
        ),
        pytest.param(
            CLEAN.replace("committed 10-2\n", ""),
            False,
            0,
            0,
            [3],
            0,
            id="commit never confirmed and the consumer still holds it",
        ),
        pytest.param(
            CLEAN.replace("delivered 3 1 r/c/0\ncommitting 10-2 3\ncommitted 10-2\n", ""),
            True,
            0,
            0,
            [3],
            0,
            id="never delivered",
        ),
        pytest.param(
            CLEAN.replace("committed 10-2\n", "abandoned 10-2\ndelivered 3 2 r/c/0\n")
            + "committing 10-3 3\ncommitted 10-3\n",
            True,
            0,
            1,
            [],
            0,
            id="ack abandoned, redelivered, committed",
        ),
    ],
)
def test_sink_audit(
    tmp_path: Path,
    journal: str,
    acked_all: bool,
    after: int,
    before: int,
    never: list[int],
    unconfirmed: int,
) -> None:
    result = audit(tmp_path, journal, acked_all)
    assert result.redelivered_after_commit == after
    assert result.redelivered_before_commit == before
    assert result.never_committed == never
    assert result.commit_unconfirmed == unconfirmed
    assert result.traj_messages == 3


def test_a_trajectory_id_at_two_traj_sequences_is_counted() -> None:
    result = audit_sink({**TRAJ, 4: "r/a/0"}, SinkJournal(), consumer_acked_all=True)
    assert result.traj_duplicate_ids == 1
    assert result.never_committed == [1, 2, 3, 4]


REDELIVERED = """\
delivered 1 1 r/a/0 100.000
delivered 2 1 r/b/0 100.000
delivered 3 1 r/c/0 100.000
committing 7-1 1,2,3 100.100
committed 7-1 100.200
started 8 101.000
delivered 3 1 r/c/0 103.000
"""


@pytest.mark.parametrize(
    ("nats_kills", "explained"),
    [
        pytest.param([], 0, id="no nats-server crash"),
        pytest.param([100.25], 1, id="nats-server killed right after the commit"),
        pytest.param([102.5], 0, id="nats-server killed long after the commit"),
        pytest.param([99.0], 0, id="nats-server killed before the batch"),
    ],
)
def test_a_redelivery_after_commit_is_told_apart_when_nats_server_died_just_after(
    tmp_path: Path, nats_kills: list[float], explained: int
) -> None:
    path = tmp_path / "journal"
    path.write_text(REDELIVERED)
    result = audit_sink(TRAJ, SinkJournal.read(path), True, nats_kills)
    assert result.redelivered_after_commit == 1
    assert result.redelivered_after_commit_nats_crash == explained
