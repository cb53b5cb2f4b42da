"""Claude Code and Codex spawning real sub-agents through the gateway (issue 35, point 5).

The scripted policy (tests/agents/subagent_script.py, in the scripted backend) makes each CLI's
main agent spawn a fork and a fresh sub-agent in ONE message: Claude Code's ``Agent`` tool
(background, the default), Codex's namespace tool ``spawn_agent`` as the gateway offers it
(flattened, ``multi_agent_v1__spawn_agent``; ``collaboration__spawn_agent`` with
``multi_agent_v2``). Each sub-agent runs one shell command and reports; the main agent answers
once both results are back (Codex calls ``wait_agent`` until then: ``codex exec`` ends the run,
abandoning sub-agents, when the root's turn ends). Every backend answer is held a second
(``slow_stack``), so sub-agents served together overlap visibly.

The CLI talks to the gateway through a recording proxy (the agent ids it sends are in its
headers); tests/agents/subagent_recorded.py says what is checked against what.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.agents.conftest import API_KEY, SUBAGENT_DELAY_S, Stack
from tests.agents.cutting_proxy import CuttingProxy
from tests.agents.runners import AgentRun, prepare_workdir, run_claude_code, run_codex
from tests.agents.subagent_recorded import SubagentSession, cli_agents
from tests.agents.subagent_script import SUBAGENT_PROMPT, SUBAGENTS, main_final_text

BOTH_REPORTED = main_final_text([agent.tag for agent in SUBAGENTS])


def _served_since(stack: Stack, before: int) -> list[dict[str, Any]]:
    """The backend's records since ``before``, once nothing more is being answered (a request
    the CLI abandoned may still be generating when it exits)."""
    served = stack.backend.requests(before)
    while True:
        time.sleep(2 * SUBAGENT_DELAY_S + 1)
        again = stack.backend.requests(before)
        if len(again) == len(served):
            return sorted(again, key=lambda call: call["arrived"])
        served = again


def _through_proxy(
    stack: Stack, cli: str, start: Callable[[str], AgentRun]
) -> tuple[AgentRun, SubagentSession]:
    """Run the CLI (``start(session base URL through the recording proxy)``) in a new session,
    close it, and gather what the witnesses saw and what was recorded."""
    session_id = stack.create_session(metadata={"cli": cli})["session_id"]
    before = stack.backend_calls()
    proxy = CuttingProxy(stack.up.port, cut_at=0).start()
    try:
        run = start(f"{proxy.url}/sessions/{session_id}")
    finally:
        proxy.stop()
    assert run.returncode == 0, run.describe()
    served = _served_since(stack, before)
    stack.close_session(session_id)
    return run, SubagentSession(
        cli,
        cli_agents(proxy.model_requests, cli),
        served,
        stack.events(session_id),
        stack.trajectories(session_id),
        subagents_may_be_cut=cli == "codex",
    )


def _claude_code(
    stack: Stack, binary: Path, tmp_path: Path, env: dict[str, str] | None = None
) -> SubagentSession:
    workdir = prepare_workdir(tmp_path)
    run, session = _through_proxy(
        stack,
        "claude_code",
        lambda url: run_claude_code(
            binary, url, API_KEY, workdir, prompt=SUBAGENT_PROMPT, max_turns=8, env=env
        ),
    )
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["type"] == "result" and result["is_error"] is False, result
    assert result["result"] == BOTH_REPORTED, result
    return session


def _codex(stack: Stack, binary: Path, tmp_path: Path, *, v2: bool) -> SubagentSession:
    workdir = prepare_workdir(tmp_path)
    features = {"multi_agent_v2": True} if v2 else None
    run, session = _through_proxy(
        stack,
        "codex",
        lambda url: run_codex(
            binary, f"{url}/v1", API_KEY, workdir, prompt=SUBAGENT_PROMPT, features=features
        ),
    )
    assert BOTH_REPORTED in run.stdout, run.describe()
    return session


def test_claude_code_runs_a_fork_and_a_fresh_agent_at_once(
    slow_stack: Stack, claude_binary: Path, tmp_path: Path
) -> None:
    session = _claude_code(slow_stack, claude_binary, tmp_path)
    session.run_all().assert_all()


def test_claude_codes_hint_headers_are_recorded_as_request_classes(
    slow_stack: Stack, claude_binary: Path, tmp_path: Path
) -> None:
    """With ``CLAUDE_CODE_GATEWAY_HINT_HEADERS=1`` every request says its class (``main`` /
    ``subagent``), a sub-agent its type (``fork`` / ``general-purpose``) and the prompt id that
    caused it: each turn records what its request said, each row its agent's class and type."""
    session = _claude_code(
        slow_stack, claude_binary, tmp_path, env={"CLAUDE_CODE_GATEWAY_HINT_HEADERS": "1"}
    )

    def request_classes() -> None:
        sent = sorted(
            (
                agent.key,
                request.headers.get("x-claude-code-request-class", ""),
                request.headers.get("x-claude-code-agent-type", ""),
                request.headers.get("x-claude-code-prompt-id", ""),
            )
            for agent in session.agents.values()
            for request in agent.requests
        )
        assert {row[1] for row in sent} == {"main", "subagent"}, sent
        recorded = sorted(
            (
                turn.agent.get("id", ""),
                turn.agent.get("request_class", ""),
                turn.agent.get("type", ""),
                turn.agent.get("prompt_id", ""),
            )
            for turn in session.turns
        )
        assert recorded == sent, f"recorded {recorded}\nsent {sent}"
        for agent in session.agents.values():
            meta = session.metadata(session.row_of(agent))
            expected = "main" if agent.script is None else "subagent"
            assert meta.get("request_class") == expected, meta
            if agent.script is not None:
                kind = "fork" if agent.script.fork else "general-purpose"
                assert meta.get("agent_type") == kind, meta

    session.run_all(("request classes", request_classes)).assert_all()


def test_codex_v1_spawns_through_the_flattened_namespace_tool(
    slow_stack: Stack, codex_binary: Path, tmp_path: Path
) -> None:
    session = _codex(slow_stack, codex_binary, tmp_path, v2=False)
    session.run_all().assert_all()


def test_codex_v2_delivers_tasks_as_agent_messages(
    slow_stack: Stack, codex_binary: Path, tmp_path: Path
) -> None:
    """``multi_agent_v2``: the ``collaboration`` namespace, tasks as ``agent_message`` input
    items (the gateway renders them as messages: the scripted policy finds the task's marker in
    the prompt), results back as ``agent_message`` items too."""
    session = _codex(slow_stack, codex_binary, tmp_path, v2=True)
    session.run_all().assert_all()
