"""Model fixtures, registered from tests/conftest.py through ``pytest_plugins``.

``tiny_model_dir``: the seeded tiny model, created in a temporary cache the way the gateway
creates it on first use. ``tool_model_dir``: a copy fitted to ``WEATHER_TRANSCRIPT``, which
greedily calls ``get_weather`` for Paris and then answers from the tool's result.

Both are made once per test run, not once per pytest-xdist worker: in a directory the run's
workers share (fitting the tool model is ~15 s of CPU, ~30 s beside the other worker's tests),
the first worker to need one makes it under a lock and the others wait for it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.model import ensure_tiny_model
from tests.helpers.tiny_model import WEATHER_TOOLS, WEATHER_TRANSCRIPT, overfit_tool_calls


def _run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory of this test run that every worker sees: the parent of a worker's base
    temporary directory (``pytest-N/popen-gwK``) under xdist, the base one itself without."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    path = shared / "shared-models"
    path.mkdir(exist_ok=True)
    return path


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        yield


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # ensure_tiny_model renames a finished directory into place: safe for concurrent creators
    return ensure_tiny_model(_run_dir(tmp_path_factory) / "model-cache")


@pytest.fixture(scope="session")
def tool_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    shared = _run_dir(tmp_path_factory)
    out = shared / "tool-model"
    with _locked(shared / "tool-model.lock"):
        if not out.is_dir():  # renamed into place only once fitted and saved
            staging = shared / "tool-model.staging"
            shutil.rmtree(staging, ignore_errors=True)
            overfit_tool_calls(tiny_model_dir, staging, [WEATHER_TRANSCRIPT], WEATHER_TOOLS)
            staging.rename(out)
    return out
