"""The gateway's edge: strict JSON decoding and API keys (gateway.http.guard)."""

from __future__ import annotations

import json

import pytest

from gateway.errors import InvalidRequest
from gateway.http.guard import decode_json, parse_api_keys


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (b'{"group": "\\ud800"}', "lone surrogates"),
        (b'{"group": "\\udfff x"}', "lone surrogates"),
        (b'{"group": "\xed\xa0\x80"}', "not valid UTF-8"),
        (b'{"metadata": {"n": 9223372036854775808}}', r"\$\.metadata\.n is outside the 64-bit"),
        (b'{"m": [1, -9223372036854775809]}', "outside the 64-bit"),
        (b'{"value": 1e309}', "numbers finite"),
        (b'{"value": NaN}', "not valid JSON"),
        (b'{"value": Infinity}', "not valid JSON"),
        (b'{"metadata": ' + b'{"a": ' * 300 + b"1" + b"}" * 301, "deeper than 64"),
        (b"[" * 5000 + b"]" * 5000, "deeper than 64"),
        (b"{not json", "not valid JSON"),
    ],
    ids=[
        "lone-high-surrogate",
        "lone-low-surrogate",
        "invalid-utf8",
        "int-over-int64",
        "int-under-int64",
        "float-overflow",
        "nan",
        "infinity",
        "deep-metadata",
        "very-deep",
        "malformed",
    ],
)
def test_bodies_that_cannot_be_recorded_are_refused(body: bytes, error: str) -> None:
    with pytest.raises(InvalidRequest, match=error):
        decode_json(body, max_depth=64)


def test_valid_bodies_pass_untouched() -> None:
    body = b'{"a": [9223372036854775807, -9223372036854775808, "\\ud83d\\ude00", 1.5e300]}'
    assert decode_json(body, max_depth=3) == {"a": [2**63 - 1, -(2**63), "\U0001f600", 1.5e300]}
    # digits inside strings and brackets inside strings are not numbers or nesting
    assert decode_json(b'{"s": "12345678901234567890 [[[[{{{{"}', max_depth=2)["s"]


def test_the_walk_and_the_scans_find_the_same_problems() -> None:
    """Checked by walking the decoded tree within a budget of items, else by scanning the bytes
    first: either way a large body's problem is found wherever it is, and a bare value too."""
    text = "x" * 400_000  # a long context: few items, many bytes (walked)
    ids = list(range(100_000))  # token ids: an item every few bytes (scanned first)
    for body, error in [
        ({"messages": [{"content": text, "meta": {"n": 2**64}}]}, "outside the 64-bit range"),
        ({"prompt": [*ids, 2**63]}, "outside the 64-bit range"),
        ({"prompt": ids, "deep": [[[[[[1]]]]]]}, "nested deeper than 4"),
        ({"messages": [{"content": text}], "deep": [[[[[[1]]]]]]}, "nested deeper than 4"),
    ]:
        with pytest.raises(InvalidRequest, match=error):
            decode_json(json.dumps(body).encode(), max_depth=4)
    assert decode_json(json.dumps({"prompt": ids}).encode(), max_depth=4)["prompt"] == ids
    with pytest.raises(InvalidRequest, match="outside the 64-bit range"):
        decode_json(b"123456789012345678901234567890", max_depth=4)
    assert decode_json(b'"12345678901234567890"', max_depth=4) == "12345678901234567890"


def test_api_keys_are_global_or_scoped_to_runs() -> None:
    keys = parse_api_keys(["plain", "scoped=runA,run-B", "b64pad==", "odd=not a run"])
    assert keys == {
        "plain": None,
        "scoped": frozenset({"runA", "run-B"}),
        "b64pad==": None,
        "odd=not a run": None,
    }
