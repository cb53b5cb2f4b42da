"""Claude Code (the real CLI, pinned) through the gateway's Anthropic Messages API.

Each test runs ``claude -p`` offline against ``turnstream up --backend vllm`` (the scripted
policy of tests/agents/scripted_backend.py behind it) for a three-call session: ``Bash`` reads a
file, ``Bash`` writes one, then a final answer. The CLI executes both commands itself and sends
their results back; the session then closes and must be in the shards as one trajectory of
exactly those three turns (tests/agents/recorded.py says what is checked). The CLI asks for its
default model (no ``--model``), served through the stack's ``--model-aliases``, as the README's
recipe runs it; the global-route test names the served model instead.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

from tests.agents.clis import CLAUDE_CODE
from tests.agents.conftest import API_KEY, Stack
from tests.agents.cutting_proxy import CuttingProxy
from tests.agents.recorded import check_session
from tests.agents.runners import prepare_workdir, run_claude_code

AGENT = "claude_code"


def _check(
    stack: Stack,
    session_id: str,
    served_before: int,
    workdir: Path,
    model: Path,
    asked: str = CLAUDE_CODE.default_model,
) -> None:
    """The session's record (``asked``: the model name every turn was asked for; the CLI's
    default, which the stack serves through --model-aliases, unless the test named one)."""
    served = stack.backend.requests()[served_before:]
    assert stack.asked_models(session_id) == [asked] * len(served), "not recorded as asked"
    stack.close_session(session_id)
    rows = stack.trajectories(session_id)
    check_session(
        rows,
        served,
        agent=AGENT,
        shell_tool="Bash",
        command_key="command",
        workdir=workdir,
        model_dir=model,
    )


def test_a_session_base_url_records_every_call_as_one_trajectory(
    stack: Stack, claude_binary: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    created = stack.create_session(metadata={"agent": AGENT})
    session_id = created["session_id"]
    before = stack.backend_calls()
    workdir = prepare_workdir(tmp_path)

    run = run_claude_code(claude_binary, created["base_url"].removesuffix("/v1"), API_KEY, workdir)

    assert run.returncode == 0, run.describe()
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["type"] == "result" and result["is_error"] is False, result
    assert stack.session_info(session_id)["turns"] == 3
    _check(stack, session_id, before, workdir, tiny_model_dir)


def test_a_request_resent_after_a_cut_stream_is_answered_from_the_record(
    stack: Stack, claude_binary: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The 2nd call's stream is cut after its first ``content_block_delta``: Claude Code retries
    the identical request (streamed, in 2.1.328), which must get the recorded answer, not a new
    turn. (Cut after a ``content_block_stop`` or ``message_delta``, 2.1.328 keeps the block it
    has, runs the tool and sends the next request instead: no resend to test.)"""
    created = stack.create_session(metadata={"agent": AGENT, "cut": 2})
    session_id = created["session_id"]
    before = stack.backend_calls()
    workdir = prepare_workdir(tmp_path)
    proxy = CuttingProxy(stack.up.port, cut_at=2, after=b"content_block_delta").start()
    try:
        run = run_claude_code(claude_binary, f"{proxy.url}/sessions/{session_id}", API_KEY, workdir)
    finally:
        proxy.stop()

    assert run.returncode == 0, run.describe()
    assert proxy.cuts == 1, [request.target for request in proxy.model_requests]
    bodies = [json.loads(request.body) for request in proxy.model_requests]
    assert len(bodies) == 4, f"expected 3 calls and 1 resend, saw {len(bodies)}"
    assert bodies[2] == {**bodies[1], "stream": bodies[2]["stream"]}, "the resend differs"
    assert stack.backend_calls() - before == 3, "the resend reached the backend"
    assert stack.session_info(session_id)["turns"] == 3
    _check(stack, session_id, before, workdir, tiny_model_dir)


def test_the_global_route_takes_the_session_from_claude_codes_header(
    stack: Stack, claude_binary: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    session_id = str(uuid.uuid4())
    before = stack.backend_calls()
    workdir = prepare_workdir(tmp_path)

    run = run_claude_code(
        claude_binary, stack.url, API_KEY, workdir, session_id=session_id, model="tiny"
    )

    assert run.returncode == 0, run.describe()
    assert stack.session_info(session_id)["turns"] == 3
    _check(stack, session_id, before, workdir, tiny_model_dir, asked="tiny")
    [row] = stack.trajectories(session_id)
    assert row["session"] == session_id
