"""Every shell command and Python snippet in README.md runs as written (issue 11, point 9).

The blocks run in order, grouped by the stack they talk to (a ``services`` block and the blocks
after it: one test each, ``stacks`` in ``tests/helpers/readme.py``), each group in a scratch
directory of its own (so ``data/`` is the test's, never the working copy's), with the venv's
``turnstream`` and ``python`` first on PATH. The one change to
what a reader would type: the ports. The README's 4222 (NATS) and 8000 (gateway) become free
ports, in the text and in ``TURNSTREAM_LOG__PORT`` / ``TURNSTREAM_PORT`` (what the commands
read when no flag says otherwise), so the test never collides with a stack of the reader's.
How each block runs is said in ``tests/helpers/readme.py``.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest

from eventlog.server import free_port
from tests.helpers.readme import Snippet, commands, snippets, stacks

README = Path(__file__).resolve().parents[2] / "README.md"
BLOCK_TIMEOUT_S = 300


class Scratch:
    """The directory, environment and background services the README's blocks share."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.ports = {"4222": str(free_port()), "8000": str(free_port())}
        bin_dir = str(Path(sys.executable).parent)
        inherited = {k: v for k, v in os.environ.items() if k != "TURNSTREAM_DATA_DIR"}
        self.env = {
            **inherited,  # the README's paths are relative to where it is run: data/ here
            "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
            "TURNSTREAM_LOG__PORT": self.ports["4222"],
            "TURNSTREAM_PORT": self.ports["8000"],
            "COLUMNS": "160",
        }
        self.services: list[tuple[str, subprocess.Popen[bytes], Path]] = []

    def localize(self, code: str) -> str:
        for port, free in self.ports.items():
            code = re.sub(rf"(?<=[:\s=]){port}\b", free, code)
        return code

    def run(self, snippet: Snippet) -> subprocess.CompletedProcess[str]:
        code = self.localize(snippet.code)
        argv = (
            ["bash", "-euo", "pipefail", "-c", code]
            if snippet.lang == "sh"
            else [sys.executable, "-c", code]
        )
        return subprocess.run(
            argv, cwd=self.root, env=self.env, capture_output=True, text=True,
            timeout=BLOCK_TIMEOUT_S, check=False,
        )  # fmt: skip

    def start_services(self, snippet: Snippet) -> None:
        """Start the block's lines in order, as a reader would in terminals: after the i-th
        line, wait for the i-th ``ready`` URL (the first line's server must be up before the
        second line's service reads what it wrote)."""
        self.stop_services()
        ready = [self.localize(u) for u in snippet.ready_urls]
        for number, command in enumerate(commands(self.localize(snippet.code))):
            log_path = self.root / f"service-{snippet.line}-{number}.log"
            with log_path.open("wb") as log_file:
                proc = subprocess.Popen(
                    ["bash", "-c", f"exec {command}"], cwd=self.root, env=self.env,
                    stdout=log_file, stderr=subprocess.STDOUT,
                )  # fmt: skip
            self.services.append((command, proc, log_path))
            if number < len(ready):
                self._wait_answers(snippet, ready[number])

    def _wait_answers(self, snippet: Snippet, url: str) -> None:
        deadline = time.monotonic() + 180
        while not _answers(url):
            dead = [(c, log) for c, p, log in self.services if p.poll() is not None]
            if dead:
                command, log_path = dead[0]
                raise AssertionError(
                    f"{snippet.where}: `{command}` exited:\n{log_path.read_text()[-3000:]}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(f"{snippet.where}: {url} never answered")
            time.sleep(0.2)

    def stop_services(self) -> None:
        """SIGTERM each (the last started first), then say which did not exit cleanly."""
        unclean = []
        for command, proc, log_path in reversed(self.services):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.returncode not in (0, -signal.SIGTERM):
                unclean.append(
                    f"`{command}` exited {proc.returncode}:\n{log_path.read_text()[-3000:]}"
                )
        self.services.clear()
        assert not unclean, "\n".join(unclean)


def _answers(url: str) -> bool:
    parsed = urlparse(url)
    try:
        if parsed.scheme.startswith("http"):
            return httpx.get(url, timeout=1).status_code == 200
        with socket.create_connection((parsed.hostname or "", parsed.port or 0), timeout=1):
            return True
    except (httpx.HTTPError, OSError):
        return False


@pytest.fixture
def scratch(tmp_path: Path) -> Iterator[Scratch]:
    scratch = Scratch(tmp_path)
    try:
        yield scratch
    finally:
        scratch.stop_services()


def test_the_readme_has_runnable_blocks_and_says_why_it_skips_any() -> None:
    found = snippets(README)
    assert sum(1 for s in found if s.lang == "python" and s.kind != "skip") >= 3
    assert sum(1 for s in found if s.kind == "services") >= 1
    for s in found:
        if s.kind == "services":
            assert s.ready_urls, f"{s.where}: a services block names what to wait for"


@pytest.mark.parametrize(
    "stack", stacks(snippets(README)), ids=lambda group: f"line{group[0].line}"
)
def test_every_readme_block_runs_as_written(scratch: Scratch, stack: list[Snippet]) -> None:
    for snippet in stack:
        if snippet.kind == "skip":
            continue
        if snippet.kind == "services":
            scratch.start_services(snippet)
            continue
        deadline = time.monotonic() + (float(snippet.arg) if snippet.kind == "eventually" else 0)
        while True:
            done = scratch.run(snippet)
            if done.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert done.returncode == 0, (
            f"{snippet.where} failed ({done.returncode}):\n{snippet.code}\n"
            f"--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}"
        )
