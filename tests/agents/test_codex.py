"""Codex CLI (the real CLI, pinned) through the gateway's OpenAI Responses API.

Each test runs ``codex exec`` offline against ``turnstream up --backend vllm`` (the scripted
policy of tests/agents/scripted_backend.py behind it) for a three-call session:
``exec_command`` reads a file, ``exec_command`` writes one, then a final answer. Codex executes
both commands itself and sends their output back; the session then closes and must be in the
shards as one trajectory of exactly those three turns (tests/agents/recorded.py). Codex's config
names the served model, as the README's recipe does: Codex picks its harness by that name, and
under its default model's the request is refused with what to do (the last test).
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.agents.clis import CODEX
from tests.agents.conftest import API_KEY, Stack
from tests.agents.cutting_proxy import CuttingProxy
from tests.agents.recorded import check_session
from tests.agents.runners import prepare_workdir, run_codex

AGENT = "codex"


def _check(
    stack: Stack,
    session_id: str,
    served_before: int,
    workdir: Path,
    model: Path,
    asked: str = "tiny",
) -> None:
    """The session's record (``asked``: the model name every turn was asked for)."""
    served = stack.backend.requests()[served_before:]
    assert stack.asked_models(session_id) == [asked] * len(served), "not recorded as asked"
    stack.close_session(session_id)
    rows = stack.trajectories(session_id)
    check_session(
        rows,
        served,
        agent=AGENT,
        shell_tool="exec_command",
        command_key="cmd",
        workdir=workdir,
        model_dir=model,
    )


def test_a_session_base_url_records_every_call_as_one_trajectory(
    stack: Stack, codex_binary: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    created = stack.create_session(metadata={"agent": AGENT})
    session_id = created["session_id"]
    before = stack.backend_calls()
    workdir = prepare_workdir(tmp_path)

    run = run_codex(codex_binary, created["base_url"], API_KEY, workdir)

    assert run.returncode == 0, run.describe()
    assert stack.session_info(session_id)["turns"] == 3
    _check(stack, session_id, before, workdir, tiny_model_dir)


def test_a_request_resent_after_a_cut_stream_is_answered_from_the_record(
    stack: Stack, codex_binary: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The 2nd call's stream is cut before its ``response.output_item.done``: Codex has no
    complete item, reconnects and resends the same request, which must get the recorded answer.
    (Cut later, just before ``response.completed``, Codex acts on the items it has and sends the
    next request instead: no resend to test.)"""
    created = stack.create_session(metadata={"agent": AGENT, "cut": 2})
    session_id = created["session_id"]
    before = stack.backend_calls()
    workdir = prepare_workdir(tmp_path)
    proxy = CuttingProxy(stack.up.port, cut_at=2, before=b"response.output_item.done").start()
    try:
        run = run_codex(codex_binary, f"{proxy.url}/sessions/{session_id}/v1", API_KEY, workdir)
    finally:
        proxy.stop()

    assert run.returncode == 0, run.describe()
    assert proxy.cuts == 1, [request.target for request in proxy.model_requests]
    inputs = [json.loads(request.body)["input"] for request in proxy.model_requests]
    assert len(inputs) == 4, f"expected 3 calls and 1 resend, saw {len(inputs)}"
    assert inputs[2] == inputs[1], "the resend differs"
    assert stack.backend_calls() - before == 3, "the resend reached the backend"
    assert stack.session_info(session_id)["turns"] == 3
    _check(stack, session_id, before, workdir, tiny_model_dir)


def test_the_global_route_takes_the_session_from_codexs_header(
    stack: Stack, codex_binary: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    before = stack.backend_calls()
    workdir = prepare_workdir(tmp_path)

    run = run_codex(codex_binary, f"{stack.url}/v1", API_KEY, workdir)

    assert run.returncode == 0, run.describe()
    session_id = run.codex_session_id  # what it sent as its session-id header
    assert stack.session_info(session_id)["turns"] == 3
    _check(stack, session_id, before, workdir, tiny_model_dir)
    [row] = stack.trajectories(session_id)
    assert row["session"] == session_id


def test_codexs_default_model_is_refused_saying_to_name_the_served_one(
    stack: Stack, codex_binary: Path, tmp_path: Path
) -> None:
    """Without ``model`` in its config Codex asks for its default model (served here through
    --model-aliases) with that model's code-mode harness: its tools in an ``additional_tools``
    input item, the shell only behind a JavaScript ``exec`` tool. The gateway refuses it (400,
    nothing recorded), saying what to set; Codex prints that and exits."""
    created = stack.create_session(metadata={"agent": AGENT})
    session_id = created["session_id"]
    before = stack.backend_calls()

    run = run_codex(
        codex_binary, created["base_url"], API_KEY, prepare_workdir(tmp_path), model=None
    )

    assert run.returncode != 0, run.describe()
    assert f"model: {CODEX.default_model}" in run.stderr, run.describe()
    assert "set `model` in Codex's config.toml to the served model's name" in run.stderr
    assert stack.backend_calls() == before
    assert stack.session_info(session_id)["turns"] == 0
