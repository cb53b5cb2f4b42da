"""``make test`` and ``make test-slow`` together run the whole suite, each test exactly once.

The two targets select with the Makefile's ``FAST_TESTS`` and ``SLOW_TESTS`` (read from the
Makefile here, so that a change there is what is checked); the tests they collect are compared
with what a plain ``pytest`` collects: none in both, none in neither. A key of
tests/conftest.py's ``SLOW`` that names no collected test (a file renamed, a test removed) fails
too: it would quietly move nothing. Three collections of the whole suite, ~20 s of CPU each, run
side by side: this file is slow itself (run by ``make test-slow``, as CI does).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from tests.conftest import SLOW, is_slow

ROOT = Path(__file__).resolve().parents[1]


def selection(variable: str) -> list[str]:
    """The pytest arguments the Makefile's ``VARIABLE := ...`` line gives."""
    found = re.search(rf"^{variable}\s*:?=(.*)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert found, f"the Makefile defines no {variable}"
    return shlex.split(found[1])


def collect(*args: str) -> subprocess.Popen[str]:
    """A plain collection: not this run's pytest-xdist worker, nor its options from the env."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    return subprocess.Popen(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def node_ids(proc: subprocess.Popen[str]) -> set[str]:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode in (0, 5), f"collection failed ({proc.returncode}):\n{out}\n{err}"
    return {line for line in out.splitlines() if "::" in line}


def test_make_test_and_make_test_slow_run_every_test_exactly_once() -> None:
    runs = {
        "whole": collect(),
        "fast": collect(*selection("FAST_TESTS")),
        "slow": collect(*selection("SLOW_TESTS")),
    }
    whole, fast, slow = (node_ids(proc) for proc in runs.values())

    assert fast and slow
    assert not fast & slow, f"run by both targets: {sorted(fast & slow)[:20]}"
    assert fast | slow == whole, f"run by neither target: {sorted(whole - fast - slow)[:20]}"
    stale = [key for key in SLOW if not any(is_slow(n, {key}) for n in slow)]
    assert not stale, f"tests/conftest.py SLOW names tests that are not collected: {stale}"
