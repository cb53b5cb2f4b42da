"""The batch assembly also works with the oldest tensordict we support (verl pins >= 0.8).

`make setup` installs tensordict 0.8.3 (no dependencies) into .venv/compat/; this test runs the
assembly's unit tests in a fresh interpreter with that copy first on the path.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OLDEST = ROOT / ".venv" / "compat" / "tensordict-0.8.3"

pytestmark = pytest.mark.integration


def test_assembly_tests_pass_on_tensordict_0_8() -> None:
    assert OLDEST.is_dir(), f"{OLDEST} is missing: run `make setup` (it installs it there)"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(OLDEST), str(ROOT)])}
    version = subprocess.run(
        [sys.executable, "-c", "import tensordict; print(tensordict.__version__)"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    ).stdout.strip()
    assert version == "0.8.3"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/unit/test_assembly.py",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout
