"""The base install (no extras) runs the gateway in front of a remote backend, folds and writes
shards, without torch, tensordict or the openai SDK (issue 12: installs that sit beside verl and
vLLM, whose torch is not ours).

A fresh venv gets ``<this checkout>`` installed with no extras from the package index, by uv
(``uv pip install``: the same dependency metadata pip reads; ~6-15 s here where pip took ~65 s,
most of it unpacking and byte-compiling pyarrow, duckdb and transformers); its ``turnstream``
console script runs the gateway (``--backend vllm``), a fold worker and a shard writer against a
real nats-server. The backend is ``benchmarks/harness/fixed_latency_backend.py``, a stand-in for
vLLM's ``/v1/completions`` (no vLLM runs in ``make test``; ``tests/deploy`` runs the real one): it
answers every request with the same tokens and log-probs, which the shard row must hold exactly.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from eventlog.server import free_port
from tests.conftest import Log
from tests.helpers.gateway_process import GatewayProcess
from tests.helpers.services import WORKER_FLAGS, WRITER_FLAGS, Service, shard_table_rows

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
STANDIN = ROOT / "benchmarks" / "harness" / "fixed_latency_backend.py"
ANSWER = "The answer: 42."  # the stand-in's completion: byte ids, then the stop id 258
STOP_ID = 258


@pytest.fixture(scope="module")
def base_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    venv = tmp_path_factory.mktemp("base") / "venv"
    uv = str(Path(sys.executable).parent / "uv")  # the dev extra's
    subprocess.run([uv, "venv", "--quiet", "--python", sys.executable, str(venv)], check=True)
    install = subprocess.run(
        [uv, "pip", "install", "--quiet", "--python", str(venv / "bin" / "python"), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert install.returncode == 0, (
        f"uv pip install of the base distribution failed (the package index must be reachable, "
        f"as for make setup):\n{install.stdout[-3000:]}\n{install.stderr[-3000:]}"
    )
    return venv


@pytest.fixture
def standin(base_venv: Path) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        [
            *(str(base_venv / "bin" / "python"), str(STANDIN), "--port", str(port)),
            *("--ttft-ms", "1", "--model", "tiny", "--text", ANSWER, "--stop-id", str(STOP_ID)),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "the vLLM stand-in did not come up"
                time.sleep(0.1)
        yield url
    finally:
        proc.kill()
        proc.wait()


def test_the_base_install_has_no_torch_tensordict_or_openai(base_venv: Path) -> None:
    for module in ("torch", "tensordict", "openai", "matplotlib", "ray"):
        probe = subprocess.run(
            [str(base_venv / "bin" / "python"), "-c", f"import {module}"],
            capture_output=True,
            text=True,
            cwd=base_venv,  # not the checkout: only what is installed
        )
        assert probe.returncode != 0 and "ModuleNotFoundError" in probe.stderr, module


@pytest.mark.parametrize(
    ("command", "extra", "says"),
    [
        ("gateway", "local", "the local backend needs torch"),  # --backend local, the default
        ("gateway --workers 2", "local", "the local backend needs torch"),  # the supervisor
        ("up", "local", "the local backend needs torch"),
        ("train", "train", "this command needs the 'train' extra"),
        ("demo", "demo", "this command needs the 'demo' extra"),
    ],
)
def test_a_command_whose_extra_is_missing_says_which_to_install(
    base_venv: Path, tmp_path: Path, command: str, extra: str, says: str
) -> None:
    ran = subprocess.run(
        [str(base_venv / "bin" / "turnstream"), *command.split(), "--data-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    said = " ".join(ran.stderr.split())  # rich wraps lines at the terminal's width
    assert ran.returncode == 1 and said.startswith(f"error: {says}"), said
    assert f"pip install 'turnstream[{extra}]'" in said, said


async def test_the_base_install_serves_folds_and_writes_shards_from_a_remote_backend(
    base_venv: Path, standin: str, log: Log, tiny_model_dir: Path, tmp_path: Path
) -> None:
    launcher = (str(base_venv / "bin" / "turnstream"),)
    url = log.server.url
    gateway = GatewayProcess(
        url,
        tiny_model_dir,
        tmp_path / "gateway",
        # No --max-context: the gateway reads max_model_len from the backend's /v1/models.
        *("--backend", "vllm", "--backend-urls", standin),
        launcher=launcher,
    )
    services = [
        Service("worker", url, tmp_path, *WORKER_FLAGS, launcher=launcher).start(),
        Service("shard-writer", url, tmp_path, *WRITER_FLAGS, launcher=launcher).start(),
    ]
    try:
        session = gateway.session(group="base")
        messages: list[dict[str, str]] = [{"role": "user", "content": "What is the answer?"}]
        async with httpx.AsyncClient(base_url=str(session["base_url"]), timeout=30) as client:
            for turn in range(2):
                reply = await client.post(
                    "/chat/completions",
                    json={"model": "tiny", "messages": messages, "max_tokens": 32},
                )
                assert reply.status_code == 200, reply.text
                answer = reply.json()["choices"][0]["message"]
                assert answer["content"] == ANSWER
                messages += [answer, {"role": "user", "content": f"And then? ({turn})"}]
            closed = await client.post(
                f"{gateway.url}/v1/sessions/{session['session_id']}/close", json={"reward": 1.0}
            )
            assert closed.status_code == 200, closed.text
        rows: list[dict[str, object]] = []
        deadline = time.monotonic() + 60
        while not rows:
            for service in services:
                assert service.running, f"{service.command} exited:\n{service.output()}"
            assert time.monotonic() < deadline, "no shard row: " + services[1].output()
            await asyncio.sleep(0.3)
            rows = shard_table_rows(tmp_path / "shards")
    finally:
        for service in services:
            service.stop()
        gateway.stop()
    [row] = rows
    assert row["session"] == session["session_id"] and row["num_turns"] == 2
    assert row["reward"] == 1.0
    completion = [*ANSWER.encode(), STOP_ID]
    ids, mask = list(row["input_ids"]), list(row["loss_mask"])  # type: ignore[call-overload]
    generated = [token for token, m in zip(ids, mask, strict=True) if m]
    assert generated == completion * 2  # both turns' tokens, exactly as the backend sent them
    logprobs = [lp for lp, m in zip(row["logprobs"], mask, strict=True) if m]  # type: ignore[call-overload]
    sent = [-0.05 - 0.01 * i for i in range(len(completion))]  # the stand-in's log-probs
    assert logprobs == pytest.approx(sent * 2, abs=1e-6)
