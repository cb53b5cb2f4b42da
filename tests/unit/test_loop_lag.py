"""The event loop's lag probe (issue 40, point 1): a loop held by blocking work shows as lag in
the histogram and the window's maximum; an idle loop shows ~none."""

from __future__ import annotations

import asyncio
import time

from gateway.loop_lag import LoopLagProbe
from gateway.metrics import GatewayMetrics


def sample(metrics: GatewayMetrics, name: str, labels: dict[str, str] | None = None) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    assert value is not None, name
    return value


async def test_a_held_loop_is_measured_as_lag() -> None:
    metrics = GatewayMetrics()
    probe = asyncio.create_task(LoopLagProbe(metrics, interval_s=0.005).run())
    try:
        await asyncio.sleep(0.1)  # idle: wakes on time
        quiet = sample(metrics, "turnstream_gateway_event_loop_lag_max_seconds")
        time.sleep(0.2)  # noqa: ASYNC251  # blocking work on the loop: what the probe sees
        await asyncio.sleep(0.05)
    finally:
        probe.cancel()
    held = sample(metrics, "turnstream_gateway_event_loop_lag_max_seconds")
    assert held >= 0.19 and held > quiet
    slow = sample(metrics, "turnstream_gateway_event_loop_lag_seconds_count") - sample(
        metrics, "turnstream_gateway_event_loop_lag_seconds_bucket", {"le": "0.1"}
    )
    assert slow >= 1  # the wake 200 ms late (a loaded machine may add others)
