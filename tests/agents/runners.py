"""Running Claude Code and Codex CLI offline, once, in a working directory the test prepared.

Both run with a fresh HOME (no user config, no login), their telemetry and update checks off,
stdin closed, and permission to run their shell tool without asking (we run as root):

Claude Code is told no model unless a test says so: it asks for its default one, which the stack
serves through ``--model-aliases`` (the README's recipe). Codex's config names the served model
("tiny"): the name picks Codex's harness, and its default model's (code mode, tools in an
``additional_tools`` item, the shell behind a JavaScript ``exec`` tool) is refused by the gateway.

- Claude Code: ``claude -p PROMPT --allowedTools Bash Read`` (enough for non-interactive tool use;
  ``--dangerously-skip-permissions`` is refused as root), ``ANTHROPIC_BASE_URL`` = the session
  base URL without ``/v1`` (it appends ``/v1/messages``), the key in ``ANTHROPIC_API_KEY`` (sent
  as ``x-api-key``);
- Codex: ``codex exec --skip-git-repo-check --dangerously-bypass-approvals-and-sandbox PROMPT``
  with a custom provider in ``$CODEX_HOME/config.toml`` (``wire_api = "responses"``,
  ``base_url`` = the session base URL with ``/v1``), the key in ``TURNSTREAM_API_KEY`` (sent as
  ``Authorization: Bearer``).
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tests.agents.script import NOTE_FILE, NOTE_TEXT, PROMPT

__all__ = ["AgentRun", "prepare_workdir", "run_claude_code", "run_codex"]

_CLI_TIMEOUT_S = 240
_CODEX_SESSION = re.compile(r"^session id: (\S+)$", re.MULTILINE)


@dataclass(frozen=True)
class AgentRun:
    returncode: int
    stdout: str
    stderr: str
    workdir: Path

    def describe(self) -> str:
        out, err = self.stdout[-3000:], self.stderr[-3000:]
        return f"exit {self.returncode}\nstdout:\n{out}\nstderr:\n{err}"

    @property
    def codex_session_id(self) -> str:
        """The session id Codex prints (and sends as its ``session-id`` header)."""
        found = _CODEX_SESSION.search(self.stdout + self.stderr)
        assert found, f"codex printed no session id:\n{self.describe()}"
        return found.group(1)


def prepare_workdir(root: Path) -> Path:
    """An empty project with the note the script's first step reads."""
    workdir = root / "project"
    workdir.mkdir(parents=True)
    (workdir / NOTE_FILE).write_text(NOTE_TEXT + "\n")
    return workdir


def _offline_env(home: Path, extra: dict[str, str]) -> dict[str, str]:
    inherited = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("ANTHROPIC_", "OPENAI_", "CLAUDE_", "CODEX_"))
    }
    return {
        **inherited,
        "HOME": str(home),
        "NO_COLOR": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_ERROR_REPORTING": "1",
        **extra,
    }


def _run(command: list[str], workdir: Path, env: dict[str, str]) -> AgentRun:
    try:
        done = subprocess.run(
            command,
            cwd=workdir,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=_CLI_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else ""
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else ""
        return AgentRun(-1, out, f"timed out after {_CLI_TIMEOUT_S}s\n{err}", workdir)
    return AgentRun(done.returncode, done.stdout, done.stderr, workdir)


def run_claude_code(
    binary: Path,
    base_url: str,
    api_key: str,
    workdir: Path,
    *,
    session_id: str | None = None,
    max_turns: int = 6,
    prompt: str = PROMPT,
    env: dict[str, str] | None = None,
    model: str | None = None,
) -> AgentRun:
    """``claude -p`` with ``ANTHROPIC_BASE_URL=base_url`` (a session base URL without ``/v1``,
    or the gateway's root with ``session_id`` sent as ``X-Claude-Code-Session-Id``); ``env``:
    more of its environment (e.g. ``CLAUDE_CODE_GATEWAY_HINT_HEADERS``); ``model``: its
    ``--model`` (None: its default). Its temporary files (background agents' output) go under
    the working directory's parent."""
    home = workdir.parent / "claude-home"
    home.mkdir(exist_ok=True)
    scratch = workdir.parent / "claude-tmp"
    scratch.mkdir(exist_ok=True)
    command = [
        str(binary),
        *("-p", prompt, "--max-turns", str(max_turns)),
        *("--allowedTools", "Bash", "Read"),
        *("--output-format", "stream-json", "--verbose"),
    ]
    if model is not None:
        command += ["--model", model]
    if session_id is not None:
        command += ["--session-id", session_id]
    extra = {
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": api_key,
        "CLAUDE_CODE_TMPDIR": str(scratch),
        **(env or {}),
    }
    return _run(command, workdir, _offline_env(home, extra))


def run_codex(
    binary: Path,
    base_url: str,
    api_key: str,
    workdir: Path,
    *,
    prompt: str = PROMPT,
    features: dict[str, bool] | None = None,
    model: str | None = "tiny",
) -> AgentRun:
    """``codex exec`` against a custom provider at ``base_url`` (ending in ``/v1``);
    ``features``: more of its ``[features]`` table (e.g. ``multi_agent_v2``); ``model``: its
    config's ``model`` (None: none, Codex's default)."""
    home = workdir.parent / "codex-home"
    home.mkdir(exist_ok=True)
    (home / "config.toml").write_text(
        "\n".join(
            [
                *([] if model is None else [f'model = "{model}"']),
                'model_provider = "turnstream"',
                "",
                "[model_providers.turnstream]",
                'name = "turnstream"',
                f'base_url = "{base_url}"',
                'env_key = "TURNSTREAM_API_KEY"',
                'wire_api = "responses"',
                "",
                "[analytics]",
                "enabled = false",
                "",
                "[features]",
                "plugins = false",
                *(f"{name} = {str(on).lower()}" for name, on in (features or {}).items()),
                "",
            ]
        )
    )
    command = [
        str(binary),
        *("exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox"),
        prompt,
    ]
    env = _offline_env(home, {"CODEX_HOME": str(home), "TURNSTREAM_API_KEY": api_key})
    return _run(command, workdir, env)
