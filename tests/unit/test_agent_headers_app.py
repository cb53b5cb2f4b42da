"""Agent headers through the real app (issue 35, point 2): an unusable agent id is a 400 naming
its header, in every API's error body and on every session scope; a valid identity, or a
malformed Codex turn metadata, is served. The app and stand-in backend of
test_kept_bodies_app.py (publishing to memory)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.test_kept_bodies_app import app_and_client

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
ANTHROPIC = {**CHAT, "system": "be brief"}
RESPONSES = {"model": "tiny", "input": "hi", "max_output_tokens": 2}


@pytest.mark.parametrize(
    ("path", "body", "headers", "param"),
    [
        (
            "/v1/chat/completions",
            CHAT,
            {"X-Session-Id": "s1", "X-Turnstream-Agent": "x" * 129},
            "x-turnstream-agent",
        ),
        (
            "/sessions/s2/v1/chat/completions",
            CHAT,
            {"X-Turnstream-Agent": "a", "X-Turnstream-Parent-Agent": "p\x7f"},
            "x-turnstream-parent-agent",
        ),
        (
            "/v1/messages",
            ANTHROPIC,
            {"X-Claude-Code-Session-Id": "cc-1", "X-Claude-Code-Agent-Id": "a\x1b[31m"},
            "x-claude-code-agent-id",
        ),
        (
            "/v1/responses",
            RESPONSES,
            {"session-id": "cx-1", "thread-id": "t1", "x-codex-parent-thread-id": "t1"},
            "x-codex-parent-thread-id",
        ),
    ],
    ids=["chat too long", "chat scoped DEL", "anthropic escape", "codex own parent"],
)
async def test_an_unusable_agent_header_is_a_400_naming_it(
    tiny_model_dir: Path, path: str, body: dict[str, object], headers: dict[str, str], param: str
) -> None:
    _, client, publisher = app_and_client(tiny_model_dir)
    if path.startswith("/sessions/"):
        assert (await client.post("/v1/sessions", json={"session_id": "s2"})).status_code == 200

    answer = await client.post(path, json=body, headers=headers)

    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert param in error["message"]
    if path != "/v1/messages":  # Anthropic's error body has no param
        assert error["param"] == param
    assert publisher.turns == []


async def test_agents_named_by_the_clients_are_served(tiny_model_dir: Path) -> None:
    _, client, publisher = app_and_client(tiny_model_dir)
    sent = [
        ("/v1/chat/completions", CHAT, {"X-Session-Id": "s", "X-Turnstream-Agent": "agent—ü"}),
        ("/v1/messages", ANTHROPIC, {"X-Claude-Code-Session-Id": "cc", "X-Claude-Code-Agent-Id":
                                     "a9e64a5ca0980ef44", "X-Claude-Code-Agent-Type": "fork"}),
        ("/v1/responses", RESPONSES, {"session-id": "cx", "thread-id": "t2",
                                      "x-codex-parent-thread-id": "t1",
                                      "x-codex-turn-metadata": "{not json"}),
    ]  # fmt: skip

    for path, body, headers in sent:
        utf8 = {k.encode(): v.encode() for k, v in headers.items()}  # the bytes on the wire
        answer = await client.post(path, json=body, headers=utf8)
        assert answer.status_code == 200, answer.text

    assert len(publisher.turns) == 3
