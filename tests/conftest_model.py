"""Model fixtures, registered from tests/conftest.py through ``pytest_plugins``.

``tiny_model_dir``: the seeded tiny model, created in a temporary cache the way the gateway
creates it on first use. ``tool_model_dir``: a copy fitted to ``WEATHER_TRANSCRIPT``, which
greedily calls ``get_weather`` for Paris and then answers from the tool's result.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.model import ensure_tiny_model
from tests.helpers.tiny_model import WEATHER_TOOLS, WEATHER_TRANSCRIPT, overfit_tool_calls


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("model-cache"))


@pytest.fixture(scope="session")
def tool_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tool-model") / "model"
    return overfit_tool_calls(tiny_model_dir, out, [WEATHER_TRANSCRIPT], WEATHER_TOOLS)
