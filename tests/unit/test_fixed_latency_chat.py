"""The benchmarks' fixed-latency backend answers ``POST /v1/chat/completions`` (not streamed)
for a proxy in front of it (LiteLLM in ``benchmarks/litellm_compare.py``): the same text as its
completions, after the same delay."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from eventlog.server import free_port

BACKEND = (
    Path(__file__).resolve().parents[2] / "benchmarks" / "harness" / "fixed_latency_backend.py"
)


@pytest.fixture(scope="module")
def backend() -> Iterator[str]:
    port = free_port()
    cmd = [sys.executable, str(BACKEND), "--port", str(port), "--model", "m", "--ttft-ms", "5"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(f"{url}/health", timeout=1).raise_for_status()
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_chat_completion_is_the_fixed_text(backend: str) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64}
    with httpx.Client(base_url=backend) as client:
        answer = client.post("/v1/chat/completions", json=body).json()
        again = client.post("/v1/chat/completions", json=body).json()  # keep-alive, in order
    assert answer["object"] == "chat.completion"
    [choice] = answer["choices"]
    assert choice["message"] == {"role": "assistant", "content": "The answer: 42."}
    assert choice["finish_reason"] == "stop"
    assert answer["usage"]["completion_tokens"] == 16  # the 15 bytes + the stop token
    assert again["choices"] == answer["choices"]


def test_fewer_tokens_and_bad_requests(backend: str) -> None:
    with httpx.Client(base_url=backend) as client:
        short = client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        ).json()
        streamed = client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "stream": True},
        )
        no_messages = client.post("/v1/chat/completions", json={"model": "m"})
    assert short["choices"][0]["message"]["content"] == "The"
    assert short["choices"][0]["finish_reason"] == "length"
    assert streamed.status_code == 400 and no_messages.status_code == 400
