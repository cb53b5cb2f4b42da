"""A hostile client against a real `turnstream gateway` (issue 9): every malformed input gets
its 4xx OpenAI error body, never a 5xx, and the keep-alive connection survives it; large and
half-sent bodies are refused without stalling the gateway or growing its memory.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from eventlog.server import NatsServer
from tests.helpers.gateway_process import GatewayProcess
from tests.helpers.hostile import (
    LONE_SURROGATE,
    PeakRss,
    assert_error,
    assert_kept_alive,
    chat_url,
    half_sent,
    keepalive_client,
    lazy_body,
    open_session,
    raw_json,
    served_model,
)

pytestmark = pytest.mark.integration

SURROGATE = r"surrogate|utf-?8|unicode|encod"
INT64 = r"int64|integer|range|too large|64"
FINITE = r"finite|nan|inf|number|float|bool"
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
USER = {"role": "user", "content": "hi"}


@pytest.fixture(scope="module")
def gateway(
    nats_server: NatsServer, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    data = tmp_path_factory.mktemp("gateway")
    process = GatewayProcess(nats_server.url, tiny_model_dir, data, "--body-timeout-s", "1")
    yield process
    process.stop()


@pytest.fixture(scope="module")
def model(gateway: GatewayProcess) -> str:
    return served_model(gateway.url)


@pytest.fixture
def client(gateway: GatewayProcess) -> Iterator[httpx.Client]:
    with keepalive_client(gateway.url) as client:
        yield client


def test_the_connection_check_tells_a_kept_connection_from_a_dropped_one(
    client: httpx.Client,
) -> None:
    missing = client.get("/v1/sessions/no-such-session")
    assert_error(missing, 404, "session_not_found", "no-such-session")
    assert_kept_alive(client, missing)
    closing = client.get("/health", headers={"Connection": "close"})
    with pytest.raises(AssertionError, match="dropped"):
        assert_kept_alive(client, closing)


SESSION_BODIES = {
    "group-surrogate": (raw_json({"group": "@s"}, s=LONE_SURROGATE), SURROGATE),
    "metadata-key-surrogate": (raw_json({"metadata": {"@s": 1}}, s=LONE_SURROGATE), SURROGATE),
    "metadata-int-2**64": (raw_json({"metadata": {"n": 2**64}}), INT64),
    "metadata-int-2**63": (raw_json({"metadata": {"n": [1, 2**63]}}), INT64),
    "invalid-utf8": (b'{"group": "\xff\xfe"}', r"utf-?8|decode|encod|json"),
    "not-json": (b"{not json", r"json"),
}


@pytest.mark.parametrize("body, mentions", SESSION_BODIES.values(), ids=SESSION_BODIES.keys())
def test_hostile_session_bodies_are_400(client: httpx.Client, body: bytes, mentions: str) -> None:
    response = client.post(
        "/v1/sessions", content=body, headers={"content-type": "application/json"}
    )
    assert_error(response, 400, "invalid_request", mentions)
    assert_kept_alive(client, response)


def test_metadata_nested_300_deep_is_400_and_creates_nothing(client: httpx.Client) -> None:
    deep: Any = 1
    for _ in range(300):
        deep = {"a": deep}
    response = client.post("/v1/sessions", json={"session_id": "deep-300", "metadata": deep})
    assert_error(response, 400, "invalid_request", r"depth|deep|nest")
    assert_kept_alive(client, response)
    assert_error(client.get("/v1/sessions/deep-300"), 404, "session_not_found", "deep-300")


def _chat(model: str, **fields: Any) -> dict[str, Any]:
    return {"model": model, "messages": [USER], "max_tokens": 2, **fields}


CHAT_BODIES = {
    "content-surrogate": (
        lambda m: raw_json(
            _chat(m, messages=[{"role": "user", "content": "@s"}]), s=LONE_SURROGATE
        ),
        400,
        "invalid_request",
        SURROGATE,
    ),
    "name-surrogate": (
        lambda m: raw_json(_chat(m, messages=[{**USER, "name": "@s"}]), s=LONE_SURROGATE),
        400,
        "invalid_request",
        SURROGATE,
    ),
    "message-extra-int-2**64": (
        lambda m: raw_json(_chat(m, messages=[{**USER, "extra": 2**64}])),
        400,
        "invalid_request",
        INT64,
    ),
    "tool_choice-function-str": (
        lambda m: raw_json(_chat(m, tools=[TOOL], tool_choice={"function": "str"})),
        400,
        "invalid_request",
        r"tool_choice",
    ),
    "seed-2**64": (lambda m: raw_json(_chat(m, seed=2**64)), 400, "invalid_request", r"seed"),
    "unknown-model": (
        lambda m: raw_json(_chat("no-such-model")),
        404,
        "model_not_found",
        r"no-such-model",
    ),
    "tool-message-without-tool_call_id": (
        lambda m: raw_json(_chat(m, messages=[USER, {"role": "tool", "content": "42"}])),
        400,
        "invalid_request",
        r"tool_call_id",
    ),
    "tool-parameters-5": (
        lambda m: raw_json(
            _chat(m, tools=[{"type": "function", "function": {"name": "f", "parameters": 5}}])
        ),
        400,
        "invalid_request",
        r"parameters|schema",
    ),
    "tool-parameters-type-5": (
        lambda m: raw_json(
            _chat(
                m,
                tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}],
            )
        ),
        400,
        "invalid_request",
        r"parameters|schema",
    ),
    "not-json": (lambda m: b'{"model": "x", "messages": [', 400, "invalid_request", r"json"),
    "empty-body": (lambda m: b"", 400, "invalid_request", r"body|json|empty|missing|required"),
}


@pytest.mark.parametrize(
    "body, status, code, mentions", CHAT_BODIES.values(), ids=CHAT_BODIES.keys()
)
def test_hostile_chat_bodies_get_their_4xx_and_record_nothing(
    client: httpx.Client, model: str, body: Any, status: int, code: str, mentions: str
) -> None:
    session = open_session(client)
    response = client.post(
        chat_url(session), content=body(model), headers={"content-type": "application/json"}
    )
    assert_error(response, status, code, mentions)
    assert_kept_alive(client, response)
    assert client.get(f"/v1/sessions/{session['session_id']}").json()["turns"] == 0


def test_an_assistant_tool_call_without_its_fields_on_turn_2_is_400(
    client: httpx.Client, model: str
) -> None:
    session = open_session(client)
    first = client.post(chat_url(session), json=_chat(model))
    assert first.status_code == 200, first.text
    broken = {"role": "assistant", "content": None, "tool_calls": [{"function": "x"}]}
    second = client.post(chat_url(session), json=_chat(model, messages=[USER, broken, USER]))
    assert_error(second, 400, "invalid_request", r"tool_calls|function")
    assert_kept_alive(client, second)
    assert client.get(f"/v1/sessions/{session['session_id']}").json()["turns"] == 1


@pytest.mark.parametrize("endpoint, field", [("reward", "value"), ("close", "reward")])
@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "1e309", "false"])
def test_rewards_must_be_finite_numbers(
    client: httpx.Client, endpoint: str, field: str, value: str
) -> None:
    session = open_session(client)
    path = f"/v1/sessions/{session['session_id']}"
    body = raw_json({field: "@v"}, v=value)
    response = client.post(
        f"{path}/{endpoint}", content=body, headers={"content-type": "application/json"}
    )
    assert_error(response, 400, "invalid_request", FINITE)
    assert_kept_alive(client, response)
    assert client.get(path).json()["closed"] is False


@pytest.mark.parametrize(
    "method, path, status, code, mentions",
    [
        ("GET", "/v1/no-such-route", 404, "not_found", r"not found|no-such-route"),
        ("POST", "/no/such/route", 404, "not_found", r"not found|/no/such/route"),
        ("GET", "/v1/chat/completions", 405, "method_not_allowed", r"method|GET"),
        ("DELETE", "/v1/sessions", 405, "method_not_allowed", r"method|DELETE"),
    ],
)
def test_unknown_routes_and_methods_answer_the_error_body(
    client: httpx.Client, method: str, path: str, status: int, code: str, mentions: str
) -> None:
    response = client.request(method, path)
    assert_error(response, status, code, mentions)
    assert_kept_alive(client, response)


@pytest.mark.parametrize(
    "size, chunked",
    [(70_000_000, False), (100_000_000, False), (100_000_000, True)],
    ids=["70MB", "100MB", "100MB-chunked"],
)
def test_a_large_body_is_refused_at_once_without_stalling_or_growing(
    gateway: GatewayProcess, client: httpx.Client, model: str, size: int, chunked: bool
) -> None:
    session = open_session(client)
    started, health = threading.Event(), []

    def probe() -> None:  # another client, while the big request is in flight
        started.wait(60)
        health.append(httpx.get(f"{gateway.url}/health", timeout=5).status_code)

    memory = PeakRss(gateway.proc.pid)
    memory.reset()
    prober = threading.Thread(target=probe)
    prober.start()
    headers = {"content-type": "application/json"}
    if not chunked:
        headers["content-length"] = str(size)
    response = client.post(
        chat_url(session), content=lazy_body(model, size, started), headers=headers
    )
    prober.join()
    assert_error(response, 413, "request_too_large", r"large|limit|bytes|size")
    assert health == [200], "/health must answer while a large body is refused"
    assert memory.growth_mb() < 100, f"gateway RSS grew {memory.growth_mb():.0f} MB"
    assert client.get("/health").status_code == 200


def test_a_half_sent_body_is_408_after_the_body_deadline(gateway: GatewayProcess) -> None:
    status, body = half_sent(gateway.port, "/v1/sessions", 1000, b'{"group": ', timeout=30)
    assert status == 408, body
    assert body["error"]["code"] == "request_timeout" and body["error"]["message"], body
    assert httpx.get(f"{gateway.url}/health", timeout=5).status_code == 200
