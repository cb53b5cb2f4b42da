"""The shipped NATS configs are accepted by the nats-server binary we ship."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from eventlog.server import find_nats_server

CONFIGS = sorted((Path(__file__).parents[2] / "infra" / "nats").glob("*.conf"))


@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_nats_config_is_valid(config: Path) -> None:
    result = subprocess.run(
        [find_nats_server(), "-c", str(config), "-t"], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_there_is_a_config_to_check() -> None:
    assert CONFIGS, "infra/nats/*.conf is empty"
