"""A Claude Code session with two background sub-agents, request by request as Claude Code
2.1.328 sends it (``../shared/agent-clis/subagents/README.md``, run ``cc_bg``):

* ``main-1``: the main agent's first request (``tests/fixtures/agents/claude_code/request_1.json``:
  its system blocks, its 12 tools, its user message and its environment message). The model
  answers with two ``Agent`` calls in one message: a ``fork`` and a ``general-purpose`` agent.
* Then three requests in flight together, each agent's next one sent when its own previous one
  is answered:

  - ``main-2``: main's next request, the two calls answered at once ("Async agent launched");
  - ``fork-1`` then ``fork-2``: the fork's first request is ``main-1``'s messages, the spawning
    assistant message **rewritten to keep only the fork's own tool_use**, then a user message
    with its placeholder tool_result and its directive (not a prefix-extension of any main
    request), ``cc_is_subagent=true`` in ``system[0]``; its second appends its reply and results;
  - ``fresh-1`` then ``fresh-2``: a new conversation (its own system prompt, 8 tools, the task),
    its second request appending a ``role: system`` message after its first tool results.

* ``main-3``: once all of them are answered, main's final request with both task notifications.

Every request carries ``X-Claude-Code-Session-Id``; a sub-agent's also ``x-claude-code-agent-id``
(``a`` + 16 hex), the main agent's none. The fixed-latency backend gives one answer to every
request, so every agent's every reply is the same two ``Agent`` calls (``SPAWN_TEXT``); each
is answered with a tool_result, as the Messages API requires.

``run_tree(step)`` drives that order: ``step(node)`` is called for every node, concurrently where
Claude Code sends concurrently. ``ClaudeCodeSessions`` runs whole sessions on two paths: through
the gateway (the ``anthropic`` SDK, streamed, each request built from the replies so far by a
``ClaudeCodeTree``), and direct (each request a prompt of as many tokens as the gateway counted
for it, straight to the backend's ``/v1/completions``, as the gateway would send it).
"""

from __future__ import annotations

import asyncio
import copy
import json
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import anthropic
import httpx

from harness.load import complete, completion_body
from harness.surfaces import FIXTURE

JSON = dict[str, Any]

MAIN = ("main-1", "main-2", "main-3")
BACKGROUND = (("main-2",), ("fork-1", "fork-2"), ("fresh-1", "fresh-2"))
NODES = ("main-1", "main-2", "fork-1", "fork-2", "fresh-1", "fresh-2", "main-3")

SPAWNS = (
    {
        "description": "Fork: check the tests",
        "prompt": "MARK_FORK_0: run `echo SUB-FORK` with Bash, then reply done",
        "subagent_type": "fork",
    },
    {
        "description": "Explore the sources",
        "prompt": "MARK_FRESH1_1: run `echo SUB-FRESH1` with Bash, then reply done",
        "subagent_type": "general-purpose",
    },
)
# The model's answer to every request, as the tiny model's template writes two tool calls.
SPAWN_TEXT = "\n".join(
    f'<tool_call>\n{{"name": "Agent", "arguments": {json.dumps(spawn)}}}\n</tool_call>'
    for spawn in SPAWNS
)
# What Claude Code's requests carry beside the session header (its Stainless ones left out: the
# SDK sends its own).
HEADERS = {
    "User-Agent": "claude-cli/2.1.328 (external, sdk-cli)",
    "x-app": "cli",
    "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,"
    "context-management-2025-06-27,advanced-tool-use-2025-11-20,effort-2025-11-24",
}
SUBAGENT_FLAG = " cc_is_subagent=true;"
FRESH_TOOLS = ("Agent", "Bash", "Edit", "Read", "Skill", "ToolSearch", "DeferredToolPlaceholder")
FRESH_TOOLS += ("Write",)
FRESH_PROMPT_CHARS = 3_100  # the general-purpose agent's own prompt, instead of main's 7 kB
# Stand-ins of Claude Code's texts (its own are not committed), of about their length.
FORK_BOILERPLATE = (
    "<fork-boilerplate>\nYou are a fork of the conversation above: you share its history "
    "and its tools. Work only on your directive below, do not spawn further agents unless it "
    "asks you to, keep your tool calls focused, and finish with a short report of what you did "
    "and what you found; the agent that forked you reads only that report.\n"
    "</fork-boilerplate>\n\nYour directive: "
)
AGENT_TYPES = (
    "Available agent types for the Agent tool:\n- general-purpose: research and multi-step "
    "tasks (Tools: *)\n- Explore: fast read-only search of a codebase (Tools: Bash, Read)\n"
    "- Plan: design an implementation plan (Tools: Bash, Read)\n"
)


def agent_id() -> str:
    """A Claude Code agent id: ``a`` + 16 hex."""
    return "a" + secrets.token_hex(8)


async def run_tree(step: Callable[[str], Awaitable[None]]) -> None:
    """``main-1``; then main's next request and each sub-agent's two requests, concurrently
    (each agent's requests in order); then ``main-3``."""

    async def chain(nodes: tuple[str, ...]) -> None:
        for node in nodes:
            await step(node)

    await step("main-1")
    await asyncio.gather(*(chain(nodes) for nodes in BACKGROUND))
    await step("main-3")


def _text(text: str) -> JSON:
    return {"type": "text", "text": text}


def _results(reply: list[JSON], text: Callable[[JSON], str]) -> list[JSON]:
    """A tool_result for every tool_use of ``reply``."""
    return [
        {"type": "tool_result", "tool_use_id": b["id"], "content": text(b)}
        for b in reply
        if b["type"] == "tool_use"
    ]


class ClaudeCodeTree:
    """One session's requests, each built from the replies so far (``answered``)."""

    def __init__(self, model: str) -> None:
        body = json.loads(FIXTURE.read_text())["body"]
        self.session = str(uuid.uuid4())
        self.agents = {"fork": agent_id(), "fresh": agent_id()}
        self.model = model
        self.base = body
        self.sent: dict[str, list[JSON]] = {}  # node -> its messages
        self.replies: dict[str, list[JSON]] = {}  # node -> the reply's content blocks

    # -- what is sent -------------------------------------------------------------------------

    def agent_of(self, node: str) -> str | None:
        """The node's ``x-claude-code-agent-id`` (None: the main agent sends none)."""
        kind = node.split("-")[0]
        return self.agents.get(kind)

    def headers(self, node: str) -> dict[str, str]:
        headers = {"X-Claude-Code-Session-Id": self.session}
        agent = self.agent_of(node)
        if agent is not None:
            headers["x-claude-code-agent-id"] = agent
        return headers

    def request(self, node: str) -> JSON:
        """The Messages request of ``node`` (its body's fields, ``stream`` left to the sender)."""
        body = self.base
        system, tools = copy.deepcopy(body["system"]), body["tools"]
        if not node.startswith("main"):
            system[0]["text"] += SUBAGENT_FLAG
        if node.startswith("fresh"):
            # Its own prompt in system[2] and its own tools: a new conversation.
            system[2]["text"] = system[2]["text"][:FRESH_PROMPT_CHARS]
            tools = [t for t in tools if t["name"] in FRESH_TOOLS]
        messages = self._messages(node)
        self.sent[node] = messages
        return {
            "model": self.model,
            "max_tokens": body["max_tokens"],
            "system": system,
            "tools": tools,
            "messages": messages,
            "metadata": body["metadata"],
            "thinking": body["thinking"],
            "extra": {k: body[k] for k in ("context_management", "output_config")},
        }

    def _messages(self, node: str) -> list[JSON]:
        first = self.base["messages"]
        if node == "main-1":
            return copy.deepcopy(first)
        if node == "main-2":
            return self._continued("main-1", self._launched)
        if node == "fork-1":
            spawn = self.replies["main-1"]
            own = next(b for b in spawn if b.get("input", {}).get("subagent_type") == "fork")
            directive = _text(FORK_BOILERPLATE + own["input"]["prompt"])
            directive["cache_control"] = {"type": "ephemeral"}
            started = [_text("Fork started — that fork is you.")]
            result = {"type": "tool_result", "tool_use_id": own["id"], "content": started}
            return [
                *copy.deepcopy(first),
                {"role": "assistant", "content": [own]},
                {"role": "user", "content": [result, directive]},
            ]
        if node == "fresh-1":
            task = SPAWNS[1]["prompt"]
            environment = copy.deepcopy(first[1])  # its version of main's environment message
            return [{"role": "user", "content": [first[0]["content"][0], _text(task)]}, environment]
        if node in ("fork-2", "fresh-2"):
            previous = node.replace("-2", "-1")
            messages = self._continued(previous, lambda _: "SUB-DONE\n")
            if node == "fresh-2":  # appended once, after its first tool results
                messages.append({"role": "system", "content": [_text(AGENT_TYPES)]})
            return messages
        if node == "main-3":
            messages = self._continued("main-2", self._launched)
            messages[-1]["content"] += [self._notification(k) for k in ("fork", "fresh")]
            return messages
        raise ValueError(f"no node {node!r} in a Claude Code session (one of {NODES})")

    def _continued(self, previous: str, output: Callable[[JSON], str]) -> list[JSON]:
        """``previous``'s messages, its reply, and a user message answering its tool calls."""
        reply = self.replies[previous]
        return [
            *copy.deepcopy(self.sent[previous]),
            {"role": "assistant", "content": copy.deepcopy(reply)},
            {"role": "user", "content": _results(reply, output)},
        ]

    def _launched(self, use: JSON) -> str:
        kind = "fork" if use["input"].get("subagent_type") == "fork" else "fresh"
        return (
            "Async agent launched successfully.\n"
            f"agentId: {self.agents[kind]} (internal ID - do not mention to user.)\n"
            "The agent is working in the background. You will be notified automatically when "
            "it completes."
        )

    def _notification(self, kind: str) -> JSON:
        use = next(
            b
            for b in self.replies["main-1"]
            if (b["input"].get("subagent_type") == "fork") == (kind == "fork")
        )
        return _text(
            f"<task-notification>\n<task-id>{self.agents[kind]}</task-id>\n"
            f"<tool-use-id>{use['id']}</tool-use-id>\n<status>completed</status>\n"
            f'<summary>Agent "{use["input"]["description"]}" completed</summary>\n'
            f"<result>SUB-{kind.upper()} done.</result>\n</task-notification>"
        )

    def answered(self, node: str, content: list[JSON]) -> None:
        """The reply's content blocks, as the client echoes them; two Agent calls expected."""
        uses = [b for b in content if b["type"] == "tool_use"]
        kinds = sorted(str(b["input"].get("subagent_type")) for b in uses)
        if kinds != ["fork", "general-purpose"]:
            raise RuntimeError(f"{node}: expected the two Agent calls, got {content}")
        self.replies[node] = content


class ClaudeCodeSessions:
    """Claude Code sessions through the gateway (``anthropic`` SDK) or, as prompts of the same
    lengths, straight to the backend (``through_gateway`` first: it counts them)."""

    def __init__(self, url: str, backend_url: str, model: str, completion: list[int]) -> None:
        self.model, self.completion = model, completion
        self.backend_url = f"{backend_url}/v1/completions"
        self.client = anthropic.AsyncAnthropic(
            base_url=url, api_key="dummy", max_retries=0, timeout=600.0, default_headers=HEADERS
        )
        self.http = httpx.AsyncClient(timeout=600.0)
        self.tokens: dict[str, int] = {}  # node -> prompt tokens, as the gateway counted them
        self.bodies: dict[str, bytes] = {}
        self.last: tuple[ClaudeCodeTree, dict[str, str]] | None = None  # its answers' ids

    async def close(self) -> None:
        await self.client.close()
        await self.http.aclose()

    async def through_gateway(self) -> list[tuple[float, float]]:
        """One session through the gateway; each request's (start, end)."""
        tree = ClaudeCodeTree(self.model)
        spans: list[tuple[float, float]] = []
        ids: dict[str, str] = {}

        async def step(node: str) -> None:
            request = tree.request(node)
            extra = request.pop("extra")
            t0 = time.perf_counter()
            async with self.client.messages.stream(
                **request,
                extra_body=extra,
                extra_headers=tree.headers(node),
                extra_query={"beta": "true"},
            ) as stream:
                message = await stream.get_final_message()
            spans.append((t0, time.perf_counter()))
            tree.answered(node, [b.model_dump(exclude_none=True) for b in message.content])
            self.tokens[node] = message.usage.input_tokens
            ids[node] = message.id

        await run_tree(step)
        self.last = (tree, ids)
        return spans

    async def direct(self) -> list[tuple[float, float]]:
        """The same session's requests straight to the backend; each one's (start, end)."""
        spans: list[tuple[float, float]] = []

        async def step(node: str) -> None:
            if node not in self.bodies:
                ids = [32 + i % 200 for i in range(self.tokens[node])]  # ~ the real ids' JSON
                self.bodies[node] = completion_body(
                    self.model, ids, len(self.completion), (self.completion[-1],)
                )
            t0 = time.perf_counter()
            tokens = await complete(self.http, self.backend_url, self.bodies[node])
            spans.append((t0, time.perf_counter()))
            if tokens != self.completion:
                raise RuntimeError(f"direct {node}: got {tokens}, expected {self.completion}")

        await run_tree(step)
        return spans
