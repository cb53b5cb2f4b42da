"""The fleet benchmark's reading of the gateway's loop-lag histogram
(``benchmarks/fleet_one_gateway.py``): a quantile between two scrapes, interpolated within its
bucket, and the highest bucket that grew."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from fleet_one_gateway import highest_bucket, lag_buckets, quantile

INF = float("inf")


def scrape(counts: dict[str, int]) -> str:
    lines = ["# TYPE turnstream_gateway_event_loop_lag_seconds histogram"]
    lines += [
        f'turnstream_gateway_event_loop_lag_seconds_bucket{{le="{le}"}} {n}.0'
        for le, n in counts.items()
    ]
    lines.append("turnstream_gateway_event_loop_lag_seconds_count 0.0")
    return "\n".join(lines)


def test_the_quantile_of_what_grew_between_scrapes() -> None:
    before = lag_buckets(scrape({"0.001": 50, "0.01": 50, "0.1": 50, "+Inf": 50}))
    # 100 wakes since: 90 under 1 ms, 8 in (1, 10] ms, 2 in (10, 100] ms.
    after = lag_buckets(scrape({"0.001": 140, "0.01": 148, "0.1": 150, "+Inf": 150}))
    assert list(after) == [0.001, 0.01, 0.1, INF]
    assert quantile(before, after, 0.5) == pytest.approx(0.001 * 50 / 90)
    assert quantile(before, after, 0.99) == pytest.approx(0.01 + 0.09 * 0.5)
    assert highest_bucket(before, after) == 0.1


def test_a_quantile_past_the_last_bound_reads_that_bound() -> None:
    before = lag_buckets(scrape({"0.001": 0, "5.0": 0, "+Inf": 0}))
    after = lag_buckets(scrape({"0.001": 1, "5.0": 1, "+Inf": 3}))
    assert quantile(before, after, 0.99) == 5.0
    assert highest_bucket(before, after) == 5.0  # a stall over 5 s: at least that
    assert quantile(after, after, 0.99) == 0.0  # nothing counted between them
