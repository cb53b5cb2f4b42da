"""The processes a gateway benchmark starts and stops: the fixed-latency backend (or vLLM's CPU
server), the gateway through its launcher, nats-server; health waits, /metrics and EVENTS
counts."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from eventlog import LogSettings
from eventlog.server import NatsServer, free_port
from harness.cpu import cpu_seconds, own_cpu_seconds, tree_cpu_seconds
from harness.load import Conversation

REPO = Path(__file__).resolve().parents[2]
BACKEND_SCRIPT = Path(__file__).resolve().parent / "fixed_latency_backend.py"
LAUNCHER_SCRIPT = Path(__file__).resolve().parent / "gateway_launcher.py"
RUN = "bench"
STREAM = LogSettings().names.events


@dataclass
class Procs:
    backend: subprocess.Popen[bytes]
    gateway: subprocess.Popen[bytes]
    nats: NatsServer
    backend_tree: bool = False  # count the backend's child processes too (vLLM's engine)

    def toggle_profile(self) -> None:
        self.gateway.send_signal(signal.SIGUSR1)  # see harness/gateway_launcher.py

    def cpu(self) -> dict[str, float]:
        assert self.nats.pid is not None
        return {
            "backend": (tree_cpu_seconds if self.backend_tree else cpu_seconds)(self.backend.pid),
            "gateway": cpu_seconds(self.gateway.pid),
            # User time alone: the kernel's share (loopback TCP, mostly) swings with the
            # machine's load, the gateway's own Python work does not.
            "gateway_user": cpu_seconds(self.gateway.pid, user_only=True),
            "nats": cpu_seconds(self.nats.pid),
            "loadgen": own_cpu_seconds(),
        }


async def wait_http(url: str, proc: subprocess.Popen[bytes], what: str, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    async with httpx.AsyncClient() as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited with code {proc.returncode} on start")
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(url, timeout=1.0)).status_code == 200:
                    return
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{what} not healthy at {url} within {within_s:.0f} s")


def spawn(
    cmd: list[str], log_path: Path, env: Mapping[str, str], cwd: Path = REPO
) -> subprocess.Popen[bytes]:
    with log_path.open("wb") as log_file:
        return subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, cwd=cwd, env=env)


def stop_process(proc: subprocess.Popen[bytes], sig: int = signal.SIGINT, wait: float = 20) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(wait)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def parse_metrics(text: str) -> dict[str, float]:
    """The few Prometheus series this benchmark reads from the gateway's /metrics."""
    wanted = {
        "turnstream_gateway_publish_seconds_sum": "publish_sum",
        "turnstream_gateway_publish_seconds_count": "publish_count",
        'turnstream_gateway_request_seconds_sum{route="/v1/chat/completions"}': "request_sum",
        'turnstream_gateway_request_seconds_count{route="/v1/chat/completions"}': "request_count",
    }
    out = dict.fromkeys(wanted.values(), 0.0)
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name in wanted:
            out[wanted[name]] = float(value)
    return out


async def stream_messages(js: Any) -> int:
    return int((await js.stream_info(STREAM)).state.messages)


async def count_subjects(js: Any, subject: str) -> int:
    """Messages on ``subject`` (wildcards allowed) in EVENTS, via a throwaway consumer."""
    sub = await js.pull_subscribe(subject, stream=STREAM)
    try:
        return int((await sub.consumer_info()).num_pending)
    finally:
        await sub.unsubscribe()


def backend_command(
    args: argparse.Namespace, port: int, conv: Conversation, model: str
) -> list[str]:
    """The stand-in serving ``model``: the gateway takes the served name from its /v1/models
    and refuses requests for another one."""
    assert conv.completion_ids is not None, "the fixed-latency backend answers known tokens"
    tokens = ",".join(str(t) for t in conv.completion_ids)
    cmd = [sys.executable, str(BACKEND_SCRIPT), "--port", str(port), "--model", model]
    cmd += ["--tokens", tokens, "--ttft-ms", str(args.ttft_ms)]
    return [*cmd, "--itl-ms", str(args.itl_ms)]


class FixedLatencyBackend:
    """``harness/fixed_latency_backend.py`` in its own process: the same tokens after
    ``--ttft-ms``."""

    name = "fixed-latency backend"

    def __init__(
        self, args: argparse.Namespace, conv: Conversation, model: str, log_dir: Path
    ) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        command = backend_command(args, port, conv, model)
        self.proc = spawn(command, log_dir / "backend.log", os.environ)

    async def ready(self) -> None:
        await wait_http(f"{self.url}/health", self.proc, self.name, 30)

    async def connections(self, client: httpx.AsyncClient) -> int:
        """TCP connections accepted so far (the stand-in counts them)."""
        return int((await client.get(f"{self.url}/stats")).json()["connections"])

    async def stats(self, client: httpx.AsyncClient) -> dict[str, Any]:
        return dict((await client.get(f"{self.url}/stats")).json())

    def stop(self) -> None:
        stop_process(self.proc, signal.SIGTERM)


class VllmCpuBackend:
    """The real vLLM CPU server of the deploy tests (``tests/deploy/vllm_server.py``: its own
    cached venv, the head_dim-64 tiny model, float32, eager), one replica."""

    name = "vLLM (CPU)"

    def __init__(self, model_dir: Path, log_dir: Path) -> None:
        vllm_server = deploy_vllm_server()
        self.server = vllm_server.VLLMServer(
            vllm_server.vllm_python(), model_dir, log_dir, name="backend"
        ).start()
        self.url = self.server.url
        assert self.server.proc is not None
        self.proc = self.server.proc

    async def ready(self) -> None:
        await asyncio.to_thread(self.server.wait_ready)

    async def connections(self, client: httpx.AsyncClient) -> int:
        return 0  # vLLM does not count them: conns/req reads 0 for this backend

    async def stats(self, client: httpx.AsyncClient) -> dict[str, Any]:
        counters = await asyncio.to_thread(self.server.metrics)
        wanted = ("request_success_total", "prompt_tokens_total", "generation_tokens_total")
        return {
            "ready_s": round(self.server.ready_s or 0.0, 1),
            **{name: counters.get(f"vllm:{name}", 0.0) for name in wanted},
        }

    def stop(self) -> None:
        self.server.stop()


def deploy_vllm_server() -> Any:
    """``tests.deploy.vllm_server``, imported from the repository root (tests are no package
    the install provides)."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    import tests.deploy.vllm_server as vllm_server

    return vllm_server


def gateway_command(
    args: argparse.Namespace,
    model_dir: Path,
    nats_url: str,
    backend_url: str,
    port: int,
    data_dir: Path,
    gc_log: Path,
    source_tree: Path | None = None,
) -> list[str]:
    """``turnstream gateway`` through the launcher (``source_tree``: run that checkout's code)."""
    cmd = [sys.executable, str(LAUNCHER_SCRIPT), "--gc-log", str(gc_log)]
    if source_tree is not None:
        cmd += ["--source-tree", str(source_tree)]
    if args.profile_gateway:
        cmd += ["--profile", str(args.profile_gateway)]
    if args.gateway_gc_freeze:
        cmd += ["--gc-freeze"]
    if getattr(args, "tracemalloc_gateway", None):
        cmd += ["--tracemalloc", str(args.tracemalloc_gateway)]
    cmd += ["--", "gateway", "--backend", "vllm"]
    cmd += ["--backend-urls", json.dumps([backend_url]), "--max-context", "4096"]
    cmd += ["--model", str(model_dir), "--log.url", nats_url, "--port", str(port)]
    cmd += ["--data-dir", str(data_dir), "--run", RUN]
    cmd += ["--max-inflight-per-replica", str(args.max_inflight_per_replica)]
    return cmd


def gateway_env(args: argparse.Namespace) -> dict[str, str]:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    if args.gateway_log_level:
        env["TURNSTREAM_LOG_LEVEL"] = args.gateway_log_level
    return env
