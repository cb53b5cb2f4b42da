"""The benchmarks' fixed-latency backend answers ``POST /v1/chat/completions`` (not streamed)
for a proxy in front of it (LiteLLM in ``benchmarks/litellm_compare.py``): the same text as its
completions, after the same delay. And it pauses on cue as a trainer pauses vLLM for a weight
update (``benchmarks/interrupted_turns.py``): an armed completion ends "abort" after k tokens,
what arrives while paused waits for ``/resume``, and the continuation is served the rest."""

from __future__ import annotations

import asyncio
import json
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


def _sse(text: str) -> list[dict[str, object]]:
    lines = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    return [json.loads(line) for line in lines if line != "[DONE]"]


def test_an_interrupted_completion_and_its_continuation(backend: str) -> None:
    """The armed request ends "abort" after 3 tokens (an event without tokens, as vLLM ends an
    aborted one); its continuation (prompt + those tokens), sent while paused, is held until
    /resume and then served the other 13: together the uninterrupted answer."""
    body = {"prompt": [1, 2, 3], "stream": True, "logprobs": 0, "return_token_ids": True}

    async def run() -> tuple[list[dict[str, object]], dict[str, object], dict[str, object]]:
        async with (
            httpx.AsyncClient(base_url=backend) as client,
            httpx.AsyncClient(base_url=backend) as other,
        ):
            whole = (await client.post("/v1/completions", json={**body, "stream": False})).json()
            await client.post("/interrupt", json={"after_tokens": 3})
            paused = asyncio.ensure_future(other.get("/paused"))  # answered at the abort
            first = _sse((await client.post("/v1/completions", json=body)).text)
            assert (await paused).json() == {"paused": True}
            ids = [t for e in first for c in e["choices"] for t in c.get("token_ids", [])]
            rest = {**body, "prompt": [1, 2, 3, *ids], "stream": False}
            continued = asyncio.ensure_future(other.post("/v1/completions", json=rest))
            await asyncio.sleep(0.2)
            assert not continued.done()  # queued while paused
            resumed = (await client.post("/resume")).json()
            return first, whole, {**resumed, **(await continued).json()}

    first, whole, rest = asyncio.run(run())
    [abort] = [e for e in first if e["choices"] and e["choices"][0]["finish_reason"]]
    assert abort["choices"][0]["finish_reason"] == "abort"
    assert abort["choices"][0]["token_ids"] == []
    ids = [t for e in first for c in e["choices"] for t in c.get("token_ids", [])]
    assert rest["queued"] == 1 and rest["paused_s"] >= 0.2
    [choice] = rest["choices"]
    assert choice["finish_reason"] == "stop"
    assert ids + choice["token_ids"] == whole["choices"][0]["token_ids"]
    assert len(ids) == 3 and rest["usage"]["completion_tokens"] == 13


def test_an_interrupted_whole_completion_keeps_its_tokens(backend: str) -> None:
    with httpx.Client(base_url=backend) as client:
        assert client.post("/interrupt", json={"after_tokens": 5}).json() == {"armed": 5}
        body = {"prompt": [7], "stream": False, "return_token_ids": True}
        cut = client.post("/v1/completions", json=body).json()
        resumed = client.post("/resume").json()
        bad = client.post("/interrupt", json={"after": 5})
    [choice] = cut["choices"]
    assert choice["finish_reason"] == "abort" and len(choice["token_ids"]) == 5
    assert choice["text"] == "The a" and resumed["queued"] == 0
    assert bad.status_code == 400
