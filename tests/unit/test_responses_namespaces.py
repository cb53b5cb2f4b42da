"""Codex's multi-agent tools and items as Codex 0.169.0 sends them (issue 35, point 3): namespace
tools offered flattened (``<namespace>__<name>``), the namespace restored on the model's
``function_call`` item and flattened again when Codex echoes it, v2's ``agent_message`` items
and ``encrypted_content`` parts rendered as the client sent them.

The tool lists and items below are literal JSON shaped from the capture
(``../shared/agent-clis/subagents/README.md`` section 2; the v1 namespace's shape is the one in
``tests/fixtures/agents/codex/request_1.json``), shortened descriptions aside.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai.types.responses import Response as SDKResponse
from pydantic import ValidationError

from gateway.core.conversation import message_key
from gateway.errors import InvalidRequest
from gateway.protocol.responses import ResponsesRequest
from tests.unit.test_responses_protocol import EVENTS, canonical, parse_sse, serving_for

FIXTURES = Path(__file__).parents[1] / "fixtures" / "agents" / "codex"


def function(name: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "type": "function",
        "name": name,
        "description": f"{name} (Codex's description, shortened)",
        "strict": False,
        "parameters": {
            "type": "object",
            "properties": properties,
            "required": required,
            "additionalProperties": False,
        },
    }


STRING, TARGETS = {"type": "string"}, {"type": "array", "items": {"type": "string"}}
EXEC = function("exec_command", {"cmd": STRING}, ["cmd"])
V1 = {
    "type": "namespace",
    "name": "multi_agent_v1",
    "description": "Tools for spawning and managing sub-agents.",
    "tools": [
        function("close_agent", {"target": STRING}, ["target"]),
        function("resume_agent", {"id": STRING}, ["id"]),
        function("send_input", {"target": STRING, "message": STRING}, ["target"]),
        function(
            "spawn_agent",
            {
                "message": STRING,
                "items": {"type": "array", "items": {"type": "object"}},
                "fork_context": {"type": "boolean"},
                "model": STRING,
                "reasoning_effort": STRING,
            },
            [],
        ),
        function("wait_agent", {"targets": TARGETS, "timeout_ms": {"type": "number"}}, ["targets"]),
    ],
}
V2 = {
    "type": "namespace",
    "name": "collaboration",
    "description": "Tools for working in a team of agents.",
    "tools": [
        function(
            "spawn_agent",
            {
                "task_name": STRING,
                "message": {"type": "string", "encrypted": True},
                "fork_turns": {"type": "string", "enum": ["all", "none"]},
            },
            ["task_name", "message"],
        ),
        function("wait_agent", {"timeout_ms": {"type": "number"}}, []),
        function("send_message", {"target": STRING, "message": STRING}, ["target", "message"]),
        function("followup_task", {"target": STRING, "message": STRING}, ["target", "message"]),
        function("interrupt_agent", {"target": STRING}, ["target"]),
        function("list_agents", {}, []),
    ],
}
WEB_SEARCH = {"type": "web_search", "external_web_access": True}
DEVELOPER = {
    "type": "message",
    "id": "msg_204d22b7",
    "role": "developer",
    "content": [{"type": "input_text", "text": "You are a coding agent running in the Codex CLI."}],
}
PROMPT = {
    "type": "message",
    "id": "msg_01a2",
    "role": "user",
    "content": [{"type": "input_text", "text": "Spawn a fork and a fresh agent."}],
}


def spawn_call(namespace: str, call_id: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """A spawn call as Codex echoes the model's item back (the fake server's ``fcall``)."""
    return {
        "id": "fc_" + call_id,
        "type": "function_call",
        "status": "completed",
        "name": "spawn_agent",
        "namespace": namespace,
        "call_id": call_id,
        "arguments": json.dumps(arguments),
    }


def flat_call(name: str, call_id: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


# -- tools --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("namespace", "functions"),
    [
        (V1, ["close_agent", "resume_agent", "send_input", "spawn_agent", "wait_agent"]),
        (
            V2,
            [
                *("spawn_agent", "wait_agent", "send_message"),
                *("followup_task", "interrupt_agent", "list_agents"),
            ],
        ),
    ],
    ids=["v1", "v2"],
)
def test_a_namespaces_functions_are_offered_flattened_and_the_namespace_recorded(
    namespace: dict[str, Any], functions: list[str]
) -> None:
    request = canonical({"input": [DEVELOPER, PROMPT], "tools": [EXEC, namespace, WEB_SEARCH]})
    ns = namespace["name"]
    assert request.tools == [
        {
            "type": "function",
            "function": {
                "name": EXEC["name"],
                "description": EXEC["description"],
                "parameters": EXEC["parameters"],
            },
        },
        *(
            {
                "type": "function",
                "function": {
                    "name": f"{ns}__{inner['name']}",
                    "description": inner["description"],
                    "parameters": inner["parameters"],
                },
            }
            for inner in namespace["tools"]
        ),
    ]
    assert request.extras["tool_namespaces"] == [
        {"name": ns, "functions": functions, "description": namespace["description"]}
    ]
    assert request.extras["unoffered_tools"] == [WEB_SEARCH]


def test_codexs_captured_namespace_is_offered() -> None:
    body = json.loads((FIXTURES / "request_1.json").read_text())["body"]
    request = canonical(body)
    names = [t["function"]["name"] for t in request.tools or ()]
    assert "multi_agent_v1__spawn_agent" in names and "multi_agent_v1__wait_agent" in names
    assert [t["type"] for t in request.extras["unoffered_tools"]] == ["web_search"]


@pytest.mark.parametrize(
    "choice",
    [
        {"type": "function", "namespace": "multi_agent_v1", "name": "spawn_agent"},
        {"type": "function", "name": "multi_agent_v1__spawn_agent"},
    ],
    ids=["namespace-field", "flattened"],
)
def test_tool_choice_naming_a_namespaces_function_forces_its_flattened_name(
    choice: dict[str, Any],
) -> None:
    request = canonical({"input": "go", "tools": [EXEC, V1], "tool_choice": choice})
    assert request.tool_choice == {
        "type": "function",
        "function": {"name": "multi_agent_v1__spawn_agent"},
    }


# -- input items --------------------------------------------------------------------------------


def test_codex_v1s_spawn_calls_echoed_are_flattened_and_notifications_are_user_text() -> None:
    fork = {"message": "MARK_CX_FORK_0: run `echo SUB-FORK`", "fork_context": True}
    fresh = {"message": "MARK_CX_FRESH1_1: run `echo SUB-FRESH1`", "fork_context": False}
    notification = (
        '<subagent_notification>\n{"agent_path":"019a-fork","status":{"completed":"SUBRESULT-FORK'
        '"}}\n</subagent_notification>'
    )
    items = [
        DEVELOPER,
        PROMPT,
        spawn_call("multi_agent_v1", "call_sp1", fork),
        spawn_call("multi_agent_v1", "call_sp2", fresh),
        {"type": "function_call_output", "call_id": "call_sp1", "output": '{"agent_id":"019a"}'},
        {"type": "function_call_output", "call_id": "call_sp2", "output": '{"agent_id":"019b"}'},
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": notification}],
        },
    ]
    messages = canonical({"input": items, "tools": [EXEC, V1]}).messages
    assert [m["role"] for m in messages] == [
        *("developer", "user", "assistant", "tool", "tool", "user"),
    ]
    assert messages[2] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            flat_call("multi_agent_v1__spawn_agent", "call_sp1", json.dumps(fork)),
            flat_call("multi_agent_v1__spawn_agent", "call_sp2", json.dumps(fresh)),
        ],
    }
    assert messages[-1] == {"role": "user", "content": notification}


NEW_TASK = {
    "type": "agent_message",
    "author": "/root",
    "recipient": "/root/fresh1",
    "content": [
        {
            "type": "input_text",
            "text": "Message Type: NEW_TASK\nTask name: /root/fresh1\nSender: /root\nPayload:\n",
        },
        {"type": "encrypted_content", "encrypted_content": "MARK_CX_FRESH1_1: run `echo SUB`"},
    ],
}
FINAL_ANSWER = {
    "type": "agent_message",
    "author": "/root/fork",
    "recipient": "/root",
    "content": [
        {
            "type": "input_text",
            "text": "Message Type: FINAL_ANSWER\nTask name: /root\nSender: /root/fork\nPayload:\n"
            "SUBRESULT-FORK: the command printed SUB-FORK",
        }
    ],
}


def test_codex_v2s_agent_messages_are_user_messages_with_the_content_as_sent() -> None:
    """A fresh v2 sub-agent's first request ends with its task; the parent later reads the
    child's answer. The encrypted_content string is the text, as it came: nothing decrypted."""
    fresh = canonical({"input": [DEVELOPER, NEW_TASK], "tools": [EXEC]}).messages
    assert fresh[-1] == {
        "role": "user",
        "content": "Message Type: NEW_TASK\nTask name: /root/fresh1\nSender: /root\nPayload:\n"
        "MARK_CX_FRESH1_1: run `echo SUB`",
    }
    spawn = {"task_name": "fork", "message": "MARK_CX_FORK_0", "fork_turns": "all"}
    parent = canonical(
        {
            "input": [
                DEVELOPER,
                PROMPT,
                spawn_call("collaboration", "call_sp1", spawn),
                {"type": "function_call_output", "call_id": "call_sp1", "output": "{}"},
                FINAL_ANSWER,
            ],
            "tools": [EXEC, V2],
        }
    ).messages
    assert parent[2]["tool_calls"][0]["function"]["name"] == "collaboration__spawn_agent"
    assert parent[-1] == {"role": "user", "content": FINAL_ANSWER["content"][0]["text"]}  # type: ignore[index]


def test_a_v2_forks_copy_of_its_parents_calls_renders_them_without_the_tools() -> None:
    """A v2 fork's first request: the parent's history (its spawn calls, each with a synthetic
    "aborted" output), new developer messages, the task. The fork is not offered the namespace,
    yet the calls render as the parent's turn recorded them."""
    spawns = [
        spawn_call("collaboration", "call_sp1", {"task_name": "fork", "message": "a"}),
        spawn_call("collaboration", "call_sp2", {"task_name": "fresh1", "message": "b"}),
    ]
    parent = canonical({"input": [DEVELOPER, PROMPT, *spawns], "tools": [EXEC, V2]}).messages
    aborted = [
        {"type": "function_call_output", "call_id": c["call_id"], "output": "aborted"}
        for c in spawns
    ]
    fork_items = [DEVELOPER, PROMPT, spawns[0], aborted[0], spawns[1], aborted[1], NEW_TASK]
    fork = canonical({"input": fork_items, "tools": [EXEC]}).messages
    assert message_key(fork[2]) == message_key(
        {**parent[2], "tool_calls": parent[2]["tool_calls"][:1]}
    )
    assert fork[4]["tool_calls"][0]["function"]["name"] == "collaboration__spawn_agent"


def test_encrypted_content_parts_of_a_message_item_are_its_text() -> None:
    item = {
        "type": "message",
        "role": "user",
        "content": [
            {"type": "input_text", "text": "Payload:\n"},
            {"type": "encrypted_content", "encrypted_content": "gAAAAB-opaque=="},
        ],
    }
    assert canonical({"input": [item]}).messages == [
        {"role": "user", "content": "Payload:\ngAAAAB-opaque=="}
    ]


# -- hostile input ------------------------------------------------------------------------------


def namespace(name: str = "ns", tools: Any = None) -> dict[str, Any]:
    return {"type": "namespace", "name": name, "tools": [EXEC] if tools is None else tools}


@pytest.mark.parametrize(
    ("body", "loc", "words"),
    [
        ({"tools": [namespace(tools=[])]}, "tools.0.namespace.tools", "at least 1"),
        ({"tools": [{"type": "namespace", "name": "ns"}]}, "tools.0.namespace.tools", "required"),
        (
            {"tools": [namespace(tools=[{"type": "custom", "name": "apply_patch"}])]},
            "tools.0.namespace.tools.0",
            "'custom' inside a namespace",
        ),
        (
            {"tools": [namespace(tools=[{"type": "web_search"}])]},
            "tools.0.namespace.tools.0",
            "only function tools",
        ),
        ({"tools": [namespace(tools=[5])]}, "tools.0.namespace.tools.0", ""),
        (
            {"tools": [namespace(tools=[{**EXEC, "parameters": {"type": "nope"}}])]},
            "tools.0.namespace.tools.0.parameters",
            "JSON schema",
        ),
        ({"tools": [namespace("multi agent")]}, "tools.0.namespace.name", "'multi agent'"),
        ({"tools": [namespace("a.b")]}, "tools.0.namespace.name", "letters, digits"),
        ({"tools": [namespace("ns\u202e")]}, "tools.0.namespace.name", "characters"),
        ({"tools": [namespace("x" * 65)]}, "tools.0.namespace.name", "64"),
        ({"tools": [namespace("")]}, "tools.0.namespace.name", "64"),
        ({"tools": [namespace(5)]}, "tools.0.namespace.name", "string"),  # type: ignore[arg-type]
        (
            {"tools": [namespace(tools=[{**EXEC, "name": "exec<tool_call>"}])]},
            "tools.0.namespace.tools.0.name",
            "'exec<tool_call>'",
        ),
        (
            {"tools": [{**EXEC, "name": "ns__exec_command"}, namespace()]},
            "tools.1",
            "the name of function tool 'ns__exec_command'",
        ),
        (
            {"tools": [namespace(), namespace()]},
            "tools.1",
            "of namespace 'ns' is offered to the model as 'ns__exec_command', the name of "
            "function 'exec_command' of namespace 'ns'",
        ),
        (
            {
                "tools": [
                    namespace("a__b", [{**EXEC, "name": "c"}]),
                    namespace("a", [{**EXEC, "name": "b__c"}]),
                ]
            },
            "tools.1",
            "'a__b__c'",
        ),
        (
            {"tools": [namespace(tools=[{**EXEC, "name": f"f{i}"} for i in range(1025)])]},
            "tools",
            "1025 tools offered",
        ),
        (
            {
                "tools": [
                    namespace(f"n{k}", [{**EXEC, "name": f"f{i}"} for i in range(600)])
                    for k in range(2)
                ]
            },
            "tools",
            "1200 tools offered, namespaces' functions each counted: at most 1024",
        ),
        (
            {"tools": [V1], "tool_choice": {"type": "function", "name": "spawn_agent"}},
            "tool_choice",
            "named with its namespace",
        ),
        (
            {
                "tools": [V1],
                "tool_choice": {"type": "function", "namespace": "collaboration", "name": "x"},
            },
            "tool_choice",
            "'collaboration__x', not among",
        ),
        (
            {"tools": [V1], "tool_choice": {"type": "function", "namespace": "a b", "name": "x"}},
            "tool_choice.FunctionChoice.namespace",
            "characters",
        ),
        (
            {"input": [{**NEW_TASK, "content": []}]},
            "input.list.0.agent_message.content.list",
            "at least 1",
        ),
        (
            {"input": [{**NEW_TASK, "content": ""}]},
            "input.list.0.agent_message.content.text",
            "at least 1",
        ),
        (
            {"input": [{"type": "agent_message", "author": "/root"}]},
            "input.list.0.agent_message.content",
            "required",
        ),
        (
            {
                "input": [
                    {**NEW_TASK, "content": [{"type": "encrypted_content", "encrypted_content": 5}]}
                ]
            },
            "input.list.0.agent_message.content.list.0.encrypted.encrypted_content",
            "string",
        ),
        (
            {"input": [{**NEW_TASK, "content": [{"type": "encrypted_content"}]}]},
            "input.list.0.agent_message.content.list.0.encrypted.encrypted_content",
            "required",
        ),
        (
            {"input": [{**NEW_TASK, "content": [{"type": "input_image"}]}]},
            "input.list.0.agent_message.content.list.0",
            "input_image",
        ),
        ({"input": [{**NEW_TASK, "author": 7}]}, "input.list.0.agent_message.author", "string"),
        (
            {"input": [{**NEW_TASK, "recipient": "x" * 2000}]},
            "input.list.0.agent_message.recipient",
            "1024",
        ),
        (
            {
                "input": [
                    {
                        "role": "user",
                        "content": [{"type": "encrypted_content", "encrypted_content": None}],
                    }
                ]
            },
            "input.list.0.message.content.list.0.encrypted.encrypted_content",
            "string",
        ),
        (
            {"input": [spawn_call("multi agent", "c", {})]},
            "input.list.0.function_call.namespace",
            "'multi agent'",
        ),
        ({"input": [{"type": "agent_note", "text": "x"}]}, "input.list.0", "agent_message"),
    ],
)
def test_hostile_namespaces_and_agent_messages_are_400s_naming_the_field(
    body: dict[str, Any], loc: str, words: str
) -> None:
    with pytest.raises(ValidationError) as refused:
        ResponsesRequest.model_validate({"input": "hi", **body})
    # (a union's error lists each branch: tool_choice's literal one first)
    locs = [".".join(str(p) for p in error["loc"]) for error in refused.value.errors()]
    assert loc in locs, refused.value
    assert words in str(refused.value)


NAMES = st.text(max_size=70) | st.sampled_from(["ns", "multi_agent_v1", "a__b", "b__c", "x-y"])
FUNCTIONS = st.fixed_dictionaries(
    {"type": st.sampled_from(["function", "custom"]), "name": NAMES},
    optional={"parameters": st.just({"type": "object"}), "description": st.text(max_size=8)},
)
NAMESPACES = st.fixed_dictionaries(
    {"type": st.just("namespace"), "name": NAMES, "tools": st.lists(FUNCTIONS, max_size=3)}
)
CALLS = st.fixed_dictionaries(
    {
        "type": st.just("function_call"),
        "call_id": st.just("c"),
        "name": NAMES,
        "arguments": st.just("{}"),
    },
    optional={"namespace": NAMES | st.none() | st.integers()},
)
PARTS = st.fixed_dictionaries(
    {"type": st.sampled_from(["input_text", "encrypted_content", "output_text", "x"])},
    optional={"text": st.text(max_size=5), "encrypted_content": st.text(max_size=5) | st.none()},
)
AGENT_MESSAGES = st.fixed_dictionaries(
    {"type": st.just("agent_message")},
    optional={
        "content": st.lists(PARTS, max_size=3) | st.text(max_size=4) | st.none(),
        "author": st.text(max_size=5) | st.integers(),
    },
)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    tools=st.lists(NAMESPACES | FUNCTIONS, max_size=4),
    items=st.lists(CALLS | AGENT_MESSAGES, min_size=1, max_size=4),
    choice=st.none() | st.fixed_dictionaries({"type": st.just("function"), "name": NAMES}),
)
def test_any_namespace_or_agent_message_is_translated_or_refused_by_rule(
    tools: list[Any], items: list[Any], choice: Any
) -> None:
    """Never another exception (a 5xx); every offered name is a function's, once."""
    body: dict[str, Any] = {"input": items, "tools": tools}
    if choice is not None:
        body["tool_choice"] = choice
    try:
        request = canonical(body)
    except (ValidationError, InvalidRequest):
        return
    names = [t["function"]["name"] for t in request.tools or ()]
    # A namespace's function, offered flattened, is one name among all offered (a plain tool of
    # that name, or the namespace sent twice, is refused); plain tools may repeat, as in Chat
    # (hypothesis: two plain functions named "__").
    flattened = {
        f"{t['name']}__{f['name']}" for t in tools if t["type"] == "namespace" for f in t["tools"]
    }
    assert all(names.count(name) == 1 for name in flattened)
    for message in request.messages:
        assert isinstance(message.get("content") or "", str)


# -- the namespace restored on the way back -----------------------------------------------------

SPAWN_REPLY = (
    '<tool_call>\n{"name": "multi_agent_v1__spawn_agent", "arguments": {"message": "MARK", '
    '"fork_context": true}}\n</tool_call>\n<tool_call>\n{"name": "exec_command", "arguments": '
    '{"cmd": "ls"}}\n</tool_call>'
)
ASK_V1 = {"input": [DEVELOPER, PROMPT], "tools": [EXEC, V1, WEB_SEARCH]}


async def test_a_call_of_a_namespaces_function_comes_back_with_its_namespace_and_bare_name(
    tiny_model_dir: Path,
) -> None:
    serving, session, publisher = await serving_for(tiny_model_dir, SPAWN_REPLY)
    response = await serving.complete(session, ResponsesRequest(**ASK_V1))
    body = json.loads(response.json_bytes())
    spawn, run = body["output"]
    assert spawn["namespace"] == "multi_agent_v1" and spawn["name"] == "spawn_agent"
    assert json.loads(spawn["arguments"]) == {"message": "MARK", "fork_context": True}
    assert "namespace" not in run and run["name"] == "exec_command"
    parsed = SDKResponse.model_validate(body)
    assert parsed.output[0].namespace == "multi_agent_v1"  # type: ignore[union-attr]
    [event] = publisher.events
    assert event.tool_calls[0]["function"]["name"] == "multi_agent_v1__spawn_agent"
    # Codex sends the items back (verbatim, or re-serialized): the reply the turn recorded.
    for echo in (body["output"], [i.model_dump(exclude_none=True) for i in parsed.output]):
        reply = canonical({**ASK_V1, "input": [DEVELOPER, PROMPT, *echo]}).messages[-1]
        assert message_key(reply) == message_key(event.assistant_message)


async def test_streamed_calls_of_a_namespaces_function_carry_its_namespace_in_every_item(
    tiny_model_dir: Path,
) -> None:
    serving, session, publisher = await serving_for(tiny_model_dir, SPAWN_REPLY)
    stream = await serving.stream(session, ResponsesRequest(**ASK_V1, stream=True))
    events = parse_sse([chunk async for chunk in stream])
    for event in events:
        EVENTS.validate_python(event)
    items = [e for e in events if e["type"].startswith("response.output_item.")]
    assert [(e["type"], e["item"].get("namespace"), e["item"]["name"]) for e in items] == [
        ("response.output_item.added", "multi_agent_v1", "spawn_agent"),
        ("response.output_item.done", "multi_agent_v1", "spawn_agent"),
        ("response.output_item.added", None, "exec_command"),
        ("response.output_item.done", None, "exec_command"),
    ]
    final = events[-1]["response"]
    assert final["output"][0]["namespace"] == "multi_agent_v1"
    assert final["tool_choice"] == "auto" and final["tools"][1]["type"] == "namespace"
    done = [e["item"] for e in items if e["type"] == "response.output_item.done"]
    [event] = publisher.events
    reply = canonical({**ASK_V1, "input": [DEVELOPER, PROMPT, *done]}).messages[-1]
    assert message_key(reply) == message_key(event.assistant_message)


async def test_a_flattened_name_of_a_namespace_not_offered_stays_a_plain_function(
    tiny_model_dir: Path,
) -> None:
    """Only the request's own namespaces are restored (a v1 sub-agent is offered none)."""
    serving, session, _ = await serving_for(tiny_model_dir, SPAWN_REPLY)
    response = await serving.complete(session, ResponsesRequest(input="go", tools=[EXEC]))
    spawn = json.loads(response.json_bytes())["output"][0]
    assert spawn["name"] == "multi_agent_v1__spawn_agent" and "namespace" not in spawn
