"""The sink refuses settings under which a live batch could never fill."""

from __future__ import annotations

import pytest

from trainer_sink import BatchingSettings, LiveSource, LiveSourceSettings, TrainerSink


def test_a_batch_larger_than_the_live_flow_window_is_refused() -> None:
    source = LiveSource(
        js=None, publisher=None, settings=LiveSourceSettings(max_ack_pending=64, fetch_batch=64)
    )  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_ack_pending=64"):
        TrainerSink(source, BatchingSettings(policy="groups", group_size=16, batch_size=8))
    TrainerSink(source, BatchingSettings(policy="groups", group_size=8, batch_size=8))
    TrainerSink(source, BatchingSettings(policy="tokens", token_budget=10**9))
