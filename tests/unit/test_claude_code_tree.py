"""The benchmarks' Claude Code session with two background sub-agents
(``benchmarks/harness/claude_code_tree.py``) is the captured ``cc_bg`` shape
(``../shared/agent-clis/subagents/README.md``): the fork's first request is main's spawning
request with the spawning message rewritten to its own tool_use (no prefix of main's next
request), the fresh agent's a new conversation, the ids in Claude Code's headers, and main's
next request in flight with both sub-agents' requests."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from harness.claude_code_tree import NODES, SPAWNS, ClaudeCodeTree, run_tree

JSON = dict[str, Any]


def spawn_reply(tag: str) -> list[JSON]:
    return [
        {"type": "tool_use", "id": f"toolu_{tag}_{i}", "name": "Agent", "input": dict(spawn)}
        for i, spawn in enumerate(SPAWNS)
    ]


@pytest.fixture
def tree() -> ClaudeCodeTree:
    """Every request built, each answered with the two Agent calls, in run_tree's order."""
    built = ClaudeCodeTree("tiny")
    for node in NODES:
        built.request(node)
        built.answered(node, spawn_reply(node))
    return built


def test_the_fork_starts_from_the_spawning_request_with_only_its_own_tool_use(
    tree: ClaudeCodeTree,
) -> None:
    main1, main2, fork1 = tree.sent["main-1"], tree.sent["main-2"], tree.sent["fork-1"]
    assert fork1[: len(main1)] == main1 and len(fork1) == len(main1) + 2
    spawning = fork1[len(main1)]
    assert spawning["role"] == "assistant"
    assert [b["input"]["subagent_type"] for b in spawning["content"]] == ["fork"]
    # Main's next request carries both calls: the fork is no prefix-extension of it.
    assert main2[len(main1)]["content"] == tree.replies["main-1"] != spawning["content"]
    result, directive = fork1[-1]["content"]
    assert result["type"] == "tool_result" and result["tool_use_id"] == spawning["content"][0]["id"]
    assert directive["text"].endswith(SPAWNS[0]["prompt"])
    assert "cc_is_subagent=true" in tree.request("fork-1")["system"][0]["text"]


def test_the_fresh_agent_is_a_new_conversation_and_each_agent_appends(
    tree: ClaudeCodeTree,
) -> None:
    fresh1, main1 = tree.sent["fresh-1"], tree.sent["main-1"]
    assert fresh1[0]["content"][1]["text"] == SPAWNS[1]["prompt"]
    assert fresh1[0] != main1[0]
    fresh_tools = [t["name"] for t in tree.request("fresh-1")["tools"]]
    assert len(fresh_tools) == 8 and "Agent" in fresh_tools
    for later, earlier in (("main-2", "main-1"), ("fork-2", "fork-1"), ("fresh-2", "fresh-1")):
        assert tree.sent[later][: len(tree.sent[earlier])] == tree.sent[earlier]
    assert tree.sent["fresh-2"][-1]["role"] == "system"  # appended after its first results
    main3 = tree.sent["main-3"]
    assert main3[: len(tree.sent["main-2"])] == tree.sent["main-2"]
    notified = " ".join(b.get("text", "") for b in main3[-1]["content"])
    assert all(f"<task-id>{agent}</task-id>" in notified for agent in tree.agents.values())


def test_headers_name_the_session_and_only_the_sub_agents(tree: ClaudeCodeTree) -> None:
    for node in NODES:
        headers = tree.headers(node)
        assert headers["X-Claude-Code-Session-Id"] == tree.session
        agent = headers.get("x-claude-code-agent-id")
        if node.startswith("main"):
            assert agent is None
        else:
            assert agent == tree.agents[node.split("-")[0]]
            assert agent.startswith("a") and len(agent) == 17


async def test_main_and_both_sub_agents_are_in_flight_together() -> None:
    open_now: set[str] = set()
    together: list[set[str]] = []
    order: list[str] = []

    async def step(node: str) -> None:
        open_now.add(node)
        together.append(set(open_now))
        await asyncio.sleep(0)  # the others start before this one ends
        open_now.discard(node)
        order.append(node)

    await run_tree(step)
    assert {"main-2", "fork-1", "fresh-1"} in together
    assert order[0] == "main-1" and order[-1] == "main-3"
    assert order.index("fork-1") < order.index("fork-2")
    assert order.index("fresh-1") < order.index("fresh-2")
    assert sorted(order) == sorted(NODES)
