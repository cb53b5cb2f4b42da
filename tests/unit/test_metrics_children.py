"""The turn path's labelled counters (gateway.metrics.Labelled): each value's child made once,
its counts where a scrape reads them, as ``labels()`` would put them."""

from __future__ import annotations

from gateway.metrics import GatewayMetrics


def test_labelled_children_count_where_labels_would() -> None:
    metrics = GatewayMetrics()
    for kind in ("chat", "chat", "messages"):
        metrics.turns_of(kind).inc()
    metrics.attached_as("continued").inc(2)
    metrics.attached.labels("continued").inc()  # the same child, either way
    assert metrics.turns_of("chat") is metrics.turns.labels("chat")
    read = metrics.registry.get_sample_value
    assert read("turnstream_gateway_turns_total", {"kind": "chat"}) == 2
    assert read("turnstream_gateway_turns_total", {"kind": "messages"}) == 1
    assert read("turnstream_gateway_turn_attachments_total", {"how": "continued"}) == 3
    assert read("turnstream_gateway_turn_attachments_total", {"how": "new"}) is None
