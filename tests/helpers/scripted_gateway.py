"""A gateway (``--backend vllm``) in front of the benchmarks' fixed-latency vLLM stand-in, which
answers a fixed list of token ids to every completion: for e2e tests where the choice of tokens
is scripted and everything else (rendering, parsing, recording) is the gateway's own."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from eventlog.server import free_port
from tests.helpers.gateway_process import GatewayProcess

__all__ = ["scripted_backend", "scripted_gateway"]

BACKEND = (
    Path(__file__).resolve().parents[2] / "benchmarks" / "harness" / "fixed_latency_backend.py"
)


@contextlib.contextmanager
def scripted_backend(data: Path, tokens: list[int], *backend_args: str) -> Iterator[str]:
    """The backend's URL while it runs; it answers ``tokens`` to every completion
    (``backend_args``: more of its options, e.g. ``--ttft-ms``); its log in ``data``."""
    port = free_port()
    backend = f"http://127.0.0.1:{port}"
    command = [sys.executable, str(BACKEND), "--port", str(port), "--model", "tiny"]
    command += ["--tokens", ",".join(map(str, tokens)), *backend_args]
    with (data / "backend.log").open("wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(f"{backend}/health", timeout=1).raise_for_status()
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.1)
        yield backend
    finally:
        proc.terminate()
        proc.wait(10)


@contextlib.contextmanager
def scripted_gateway(
    nats_url: str, model_dir: Path, data: Path, tokens: list[int], *backend_args: str
) -> Iterator[tuple[GatewayProcess, str]]:
    """The gateway and its backend's URL; the backend answers ``tokens`` (``backend_args``:
    more of its options, e.g. ``--ttft-ms``)."""
    with scripted_backend(data, tokens, *backend_args) as backend:
        gateway = GatewayProcess(
            nats_url,
            model_dir,
            data / "gateway",
            "--backend",
            "vllm",
            "--backend-urls",
            json.dumps([backend]),
            "--max-context",
            "4096",
        )
        try:
            yield gateway, backend
        finally:
            gateway.stop()
