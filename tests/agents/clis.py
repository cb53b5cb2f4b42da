"""The agent CLIs the tests drive, installed with npm at pinned versions into a cache.

``${TURNSTREAM_AGENTS_CACHE:-~/.cache/turnstream/agents}/<package>-<version>/`` holds one
``npm install --prefix`` per CLI: never the repository (node_modules there would be picked up by
git and by test collection). A prefix whose binary answers ``--version`` with the pinned version
is reused; anything else is installed again into a fresh directory, renamed into place when done.

Claude Code 2.1.328 declares ``node >= 22`` but runs its own native binary (an optional
dependency copied over ``bin/claude.exe`` by its postinstall), so node 20's npm installs it with
a warning only.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CLAUDE_CODE", "CODEX", "AgentCli", "AgentInstallError", "cache_root", "installed_cli"]

_INSTALL_TIMEOUT_S = 600


class AgentInstallError(RuntimeError):
    """A CLI cannot be installed or does not run; the message says what to do."""


@dataclass(frozen=True)
class AgentCli:
    package: str  # the npm package
    version: str  # pinned: the request fixtures were captured from this version
    binary: str  # its name under node_modules/.bin
    version_marker: str  # what ``<binary> --version`` prints for this version
    # The model it asks for when given none (this version, an API key, a custom base URL): the
    # gateway serves it through --model-aliases (tests/agents/conftest.py's stack).
    default_model: str

    @property
    def dir_name(self) -> str:
        return f"{self.package.rsplit('/', 1)[-1]}-{self.version}"


CLAUDE_CODE = AgentCli(
    "@anthropic-ai/claude-code", "2.1.328", "claude", "2.1.328", default_model="claude-opus-5-5"
)
CODEX = AgentCli("@openai/codex", "0.169.0", "codex", "0.169.0", default_model="gpt-6.1-sol")


def cache_root() -> Path:
    root = os.environ.get("TURNSTREAM_AGENTS_CACHE") or "~/.cache/turnstream/agents"
    return Path(root).expanduser()


def installed_cli(cli: AgentCli, root: Path | None = None) -> Path:
    """The path of ``cli``'s binary, installed with npm first if the cache lacks it."""
    root = cache_root() if root is None else root
    prefix = root / cli.dir_name
    binary = prefix / "node_modules" / ".bin" / cli.binary
    if _runs(binary, cli):
        return binary
    npm = shutil.which("npm")
    if npm is None:
        raise AgentInstallError(
            f"npm is not on PATH: install Node.js 20 or newer with npm (e.g. `apt-get install "
            f"nodejs npm`, or https://nodejs.org), then rerun `make test-agents`; it installs "
            f"{cli.package}@{cli.version} into {prefix}"
        )
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{cli.dir_name}-", dir=root))
    try:
        done = subprocess.run(
            [
                npm,
                "install",
                "--prefix",
                str(staging),
                "--no-audit",
                "--no-fund",
                "--no-save",
                f"{cli.package}@{cli.version}",
            ],
            capture_output=True,
            text=True,
            timeout=_INSTALL_TIMEOUT_S,
            check=False,
        )
        if done.returncode != 0:
            raise AgentInstallError(
                f"`npm install {cli.package}@{cli.version}` failed (exit {done.returncode}); is "
                f"the npm registry reachable?\n{done.stderr[-3000:]}"
            )
        shutil.rmtree(prefix, ignore_errors=True)
        staging.rename(prefix)
    except subprocess.TimeoutExpired:
        raise AgentInstallError(
            f"`npm install {cli.package}@{cli.version}` took over {_INSTALL_TIMEOUT_S}s"
        ) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if not _runs(binary, cli):
        raise AgentInstallError(
            f"{binary} was installed but `{cli.binary} --version` does not print {cli.version}; "
            f"remove {prefix} and rerun"
        )
    return binary


def _runs(binary: Path, cli: AgentCli) -> bool:
    if not binary.exists():
        return False
    try:
        done = subprocess.run(
            [str(binary), "--version"], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0 and cli.version_marker in done.stdout
