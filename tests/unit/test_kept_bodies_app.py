"""Long bodies resent turn after turn through the app, on every API that resends a
conversation (Chat Completions, Anthropic Messages, Responses): the items reused are never
changed by serving (the next request reuses those very objects), turns continue token for
token, and the metric counts the bodies decoded from what they share.

The real app and the tiny model's chat template (a served context of 256k tokens, so a
~70 KB message fits) in front of the vLLM stand-in of test_logprobs_probe.py, publishing to
memory (as test_logprobs_refusal.py)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from transformers import AutoTokenizer

from gateway.backends.router import ReplicaRouter
from gateway.backends.vllm import VLLMBackend
from gateway.core.session_store import SessionStore
from gateway.http import guard
from gateway.http.app import create_app
from gateway.http.kept_bodies import KeptBodies
from gateway.metrics import GatewayMetrics
from gateway.serving import SessionService, TurnEngine
from gateway.templates import ChatTemplate
from gateway.tools import get_parser
from tests.helpers.tiny_model import WEATHER_TOOLS
from tests.unit.test_logprobs_probe import HandlerTransport, StandInVLLM
from tests.unit.test_logprobs_refusal import _Publisher

TASK = "Fix the failing test — the log says:\n" + "tests/test_x.py:12: AssertionError\n" * 2000


def app_and_client(tiny_model_dir: Path) -> tuple[Any, httpx.AsyncClient, _Publisher]:
    publisher = _Publisher()
    transport = HandlerTransport(StandInVLLM("processed_logprobs"))
    replica = VLLMBackend(
        "http://v:8000", "m", backend_id="vllm-0", max_context=1 << 18, transport=transport
    )
    engine = TurnEngine(
        template=ChatTemplate(AutoTokenizer.from_pretrained(tiny_model_dir), max_context=1 << 18),
        backend=ReplicaRouter([replica], max_inflight_per_replica=4),
        publisher=publisher,  # type: ignore[arg-type]
        parser=get_parser("hermes"),
        model_name="tiny",
        metrics=GatewayMetrics(),
    )
    sessions = SessionService(store=SessionStore(), publisher=publisher, model_name="tiny")  # type: ignore[arg-type]
    app = create_app(engine=engine, sessions=sessions, default_run="run")
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw")
    return app, client, publisher


def kept_bodies(app: Any) -> KeptBodies:
    kept: KeptBodies = app._guard.kept
    return kept


def assert_kept_items_unchanged(kept: KeptBodies) -> None:
    for entry in kept._kept.values():
        whole = msgspec.json.decode(entry.body)
        assert list(entry.values) == whole[entry.member]
        # The members before the items, decoded once and shared by the bodies after it.
        assert entry.head is not None and entry.head == {k: whole[k] for k in entry.head}


async def reused(client: httpx.AsyncClient) -> float:
    for line in (await client.get("/metrics")).text.splitlines():
        if line.startswith('turnstream_gateway_kept_bodies_total{decoded="reused"}'):
            return float(line.split()[-1])
    return 0.0


async def test_chat_completions(tiny_model_dir: Path) -> None:
    app, client, publisher = app_and_client(tiny_model_dir)
    messages: list[Any] = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": TASK},
    ]
    for _ in range(3):
        answer = await client.post(
            "/v1/chat/completions",
            json={"model": "tiny", "tools": WEATHER_TOOLS, "messages": messages, "max_tokens": 3},
            headers={"X-Session-Id": "chat"},
        )
        assert answer.status_code == 200, answer.text
        assert_kept_items_unchanged(kept_bodies(app))
        messages += [answer.json()["choices"][0]["message"], {"role": "user", "content": "go"}]
    assert await reused(client) == 2
    # The tools, decoded once with the kept members, were validated once (validated_once).
    [entry] = kept_bodies(app)._kept.values()
    assert entry.head is not None and entry.memo is not None
    [(raw, validated)] = entry.memo.values()
    assert raw is entry.head["tools"] and [t.raw for t in validated] == WEATHER_TOOLS
    held = kept_bodies(app).size_bytes
    assert held > len(TASK)  # the last body and its items, as the gauge says
    assert (
        f"turnstream_gateway_kept_body_bytes {float(held)}" in (await client.get("/metrics")).text
    )
    turns = publisher.turns
    assert [t.message_prefix_len > 0 for t in turns] == [False, True, True]
    assert turns[2].prefix_len == turns[1].prefix_len + len(turns[1].prompt_ids) + 3


async def test_anthropic_messages_with_a_moving_cache_marker(tiny_model_dir: Path) -> None:
    """Claude Code marks its last message's last block for caching: the marked message of one
    request is unmarked in the next, so the items shared are all but the last ones."""
    app, client, publisher = app_and_client(tiny_model_dir)
    marker = {"type": "ephemeral"}
    history: list[Any] = [{"role": "user", "content": [{"type": "text", "text": TASK}]}]
    for _ in range(4):
        last = history[-1]
        marked = {**last, "content": [{**last["content"][-1], "cache_control": marker}]}
        answer = await client.post(
            "/v1/messages",
            json={
                "model": "tiny",
                "max_tokens": 3,
                "system": "be brief",
                "messages": [*history[:-1], marked],
            },
            headers={"X-Session-Id": "claude"},
        )
        assert answer.status_code == 200, answer.text
        assert_kept_items_unchanged(kept_bodies(app))
        reply = {"role": "assistant", "content": answer.json()["content"]}
        history += [reply, {"role": "user", "content": [{"type": "text", "text": "go"}]}]
    # The second request unmarks the first's only message: nothing shared; then two each.
    assert await reused(client) == 2
    assert [t.message_prefix_len > 0 for t in publisher.turns] == [False, True, True, True]


async def test_responses_input_resent(tiny_model_dir: Path) -> None:
    app, client, publisher = app_and_client(tiny_model_dir)
    items: list[Any] = [{"role": "user", "content": TASK}]
    for _ in range(3):
        answer = await client.post(
            "/v1/responses",
            json={"model": "tiny", "input": items, "max_output_tokens": 3, "store": False},
            headers={"X-Session-Id": "responses"},
        )
        assert answer.status_code == 200, answer.text
        assert_kept_items_unchanged(kept_bodies(app))
        items += [*answer.json()["output"], {"role": "user", "content": "go"}]
    assert await reused(client) == 2
    assert [t.message_prefix_len > 0 for t in publisher.turns] == [False, True, True]


async def test_a_sessions_first_large_body_is_decoded_off_the_event_loop(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session's first large body (nothing kept to reuse: all of it decoded and indexed) is
    decoded on a worker thread; the next ones, which decode only their new items, on the loop
    (the threshold lowered here to this test's ~75 KB body; 256 KiB in the gateway)."""
    monkeypatch.setattr(guard, "_OFF_LOOP_FIRST_BYTES", 64 * 1024)
    threads: list[bool] = []
    decode = guard.decode_json

    def where(body: bytes, **kwargs: Any) -> Any:
        threads.append(threading.current_thread() is threading.main_thread())
        return decode(body, **kwargs)

    monkeypatch.setattr(guard, "decode_json", where)
    _, client, _ = app_and_client(tiny_model_dir)
    messages: list[Any] = [{"role": "user", "content": TASK}]
    on_loop = []
    for _ in range(3):
        threads.clear()
        answer = await client.post(
            "/v1/chat/completions",
            json={"model": "tiny", "messages": messages, "max_tokens": 3},
            headers={"X-Session-Id": "first-off-loop"},
        )
        assert answer.status_code == 200, answer.text
        on_loop.append(all(threads))
        messages += [answer.json()["choices"][0]["message"], {"role": "user", "content": "go"}]
    assert on_loop == [False, True, True]


async def test_a_bad_tool_resent_is_refused_every_time(tiny_model_dir: Path) -> None:
    """Only what validated is kept: tools that failed are validated (and refused) again."""
    app, client, publisher = app_and_client(tiny_model_dir)
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]
    messages: list[Any] = [{"role": "user", "content": TASK}]
    for _ in range(2):
        answer = await client.post(
            "/v1/chat/completions",
            json={"model": "tiny", "tools": bad, "messages": messages, "max_tokens": 3},
            headers={"X-Session-Id": "bad-tools"},
        )
        assert answer.status_code == 400 and "parameters" in answer.text, answer.text
        messages += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "go"}]
    assert await reused(client) >= 1  # the second body was decoded from the first's members
    [entry] = kept_bodies(app)._kept.values()
    assert entry.memo == {} and publisher.turns == []
