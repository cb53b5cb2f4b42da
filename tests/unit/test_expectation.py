"""Reading JetStream's refusal of a stale expectation (pure)."""

from __future__ import annotations

import pytest

from eventlog import AppendRefused, Expectation
from eventlog.expectation import refusal

EXPECT = Expectation.session("run", "s", 3)


@pytest.mark.parametrize(
    ("error", "last_seq"),
    [
        ({"code": 400, "err_code": 10071, "description": "wrong last sequence: 7"}, 7),
        ({"code": 400, "err_code": 10071, "description": "wrong last sequence: 0"}, 0),
        ({"code": 400, "err_code": 10071, "description": "something else"}, None),
        ({"code": 400, "err_code": 10071}, None),
    ],
)
def test_a_wrong_last_sequence_is_an_append_refused(
    error: dict[str, object], last_seq: int | None
) -> None:
    refused = refusal(error, "run.s.turn.1", EXPECT, after_retry=True)
    assert isinstance(refused, AppendRefused)
    assert (refused.last_seq, refused.expected_seq, refused.subjects) == (
        last_seq,
        3,
        "ts.ev.run.s.*",
    )
    assert refused.after_retry
    assert "run.s.turn.1" in str(refused)


@pytest.mark.parametrize(
    "error",
    [
        {"code": 400, "err_code": 10060, "description": "expected stream does not match"},
        {"code": 503, "description": "no responders"},
    ],
)
def test_other_refusals_are_not_append_refused(error: dict[str, object]) -> None:
    assert refusal(error, "run.s.turn.1", EXPECT) is None


def test_the_headers_scope_the_check_to_the_session() -> None:
    assert EXPECT.headers() == {
        "Nats-Expected-Last-Subject-Sequence": "3",
        "Nats-Expected-Last-Subject-Sequence-Subject": "ts.ev.run.s.*",
    }
