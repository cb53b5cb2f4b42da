"""Codex's multi-agent tools through a real gateway (issue 35, point 3): the real ``openai``
SDK sends what Codex 0.169.0 sends -- a ``namespace`` tool (v1 ``multi_agent_v1``, v2
``collaboration``), v2's task as an ``agent_message`` with an ``encrypted_content`` part -- to
a gateway serving the tiny model, fitted here to call ``<namespace>__spawn_agent`` as the
gateway offers it (flattened). Both namespaces are offered in every request, so that one model
fitted to both versions' calls sees the very prompt it was fitted on.

The model's call must come back as the item Codex reads (``namespace`` and the bare name, in
the stream's items and the response), and those items sent back must continue the turn token
for token: the second turn's ``prefix_len`` is the first turn's whole context.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from eventlog.server import NatsServer
from tests.e2e.test_responses_api import turns_of
from tests.helpers.gateway_process import GatewayProcess
from tests.helpers.tiny_model import overfit_tool_calls

pytestmark = pytest.mark.integration


DESCRIBED = "Tools for spawning and managing sub-agents."


def namespace(name: str, spawn: dict[str, Any]) -> dict[str, Any]:
    """A multi-agent namespace as Codex sends it, shortened to two functions (the whole v1 and
    v2 lists: tests/unit/test_responses_namespaces.py)."""

    def function(inner: str, description: str, properties: dict[str, Any]) -> dict[str, Any]:
        return {
            "type": "function",
            "name": inner,
            "description": description,
            "strict": False,
            "parameters": {"type": "object", "properties": properties},
        }

    return {
        "type": "namespace",
        "name": name,
        "description": DESCRIBED,
        "tools": [
            function("spawn_agent", "Spawn an agent.", spawn),
            function("wait_agent", "Wait for agents.", {}),
        ],
    }


V1 = namespace("multi_agent_v1", {"message": {"type": "string"}})
V2 = namespace(
    "collaboration",
    {"task_name": {"type": "string"}, "message": {"type": "string", "encrypted": True}},
)
TASK = "Ask a helper for the weather."
V1_PROMPT = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": TASK}]}
HEADER = "Message Type: NEW_TASK\nSender: /user\nPayload:\n"
V2_PROMPT = {  # the shape of v2's agent_message (the capture's NEW_TASK to a sub-agent)
    "type": "agent_message",
    "author": "/user",
    "recipient": "/root",
    "content": [
        {"type": "input_text", "text": HEADER},
        {"type": "encrypted_content", "encrypted_content": TASK},
    ],
}
SPAWNS = {
    "multi_agent_v1": {"message": "Find the weather."},
    "collaboration": {"task_name": "weather", "message": "Find the weather."},
}


def offered(namespaces: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tools as the model is offered them: each namespace's functions, flattened."""
    return [
        {
            "type": "function",
            "function": {
                "name": f"{ns['name']}__{function['name']}",
                "description": function["description"],
                "parameters": function["parameters"],
            },
        }
        for ns in namespaces
        for function in ns["tools"]
    ]


def transcript(ns: str, prompt: str) -> list[dict[str, Any]]:
    call = {"name": f"{ns}__spawn_agent", "arguments": json.dumps(SPAWNS[ns])}
    return [
        {"role": "user", "content": prompt},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_0", "type": "function", "function": call}],
        },
    ]


TOOLS = [V1, V2]  # one model fitted to both versions' calls: the same tools for both


@pytest.fixture(scope="module")
def gateway(
    nats_server: NatsServer, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    """The tiny model fitted to spawn in either version, served."""
    fitted = overfit_tool_calls(
        tiny_model_dir,
        tmp_path_factory.mktemp("codex-model") / "model",
        [transcript("multi_agent_v1", TASK), transcript("collaboration", HEADER + TASK)],
        offered(TOOLS),
    )
    process = GatewayProcess(nats_server.url, fitted, tmp_path_factory.mktemp("gateway"))
    yield process
    process.stop()


@pytest.mark.parametrize(("tools", "prompt"), [(V1, V1_PROMPT), (V2, V2_PROMPT)], ids=["v1", "v2"])
def test_a_namespaces_call_comes_back_namespaced_and_its_echo_continues_the_turn(
    gateway: GatewayProcess, nats_server: NatsServer, tools: dict[str, Any], prompt: Any
) -> None:
    session = gateway.session()
    sid, ns = str(session["session_id"]), tools["name"]
    client = openai.OpenAI(base_url=str(session["base_url"]), api_key="x", max_retries=0)
    ask: dict[str, Any] = {
        "model": "tiny",
        "tools": TOOLS,
        "temperature": 0,
        "max_output_tokens": 96,
        "store": False,
        "include": ["reasoning.encrypted_content"],
    }
    # A named tool_choice opens the call in the prompt; named as Codex's items name it.
    choice = {"type": "function", "namespace": ns, "name": "spawn_agent"}
    history: list[Any] = [prompt]

    events = list(client.responses.create(input=history, tool_choice=choice, stream=True, **ask))
    items = [e for e in events if e.type.startswith("response.output_item.")]
    assert [(e.type, e.item.type, e.item.namespace, e.item.name) for e in items] == [
        ("response.output_item.added", "function_call", ns, "spawn_agent"),
        ("response.output_item.done", "function_call", ns, "spawn_agent"),
    ]
    response = events[-1].response
    [call] = response.output
    assert (call.namespace, call.name) == (ns, "spawn_agent")  # type: ignore[union-attr]
    assert json.loads(call.arguments) == SPAWNS[ns]  # type: ignore[union-attr]
    [first] = turns_of(nats_server, sid)
    assert first.tool_calls[0]["function"]["name"] == f"{ns}__spawn_agent"
    assert first.request["tool_namespaces"] == [
        {"name": n["name"], "functions": ["spawn_agent", "wait_agent"], "description": DESCRIBED}
        for n in (V1, V2)
    ]
    # v2's agent_message: a user message, its encrypted_content part's string as it came
    text = HEADER + TASK if ns == "collaboration" else TASK
    assert first.new_messages == [{"role": "user", "content": text}]

    # Codex sends the done items back verbatim, then the spawn's output.
    done = [e.item.model_dump(exclude_none=True) for e in items if e.type.endswith(".done")]
    assert done[0]["namespace"] == ns
    spawned = {"agent_id": "019a2b3c-0000-7000-8000-000000000001", "nickname": "Boole"}
    history += [
        *done,
        {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps(spawned)},
    ]
    second = client.responses.create(input=history, **ask)
    assert second.id.startswith("resp_")
    first, after = turns_of(nats_server, sid)
    assert after.parent_turn == first.turn
    assert after.prefix_len == first.prefix_len + len(first.prompt_ids) + len(first.completion_ids)
    assert [m["role"] for m in after.new_messages] == ["tool"]


def test_malformed_namespaces_and_agent_messages_are_400s_naming_the_field(
    gateway: GatewayProcess,
) -> None:
    session = gateway.session()
    url = f"{session['base_url']}/responses"
    spawn = V1["tools"][0]
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({"tools": [{**V1, "tools": []}]}, "tools.0.namespace.tools", "at least 1"),
        (
            {"tools": [{**V1, "tools": [{"type": "custom", "name": "x"}]}]},
            "tools.0.namespace.tools.0",
            "'custom' inside a namespace",
        ),
        ({"tools": [{**V1, "name": "multi agent"}]}, "tools.0.namespace.name", "characters"),
        (
            {"tools": [{**spawn, "name": "multi_agent_v1__spawn_agent"}, V1]},
            "tools.1",
            "the name of function tool 'multi_agent_v1__spawn_agent'",
        ),
        ({"input": [{**V2_PROMPT, "content": []}]}, "input.list.0.agent_message.content", "1"),
        (
            {"input": [{**V2_PROMPT, "content": [{"type": "encrypted_content", "x": 1}]}]},
            "input.list.0.agent_message.content.list.0.encrypted.encrypted_content",
            "required",
        ),
        ({"input": [{"type": "agent_memo"}]}, "input", "agent_message"),
    ]
    for extra, param, words in cases:
        refused = httpx.post(url, json={"model": "tiny", "input": "hi", **extra})
        assert refused.status_code == 400, (extra, refused.text)
        error = refused.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert error["param"].startswith(param) and words in error["message"], (extra, error)
