"""The shipped NATS configs are accepted by the nats-server binary we ship; the image's install
step pins what was measured."""

from __future__ import annotations

import fnmatch
import re
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


# -- infra/Dockerfile's install step ----------------------------------------------------------

REPO = Path(__file__).parents[2]


def _install_step() -> str:
    """The Dockerfile's ``RUN`` that installs turnstream, as the shell script it runs."""
    steps = re.split(r"\n(?=[A-Z]+ )", (REPO / "infra" / "Dockerfile").read_text())
    [step] = [s for s in steps if s.startswith("RUN ") and "pip install" in s]
    return step.removeprefix("RUN ").replace("\\\n", "\n")


def _in_context(name: str) -> bool:
    """Whether .dockerignore lets top-level ``name`` into the build context (its last matching
    pattern wins; ``!`` lets a path back in)."""
    kept = True
    for line in (REPO / ".dockerignore").read_text().splitlines():
        pattern = line.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negated = pattern.startswith("!")
        if fnmatch.fnmatchcase(name, pattern.removeprefix("!").replace("**", "*")):
            kept = negated
    return kept


@pytest.mark.parametrize("wheelhouse", ["", "http://127.0.0.1:1/"], ids=["index", "wheelhouse"])
def test_the_image_installs_with_the_measured_constraints(wheelhouse: str, tmp_path: Path) -> None:
    """The install step, run by sh with its venv and pip stood in for: both paths (the package
    index, a wheelhouse) pass ``-c`` the constraints.txt the build context holds, so the image
    runs the uvicorn / httptools / uvloop that were measured (issue 38)."""
    source, calls = tmp_path / "src", tmp_path / "pip-calls"
    source.mkdir()
    pip = tmp_path / "pip"
    pip.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" >> {calls}\n')
    pip.chmod(0o755)
    script = (
        _install_step()
        .replace("python3 -m venv /opt/turnstream", "true")
        .replace("/opt/turnstream/bin/pip", str(pip))
        .replace("/tmp/src", str(source))
    )
    env = {"PATH": "/usr/bin:/bin", "WHEELHOUSE": wheelhouse, "EXTRAS": "local"}
    done = subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    args = calls.read_text().splitlines()
    assert args[0] == "install" and f"{source}/constraints.txt" in args, args
    assert args[args.index(f"{source}/constraints.txt") - 1] == "-c", args
    assert ("--no-index" in args) == bool(wheelhouse), args
    assert _in_context("constraints.txt"), ".dockerignore keeps constraints.txt out of the build"
    pins = (REPO / "constraints.txt").read_text()
    for measured in ("uvicorn==", "httptools==", "uvloop=="):
        assert measured in pins, f"constraints.txt pins no {measured.rstrip('=')}"
