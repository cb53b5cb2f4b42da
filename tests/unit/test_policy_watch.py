"""The pure half of following PolicyUpdated: parsing a bucket value, deciding what to do."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.backends.policy_watch import decide
from schemas.policy import PolicyUpdate, encode_policy_update, parse_policy_update


def test_parses_version_and_checkpoint() -> None:
    raw = b'{"version": 3, "checkpoint": "/ckpt/step-300", "extra": "ignored"}'
    assert parse_policy_update(raw) == PolicyUpdate(3, Path("/ckpt/step-300"))


@pytest.mark.parametrize("raw", [b'{"version": 3}', b'{"version": 3, "checkpoint": null}'])
def test_an_entry_may_name_no_checkpoint(raw: bytes) -> None:
    """The trainer updated its inference servers itself (verl): only the version travels."""
    assert parse_policy_update(raw) == PolicyUpdate(3, None)
    assert encode_policy_update(PolicyUpdate(3)) == b'{"version": 3}'


@pytest.mark.parametrize(
    ("raw", "complaint"),
    [
        (b"{not json", "not JSON"),
        (b"\xff\xfe", "not JSON"),
        (b"[1, 2]", "JSON object"),
        (b'{"checkpoint": "/c"}', '"version"'),
        (b'{"version": "3", "checkpoint": "/c"}', '"version"'),
        (b'{"version": true, "checkpoint": "/c"}', '"version"'),
        (b'{"version": -1, "checkpoint": "/c"}', '"version"'),
        (b'{"version": 3, "checkpoint": 7}', '"checkpoint"'),
        (b'{"version": 3, "checkpoint": ""}', '"checkpoint"'),
    ],
)
def test_rejects_malformed_values(raw: bytes, complaint: str) -> None:
    with pytest.raises(ValueError, match=complaint):
        parse_policy_update(raw)


@pytest.mark.parametrize(
    ("current", "version", "decision"),
    [(0, 1, "load"), (4, 9, "load"), (4, 4, "ignore"), (4, 3, "ignore")],
)
def test_only_newer_versions_are_loaded(current: int, version: int, decision: str) -> None:
    assert decide(current, PolicyUpdate(version, Path("/c"))) == decision
