"""Runs tests/verl (tests against verl's own code) with verl on the path.

`make setup` installs verl and the newest tensordict it allows (0.10) without dependencies into
.venv/compat/verl-<version>, never touching the venv's torch; the tests run in a fresh interpreter
with that directory first on PYTHONPATH.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VERL = ROOT / ".venv" / "compat" / "verl-0.9.1"

pytestmark = pytest.mark.integration


def test_the_verl_tests_pass_against_verl_0_9_1_and_tensordict_0_10() -> None:
    assert VERL.is_dir(), f"{VERL} is missing: run `make setup` (it installs verl there)"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(VERL), str(ROOT)])}
    probe = "import tensordict, verl; print(verl.__version__, tensordict.__version__)"
    versions = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=env, check=True
    ).stdout.split()
    assert versions == ["0.9.1", "0.10.0"]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", "tests/verl"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    summary = result.stdout.strip().splitlines()[-1]
    assert re.search(r"\d+ passed", summary) and "skipped" not in summary, summary
