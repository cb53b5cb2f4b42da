"""Claude-Code-shaped agent sessions on each API surface: the canonical session (from Claude
Code's first captured request), and per API (Chat Completions, Anthropic Messages, OpenAI
Responses) the request body, the reply read back from JSON or SSE events and checked to be the
Bash tool call, and the history items a turn appends."""

from __future__ import annotations

import abc
import json
from dataclasses import dataclass
from typing import Any

from harness.processes import REPO

JSON = dict[str, Any]

FIXTURE = REPO / "tests" / "fixtures" / "agents" / "claude_code" / "request_1.json"
SYSTEM_CHARS = 17_000  # Claude Code's system text: its system blocks + its environment message
MAX_TOKENS = 64_000  # what Claude Code asks for; the gateway lowers it to the context's room
CALL_NAME, CALL_ARGUMENTS = "Bash", {"command": "ls"}
# Every reply is this tool call, so every next request carries a tool result.
REPLY_TEXT = (
    f'<tool_call>\n{{"name": "{CALL_NAME}", "arguments": {json.dumps(CALL_ARGUMENTS)}}}\n'
    "</tool_call>"
)


def tool_output(turn: int) -> str:
    """What ``ls`` printed (~300 characters), a little different each turn."""
    names = [f"module_{turn:02d}_{i}.py" for i in range(17)]
    return f"total {4 * len(names)}\n" + "\n".join(["README.md", "pyproject.toml", *names]) + "\n"


# -- the session --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClaudeCodeShape:
    """What every API sends, from Claude Code's first captured request."""

    system: tuple[str, ...]  # text blocks, SYSTEM_CHARS together
    tools: tuple[JSON, ...]  # {name, description, input_schema}
    user: tuple[str, ...]  # the first user message's text blocks


def claude_code_shape() -> ClaudeCodeShape:
    """Its ``system`` blocks and its environment message (``role: system`` inside
    ``messages``) as one system text, padded to SYSTEM_CHARS with its own text; its 12 tools
    (~32 KB) and the same again as ``mcp__mirror__<name>`` (~64 KB); its first user message."""
    body = json.loads(FIXTURE.read_text())["body"]
    blocks = [b["text"] for b in body["system"]]
    user, environment = body["messages"][0], body["messages"][1]
    assert environment["role"] == "system", "request_1.json: messages[1] is the environment"
    blocks += [b["text"] for b in environment["content"]]
    missing = SYSTEM_CHARS - sum(len(b) for b in blocks)
    longest = max(blocks, key=len)
    if missing > 0:
        blocks.append((longest * (missing // len(longest) + 1))[:missing])
    else:
        blocks[-1] = blocks[-1][: len(blocks[-1]) + missing]
    tools = [
        {"name": t["name"], "description": t["description"], "input_schema": t["input_schema"]}
        for t in body["tools"]
    ]
    tools += [{**t, "name": f"mcp__mirror__{t['name']}"} for t in tools]
    return ClaudeCodeShape(
        system=tuple(blocks),
        tools=tuple(tools),
        user=tuple(b["text"] for b in user["content"]),
    )


def dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def body_head(fields: JSON, history: str) -> bytes:
    """A request body up to its history list (``{...,"<history>":``), which follows."""
    return dumps({**fields, history: []})[: -len(b"[]}")]


def function(tool: JSON) -> JSON:
    """A Messages tool as the OpenAI APIs' function definition."""
    return {
        "name": tool["name"],
        "description": tool["description"],
        "parameters": tool["input_schema"],
    }


@dataclass
class Reply:
    """An answer: what the client sends back of it, and the tool call's id."""

    echo: list[JSON]
    call_id: str


class Surface(abc.ABC):
    """One API: the body of a request, the reply read back (from JSON or SSE events) and
    checked to be the tool call, and the history items a turn appends."""

    name: str
    path: str

    def __init__(self, shape: ClaudeCodeShape, model: str) -> None:
        self.shape = shape
        self.model = model

    @abc.abstractmethod
    def head(self, stream: bool) -> bytes:
        """The body up to the history list (``...,"messages":``); the history follows."""

    @abc.abstractmethod
    def opening(self) -> list[JSON]:
        """The history's first items (before any reply)."""

    @abc.abstractmethod
    def reply(self, answer: JSON) -> Reply:
        """The non-streamed answer's tool call (or an error)."""

    @abc.abstractmethod
    def streamed_reply(self, events: list[tuple[str | None, JSON]]) -> Reply:
        """The same from the SSE events (``event:`` name or None, ``data:`` object)."""

    @abc.abstractmethod
    def tool_result(self, call_id: str, output: str) -> list[JSON]:
        """The history items carrying the tool's output."""

    def fail(self, what: str, answer: object) -> RuntimeError:
        return RuntimeError(f"{self.name}: {what}: {json.dumps(answer)[:600]}")

    def checked_call(self, name: object, arguments: object, answer: object) -> None:
        if isinstance(arguments, str):
            arguments = json.loads(arguments)
        if name != CALL_NAME or arguments != CALL_ARGUMENTS:
            raise self.fail(f"expected the tool call {CALL_NAME}({CALL_ARGUMENTS})", answer)


class ChatSurface(Surface):
    """System and user messages as text parts, function tools, ``max_tokens``."""

    name, path = "chat", "/v1/chat/completions"

    def head(self, stream: bool) -> bytes:
        tools = [{"type": "function", "function": function(t)} for t in self.shape.tools]
        fields = {"model": self.model, "max_tokens": MAX_TOKENS, "stream": stream, "tools": tools}
        return body_head(fields, "messages")

    def opening(self) -> list[JSON]:
        return [
            {"role": "system", "content": [{"type": "text", "text": t} for t in self.shape.system]},
            {"role": "user", "content": [{"type": "text", "text": t} for t in self.shape.user]},
        ]

    def reply(self, answer: JSON) -> Reply:
        choice = answer["choices"][0]
        message = choice["message"]
        calls = message.get("tool_calls") or []
        if choice["finish_reason"] != "tool_calls" or len(calls) != 1:
            raise self.fail("expected one tool call", answer)
        self.checked_call(calls[0]["function"]["name"], calls[0]["function"]["arguments"], answer)
        echo = {"role": "assistant", "content": message.get("content"), "tool_calls": calls}
        return Reply([echo], calls[0]["id"])

    def streamed_reply(self, events: list[tuple[str | None, JSON]]) -> Reply:
        content, finish, calls = "", None, {}
        for _, chunk in events:
            for choice in chunk["choices"]:
                delta = choice["delta"]
                content += delta.get("content") or ""
                for part in delta.get("tool_calls") or ():
                    call = calls.setdefault(
                        part["index"],
                        {"id": "", "type": "function", "function": {"name": "", "arguments": ""}},
                    )
                    call["id"] += part.get("id") or ""
                    function = part.get("function") or {}
                    call["function"]["name"] += function.get("name") or ""
                    call["function"]["arguments"] += function.get("arguments") or ""
                finish = choice.get("finish_reason") or finish
        message = {"content": content or None, "tool_calls": [calls[i] for i in sorted(calls)]}
        return self.reply({"choices": [{"message": message, "finish_reason": finish}]})

    def tool_result(self, call_id: str, output: str) -> list[JSON]:
        return [{"role": "tool", "tool_call_id": call_id, "content": output}]


class MessagesSurface(Surface):
    """``system`` as text blocks, tools ``{name, description, input_schema}``, ``max_tokens``,
    the reply echoed as its content blocks, tool results as ``tool_result`` blocks."""

    name, path = "messages", "/v1/messages"

    def head(self, stream: bool) -> bytes:
        system = [{"type": "text", "text": t} for t in self.shape.system]
        fields = {"model": self.model, "max_tokens": MAX_TOKENS, "stream": stream}
        return body_head({**fields, "system": system, "tools": self.shape.tools}, "messages")

    def opening(self) -> list[JSON]:
        return [{"role": "user", "content": [{"type": "text", "text": t} for t in self.shape.user]}]

    def reply(self, answer: JSON) -> Reply:
        uses = [b for b in answer["content"] if b["type"] == "tool_use"]
        if answer["stop_reason"] != "tool_use" or len(uses) != 1:
            raise self.fail("expected one tool_use block", answer)
        self.checked_call(uses[0]["name"], uses[0]["input"], answer)
        return Reply([{"role": "assistant", "content": answer["content"]}], uses[0]["id"])

    def streamed_reply(self, events: list[tuple[str | None, JSON]]) -> Reply:
        """The message as the ``anthropic`` SDK accumulates it from the events."""
        blocks: list[JSON] = []
        partial: dict[int, str] = {}
        stop = None
        for name, data in events:
            if name == "content_block_start":
                blocks.append(dict(data["content_block"]))
            elif name == "content_block_delta":
                delta, index = data["delta"], data["index"]
                if delta["type"] == "text_delta":
                    blocks[index]["text"] += delta["text"]
                elif delta["type"] == "input_json_delta":
                    partial[index] = partial.get(index, "") + delta["partial_json"]
            elif name == "message_delta":
                stop = data["delta"].get("stop_reason")
            elif name == "error":
                raise self.fail("error event", data)
        for index, text in partial.items():
            blocks[index]["input"] = json.loads(text) if text else {}
        return self.reply({"content": blocks, "stop_reason": stop})

    def tool_result(self, call_id: str, output: str) -> list[JSON]:
        block = {"type": "tool_result", "tool_use_id": call_id, "content": output}
        return [{"role": "user", "content": [block]}]


class ResponsesSurface(Surface):
    """``input`` items (a system message first), flat function tools, ``max_output_tokens``,
    the output items echoed, tool results as ``function_call_output`` items."""

    name, path = "responses", "/v1/responses"

    def head(self, stream: bool) -> bytes:
        tools = [{"type": "function", **function(t)} for t in self.shape.tools]
        fields = {"model": self.model, "max_output_tokens": MAX_TOKENS, "stream": stream}
        return body_head({**fields, "tools": tools}, "input")

    def opening(self) -> list[JSON]:
        def message(role: str, texts: tuple[str, ...]) -> JSON:
            parts = [{"type": "input_text", "text": t} for t in texts]
            return {"type": "message", "role": role, "content": parts}

        return [message("system", self.shape.system), message("user", self.shape.user)]

    def reply(self, answer: JSON) -> Reply:
        calls = [item for item in answer["output"] if item["type"] == "function_call"]
        if answer.get("status") != "completed" or len(calls) != 1:
            raise self.fail("expected one function_call item", answer)
        self.checked_call(calls[0]["name"], calls[0]["arguments"], answer)
        return Reply(list(answer["output"]), calls[0]["call_id"])

    def streamed_reply(self, events: list[tuple[str | None, JSON]]) -> Reply:
        for name, data in events:
            if name == "response.completed":
                return self.reply(data["response"])
        raise self.fail("no response.completed event", [name for name, _ in events])

    def tool_result(self, call_id: str, output: str) -> list[JSON]:
        return [{"type": "function_call_output", "call_id": call_id, "output": output}]


SURFACES: dict[str, type[Surface]] = {
    "chat": ChatSurface,
    "messages": MessagesSurface,
    "responses": ResponsesSurface,
}
