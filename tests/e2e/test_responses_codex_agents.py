"""Codex's multi-agent tools through a real gateway (issue 35, point 3): the real ``openai``
SDK sends what Codex 0.169.0 sends -- a ``namespace`` tool (v1 ``multi_agent_v1``, v2
``collaboration``), v2's task as an ``agent_message`` with an ``encrypted_content`` part, a
``tool_choice`` naming the namespace's function -- to a real gateway (``--backend vllm``) in
front of the benchmarks' fixed-latency vLLM stand-in (benchmarks/harness/fixed_latency_backend.py),
one per version, scripted (``--tokens``) to call ``<namespace>__spawn_agent`` as the gateway
offers it (flattened). Both namespaces are offered in every request.

Why a scripted backend: the tiny model emits noise and never decides to spawn an agent. Only
the *choice* of tokens is scripted -- the tokenizer's ids of the template's hermes call text
and ``<|im_end|>``, as tests/agents/scripted_backend.py writes them; since the tool_choice
makes the gateway open the call in the prompt (the parser's ``forced_prefix``), the reply is
the rest of the call. Everything else is real: the gateway's rendering, the forced opening, the
parsing of the call, the namespace restored on the items, the recording of the turns. (This
test used to fit the tiny model to both versions' calls, ~50 s of its fixture.) The backend
answers every request alike: the second turn's reply is that text again, read as content (no
call opens it), which nothing here looks at.

The model's call must come back as the item Codex reads (``namespace`` and the bare name, in
the stream's items and the response), and those items sent back must continue the turn token
for token: the second turn's ``prefix_len`` is the first turn's whole context.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from eventlog.server import NatsServer
from gateway.tools.hermes import HermesParser
from tests.e2e.test_responses_api import turns_of
from tests.helpers.gateway_process import GatewayProcess
from tests.helpers.scripted_gateway import scripted_gateway

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


TOOLS = [V1, V2]  # two namespaces in one request: both recorded, each call restored to its own


def forced_rest(tokenizer: Any, ns: str) -> list[int]:
    """The scripted reply to a turn whose tool_choice names ``<ns>__spawn_agent``: what the
    model writes after the call opening the gateway appends to the prompt (the hermes parser's
    ``forced_prefix``: ``<tool_call>\\n{"name": "<ns>__spawn_agent", "arguments": ``), i.e. the
    arguments and the call's close, in the template's format, then the end-of-turn token."""
    name = f"{ns}__spawn_agent"
    call = f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": {json.dumps(SPAWNS[ns])}}}'
    forced = HermesParser().forced_prefix(name)
    assert call.startswith(forced)
    rest = call.removeprefix(forced) + "\n</tool_call>"
    ids = [*tokenizer.encode(rest, add_special_tokens=False)]
    return [*ids, int(tokenizer.convert_tokens_to_ids("<|im_end|>"))]


@pytest.fixture(scope="module")
def gateways(
    nats_server: NatsServer, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, GatewayProcess]]:
    """One stack per version, by namespace: its backend scripted to spawn in that version."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    with contextlib.ExitStack() as stacks:
        yield {
            ns: stacks.enter_context(
                scripted_gateway(
                    nats_server.url,
                    tiny_model_dir,
                    tmp_path_factory.mktemp(f"codex-{ns}"),
                    forced_rest(tokenizer, ns),
                )
            )[0]
            for ns in SPAWNS
        }


@pytest.mark.parametrize(("tools", "prompt"), [(V1, V1_PROMPT), (V2, V2_PROMPT)], ids=["v1", "v2"])
def test_a_namespaces_call_comes_back_namespaced_and_its_echo_continues_the_turn(
    gateways: dict[str, GatewayProcess], nats_server: NatsServer, tools: dict[str, Any], prompt: Any
) -> None:
    ns = tools["name"]
    session = gateways[ns].session()
    sid = str(session["session_id"])
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
    gateways: dict[str, GatewayProcess],
) -> None:
    session = gateways["multi_agent_v1"].session()
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
