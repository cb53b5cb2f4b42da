"""Fixtures of the agent tests: the scripted backend, ``turnstream up`` in front of it, the CLIs.

Run only by ``make test-agents`` (``TURNSTREAM_TEST_AGENTS=1``, see the root conftest.py): they
install Claude Code and Codex with npm (tests/agents/clis.py) the first time. A step that cannot
be done fails the test with the reason: these tests never skip.

The stack (one per test module): tests/agents/scripted_backend.py on a free port, and
``turnstream up --backend vllm`` pointed at it, with the tiny model's tokenizer and template (the
backend scores with the same model directory), an API key, and ``--max-context`` large enough for
the agents' 40-50k-token prompts (see the backend's docstring), and ``--model-aliases`` for the
CLIs' default model names (as the README's recipes: no ``--model``, no ``model =``).
``slow_stack`` is the same with
every backend answer held a second, for the sub-agent tests (requests in flight together overlap
visibly); ``Stack.events`` reads a session's events back from the stack's log.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from eventlog import connect, read_session
from eventlog.server import free_port
from schemas import SessionEvent, TurnCompleted
from tests.agents.clis import CLAUDE_CODE, CODEX, AgentInstallError, installed_cli
from tests.helpers.services import shard_table_rows
from tests.helpers.up_process import UpProcess
from tests.helpers.waiting import wait_for
from turnstream.stack.stack_file import read_stack_file

API_KEY = "sk-turnstream-agents"
MODEL_ALIASES = "claude-*=tiny,gpt-*=tiny"  # the README's recipe, for the tiny model
RUN = "up"  # UpProcess's --run
MAX_CONTEXT = 131072
SUBAGENT_DELAY_S = 1.0


class ScriptedBackend:
    """tests/agents/scripted_backend.py as a process; ``requests()`` is what it served."""

    def __init__(self, model_dir: Path, log_dir: Path, delay: float = 0.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"scripted-backend-{self.port}.log"
        args = [
            sys.executable,
            *("-m", "tests.agents.scripted_backend"),
            *("--model", str(model_dir), "--port", str(self.port)),
            *("--max-model-len", str(MAX_CONTEXT), "--log", str(log_dir / "served.jsonl")),
            *("--delay", str(delay)),
        ]
        with self.log_path.open("wb") as log_file:
            self.proc = subprocess.Popen(
                args, stdout=log_file, stderr=subprocess.STDOUT, cwd=Path(__file__).parents[2]
            )

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def wait_ready(self, timeout: float = 60) -> ScriptedBackend:
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, f"scripted backend exited:\n{self.output()}"
            assert time.monotonic() < deadline, f"scripted backend not ready:\n{self.output()}"
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)

    def requests(self, since: int = 0) -> list[dict[str, Any]]:
        """What it served, in the order answered; ``since``: less the first that many."""
        served = httpx.get(f"{self.url}/requests", params={"since": since}, timeout=30).json()
        assert isinstance(served, list)
        return served

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class Stack:
    backend: ScriptedBackend
    up: UpProcess
    data_dir: Path

    @property
    def url(self) -> str:
        return self.up.url

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {API_KEY}"}

    def create_session(self, **body: Any) -> dict[str, Any]:
        answer = httpx.post(f"{self.url}/v1/sessions", json=body, headers=self.headers, timeout=30)
        assert answer.status_code == 200, answer.text
        created = answer.json()
        assert isinstance(created, dict)
        return created

    def close_session(self, session_id: str) -> None:
        answer = httpx.post(
            f"{self.url}/v1/sessions/{session_id}/close", json={}, headers=self.headers, timeout=30
        )
        assert answer.status_code == 200, answer.text

    def session_info(self, session_id: str) -> dict[str, Any]:
        answer = httpx.get(f"{self.url}/v1/sessions/{session_id}", headers=self.headers, timeout=30)
        assert answer.status_code == 200, answer.text
        info = answer.json()
        assert isinstance(info, dict)
        return info

    def backend_calls(self) -> int:
        return len(self.backend.requests())

    def asked_models(self, session_id: str) -> list[str | None]:
        """The model name each of the session's turns was asked for, in turn order."""
        turns = [e for e in self.events(session_id) if isinstance(e, TurnCompleted)]
        return [t.request.get("model") for t in sorted(turns, key=lambda t: t.turn)]

    def events(self, session_id: str) -> list[SessionEvent]:
        """The session's events, read back from the stack's log (``stack.json``'s NATS URL)."""
        found = read_stack_file(self.data_dir)
        assert found is not None, f"no stack.json in {self.data_dir}"
        nats_url = found.nats_url

        async def read() -> list[SessionEvent]:
            nc = await connect(nats_url, name="agents-test")
            try:
                return await read_session(nc.jetstream(), RUN, session_id)
            finally:
                await nc.close()

        return asyncio.run(read())

    def trajectories(self, session_id: str, within: float = 60) -> list[dict[str, Any]]:
        """The session's shard rows, once its close has been folded and written."""
        rows: list[dict[str, Any]] = []

        def written() -> bool:
            rows[:] = [
                row
                for row in shard_table_rows(self.data_dir / "shards")
                if row["session"] == session_id
            ]
            return bool(rows)

        wait_for(written, within, f"the trajectories of session {session_id} in the shards")
        time.sleep(1)  # a second shard of the same close would land within the writer's max age
        written()
        return rows


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    yield from _stack(tiny_model_dir, tmp_path_factory, delay=0.0)


@pytest.fixture(scope="module")
def slow_stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The stack with every backend answer held ``SUBAGENT_DELAY_S``: requests of sub-agents
    served together overlap at the backend by that much, visibly."""
    yield from _stack(tiny_model_dir, tmp_path_factory, delay=SUBAGENT_DELAY_S)


def _stack(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory, delay: float
) -> Iterator[Stack]:
    data_dir = tmp_path_factory.mktemp("agents-data")
    backend = ScriptedBackend(model_dir, data_dir, delay)
    up: UpProcess | None = None
    try:
        backend.wait_ready()
        up = UpProcess(
            data_dir,
            model_dir,
            *("--backend", "vllm", "--backend-urls", backend.url),
            *("--max-context", str(MAX_CONTEXT), "--api-keys", API_KEY),
            *("--model-aliases", MODEL_ALIASES),
        )
        up.wait_healthy()
        yield Stack(backend, up, data_dir)
    finally:
        if up is not None:
            up.stop()
            up.cleanup()
        backend.stop()


@pytest.fixture(scope="session")
def claude_binary() -> Path:
    try:
        return installed_cli(CLAUDE_CODE)
    except AgentInstallError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="session")
def codex_binary() -> Path:
    try:
        return installed_cli(CODEX)
    except AgentInstallError as exc:
        pytest.fail(str(exc), pytrace=False)
