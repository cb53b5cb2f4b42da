"""Publisher retry arithmetic and the dedup-window check that keeps retries exactly-once."""

from __future__ import annotations

from typing import Any

import pydantic
import pytest

from eventlog.config import LogSettings, PublisherSettings, StreamNames, check_retry_horizon


@pytest.mark.parametrize(
    ("knobs", "horizon"),
    [
        pytest.param({}, 4 * 2.0 + 0.05 + 0.1 + 0.2, id="defaults"),
        pytest.param({"max_attempts": 1, "ack_timeout_s": 3.0}, 3.0, id="one-try-no-backoff"),
        pytest.param(
            {"max_attempts": 3, "ack_timeout_s": 1.0, "backoff_initial_s": 0.5},
            3 * 1.0 + 0.5 + 1.0,
            id="uncapped-doubling",
        ),
        pytest.param(
            {
                "max_attempts": 5,
                "ack_timeout_s": 1.0,
                "backoff_initial_s": 1.0,
                "backoff_max_s": 2.0,
            },
            5 * 1.0 + 1.0 + 2.0 + 2.0 + 2.0,
            id="capped",
        ),
        pytest.param(
            {"max_attempts": 4, "ack_timeout_s": 0.5, "backoff_initial_s": 0.0, "backoff_max_s": 0},
            4 * 0.5,
            id="no-backoff",
        ),
        pytest.param(
            {"max_attempts": 10, "ack_timeout_s": 2.0, "backoff_initial_s": 0.1},
            10 * 2.0 + 0.1 + 0.2 + 0.4 + 0.8 + 1.0 * 5,
            id="caps-at-default-max",
        ),
    ],
)
def test_retry_horizon(knobs: dict[str, Any], horizon: float) -> None:
    assert PublisherSettings(**knobs).retry_horizon_s == pytest.approx(horizon)


# ack 2 s x 3 tries + 0.5 s + 1 s of backoff: a horizon of exactly 7.5 s
PUBLISHER = PublisherSettings(
    max_attempts=3, ack_timeout_s=2.0, backoff_initial_s=0.5, backoff_max_s=1.0
)


@pytest.mark.parametrize(
    "window",
    [pytest.param(7.5, id="equal"), pytest.param(5.0, id="shorter"), pytest.param(0.1, id="tiny")],
)
def test_check_retry_horizon_rejects_a_window_not_longer_than_the_horizon(window: float) -> None:
    with pytest.raises(ValueError) as caught:
        check_retry_horizon(LogSettings(duplicate_window_s=window), PUBLISHER)

    assert f"duplicate_window_s={window}s" in str(caught.value)
    assert "7.5s" in str(caught.value)


@pytest.mark.parametrize(
    ("window", "publisher"),
    [
        pytest.param(7.51, PUBLISHER, id="just-longer"),
        pytest.param(120.0, PublisherSettings(), id="defaults"),
    ],
)
def test_check_retry_horizon_accepts_a_longer_window(
    window: float, publisher: PublisherSettings
) -> None:
    check_retry_horizon(LogSettings(duplicate_window_s=window), publisher)


def test_default_settings_pass_the_horizon_check() -> None:
    check_retry_horizon(LogSettings(), PublisherSettings())


def test_backoff_max_below_backoff_initial_is_rejected() -> None:
    with pytest.raises(pydantic.ValidationError, match="backoff_max_s must be >= backoff_initial"):
        PublisherSettings(backoff_initial_s=2.0, backoff_max_s=1.0)


def test_backoff_max_equal_to_backoff_initial_is_accepted() -> None:
    assert PublisherSettings(backoff_initial_s=1.0, backoff_max_s=1.0).backoff_max_s == 1.0


@pytest.mark.parametrize(
    ("settings", "field", "value"),
    [
        pytest.param(PublisherSettings(), "max_attempts", 9, id="publisher"),
        pytest.param(LogSettings(), "duplicate_window_s", 1.0, id="log"),
        pytest.param(StreamNames(), "events", "OTHER", id="stream-names"),
    ],
)
def test_settings_are_frozen(settings: pydantic.BaseModel, field: str, value: object) -> None:
    before = getattr(settings, field)

    with pytest.raises(pydantic.ValidationError, match="frozen"):
        setattr(settings, field, value)

    assert getattr(settings, field) == before
