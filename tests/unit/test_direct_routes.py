"""The short path of the POST routes whose inputs are a body model and the request
(``gateway.http.app.GatewayApp``): the same answers as FastAPI's path, errors included."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.unit.test_logprobs_probe import StandInVLLM
from tests.unit.test_logprobs_refusal import _Publisher, stand_in_app

HI: Any = [{"role": "user", "content": "hi"}]


def gateway(
    tiny_model_dir: Path, server: StandInVLLM, api_keys: tuple[str, ...] = ()
) -> tuple[httpx.AsyncClient, Any, _Publisher]:
    app, publisher = stand_in_app(tiny_model_dir, server, api_keys=api_keys)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw")
    return client, app, publisher


def test_the_turn_routes_are_served_directly(tiny_model_dir: Path) -> None:
    _, app, _ = gateway(tiny_model_dir, StandInVLLM("processed_logprobs"))
    # Routes with path parameters or header parameters (session creation) take FastAPI's path.
    assert sorted(app._direct) == [
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/responses",
    ]


async def test_a_turn_is_answered_and_recorded(tiny_model_dir: Path) -> None:
    client, app, publisher = gateway(tiny_model_dir, StandInVLLM("processed_logprobs"))
    reply = await client.post(
        "/v1/chat/completions",
        json={"model": "tiny", "messages": HI, "max_tokens": 3},
        headers={"X-Session-Id": "s-1"},
    )
    assert reply.status_code == 200, reply.text
    assert reply.headers["content-type"] == "application/json"
    body = reply.json()
    assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] == 3
    [turn] = publisher.turns
    assert list(turn.completion_ids) == [72, 73, 74]
    # The schema documents the route; the latency is labelled with its path, as FastAPI's is.
    assert "/v1/chat/completions" in app.openapi()["paths"]
    text = (await client.get("/metrics")).text
    assert 'turnstream_gateway_request_seconds_count{route="/v1/chat/completions"} 1.0' in text


@pytest.mark.parametrize(
    ("content", "headers", "status", "code", "message"),
    [
        # validation errors: FastAPI's own path answers, with the app's 400
        (b'{"messages": []}', {}, 400, "invalid_request", "messages: List should have"),
        (b'{"messages": "hi"}', {}, 400, "invalid_request", "messages: Input should be"),
        (b"[1]", {}, 400, "invalid_request", "Input should be a valid dictionary"),
        (b"{not json", {}, 400, "invalid_request", "not valid JSON"),
        # not application/json: FastAPI's path reads the body as bytes
        (
            b'{"messages": [{"role": "user", "content": "hi"}]}',
            {"content-type": "text/plain"},
            400,
            "invalid_request",
            "Input should be a valid dictionary",
        ),
        # errors raised by the endpoint on the short path
        (
            b'{"model": "other", "messages": [{"role": "user", "content": "hi"}]}',
            {},
            404,
            "model_not_found",
            "model 'other' is not served here",
        ),
        (
            b'{"messages": [{"role": "user", "content": "hi"}]}',
            {"X-Session-Id": ""},
            400,
            "invalid_request",
            "a session header is required",
        ),
        (
            b'{"messages": [{"role": "user", "content": "hi"}]}',
            {"X-Session-Id": "a b"},
            400,
            "invalid_request",
            "must match",
        ),
    ],
    ids=[
        "empty-messages",
        "wrong-type",
        "not-an-object",
        "malformed",
        "text-plain",
        "unknown-model",
        "no-session",
        "bad-session-id",
    ],
)
async def test_errors_are_openai_bodies_with_their_status(
    tiny_model_dir: Path,
    content: bytes,
    headers: dict[str, str],
    status: int,
    code: str,
    message: str,
) -> None:
    server = StandInVLLM("processed_logprobs")
    client, _, publisher = gateway(tiny_model_dir, server)
    sent = {"content-type": "application/json", "X-Session-Id": "s-1", **headers}
    reply = await client.post("/v1/chat/completions", content=content, headers=sent)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["code"] == code and message in error["message"], error
    assert server.generations == [] and publisher.turns == []


async def test_keys_are_checked_before_the_route(tiny_model_dir: Path) -> None:
    client, _, publisher = gateway(
        tiny_model_dir, StandInVLLM("processed_logprobs"), api_keys=("k1=runA",)
    )
    body = {"messages": HI, "max_tokens": 3, "stream": True}
    session = {"X-Session-Id": "s-1"}
    missing = await client.post("/v1/chat/completions", json=body, headers=session)
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
    other_run = await client.post(
        "/v1/chat/completions",
        json=body,
        headers={**session, "Authorization": "Bearer k1", "X-Run-Id": "runB"},
    )
    assert other_run.status_code == 403, other_run.text
    served = await client.post(
        "/v1/chat/completions", json=body, headers={**session, "Authorization": "Bearer k1"}
    )
    assert served.status_code == 200, served.text
    [turn] = publisher.turns
    assert turn.run == "runA"


async def test_a_streamed_turn_is_served_directly(tiny_model_dir: Path) -> None:
    client, _, publisher = gateway(tiny_model_dir, StandInVLLM("processed_logprobs"))
    reply = await client.post(
        "/v1/chat/completions",
        json={"messages": HI, "max_tokens": 3, "stream": True},
        headers={"X-Session-Id": "s-1"},
    )
    assert reply.status_code == 200
    assert reply.headers["content-type"].startswith("text/event-stream")
    assert reply.text.rstrip().endswith("data: [DONE]")
    assert len(publisher.turns) == 1


@pytest.mark.parametrize(
    ("tail", "names", "body"),
    [
        (
            "/chat/completions",
            ("session_chat", "header_chat", "run_session_chat"),
            {"messages": HI, "max_tokens": 1},
        ),
        (
            "/completions",
            ("session_complete", "header_complete", "run_session_complete"),
            {"prompt": "hi", "max_tokens": 1},
        ),
        ("/models", ("session_model_list", "list_models", "run_session_model_list"), None),
        (
            "/responses",
            ("session_responses", "header_responses", "run_session_responses"),
            {"input": "hi"},
        ),
        (
            "/messages",
            ("session_messages", "header_messages", "run_session_messages"),
            {"model": "tiny", "messages": HI, "max_tokens": 1},
        ),
        (
            "/messages/count_tokens",
            ("session_count_tokens", "count_tokens", "run_session_count_tokens"),
            {"model": "tiny", "messages": HI},
        ),
    ],
)
async def test_a_route_added_once_answers_at_three_paths(
    tiny_model_dir: Path, tail: str, names: tuple[str, ...], body: Any
) -> None:
    """``ScopedRoutes.add``: the session's URL, /v1 with a session header, any run's URL; each
    documented under its own operation id, with its path parameters."""
    client, app, publisher = gateway(tiny_model_dir, StandInVLLM("processed_logprobs"))
    method = "post" if body is not None else "get"
    paths = app.openapi()["paths"]
    session_url = f"/sessions/{{session_id}}/v1{tail}"
    run_url = f"/runs/{{run}}/sessions/{{session_id}}/v1{tail}"
    for path, name in zip((session_url, f"/v1{tail}", run_url), names, strict=True):
        operation = paths[path][method]
        assert operation["operationId"].startswith(f"{name}_"), (path, operation["operationId"])
        in_path = [p["name"] for p in operation.get("parameters", []) if p["in"] == "path"]
        assert in_path == [n for n in ("run", "session_id") if f"{{{n}}}" in path], path
    # The session's URL and any run's answer alike: a session that does not exist is 404 (only
    # a session header opens one).
    for path in (session_url, run_url):
        url = path.format(run="run", session_id="missing")
        reply = await client.request(method.upper(), url, json=body)
        assert reply.status_code == 404, (url, reply.text)
    assert publisher.turns == []
