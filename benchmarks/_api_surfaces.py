"""``gateway_overhead.py --api-surfaces``: the gateway's CPU per request on each API surface.

Issue 17: the same Claude-Code-shaped session sent as Chat Completions, as Anthropic Messages
and as OpenAI Responses; the gateway's CPU per request on each, set beside Chat Completions'
(target: within 1.2x). What is sent, measured and checked is described in the docstring of
``gateway_overhead.py`` ("Per-API CPU: --api-surfaces"); the processes (backend, gateway,
nats-server), the CPU meter, the profiler and the closing JSON line are that script's.
"""

from __future__ import annotations

import abc
import argparse
import asyncio
import contextlib
import gc
import json
import os
import signal
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gateway_overhead as overhead
import httpx
from _common import banner, finish, say

from eventlog import NatsServer, connect, free_port, read_session

JSON = dict[str, Any]

APIS = ("chat", "messages", "responses")
RECORDED_API = {"chat": "chat.completions", "messages": "messages", "responses": "responses"}
FIXTURE = overhead.REPO / "tests" / "fixtures" / "agents" / "claude_code" / "request_1.json"
TURNS = 20  # requests per session
SYSTEM_CHARS = 17_000  # Claude Code's system text: its system blocks + its environment message
MAX_TOKENS = 64_000  # what Claude Code asks for; the gateway lowers it to the context's room
MAX_CONTEXT = 262_144  # byte-level tokenizer: a 20-turn session is ~90k tokens
CALL_NAME, CALL_ARGUMENTS = "Bash", {"command": "ls"}
# Every reply is this tool call, so every next request carries a tool result.
REPLY_TEXT = (
    f'<tool_call>\n{{"name": "{CALL_NAME}", "arguments": {json.dumps(CALL_ARGUMENTS)}}}\n'
    "</tool_call>"
)
TARGET_RATIO = 1.2
WARMUP_TURNS = 3


def tool_output(turn: int) -> str:
    """What ``ls`` printed (~300 characters), a little different each turn."""
    names = [f"module_{turn:02d}_{i}.py" for i in range(17)]
    return f"total {4 * len(names)}\n" + "\n".join(["README.md", "pyproject.toml", *names]) + "\n"


@dataclass(frozen=True)
class SurfacePlan:
    """Per round, each variant (concurrency, streamed) runs a phase per API."""

    rounds: int  # even: the API order is reversed in every other round
    sessions_per_worker: int  # each of c workers runs this many whole sessions per phase
    variants: tuple[tuple[int, bool], ...]


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


# -- load -----------------------------------------------------------------------------------


@dataclass
class SentSessions:
    """Requests answered per session id, and the API that carried them (checked against
    EVENTS at the end)."""

    requests: dict[str, int] = field(default_factory=dict)
    api: dict[str, str] = field(default_factory=dict)


class SessionLoad:
    """Whole sessions of one API: TURNS requests, each with the history so far (kept encoded,
    one item at a time, so the load generator does not re-encode 90 KB per request)."""

    def __init__(self, surface: Surface, url: str, sent: SentSessions) -> None:
        self.surface = surface
        self.url = url + surface.path
        self.sent = sent
        self.heads = {stream: surface.head(stream) for stream in (False, True)}
        self.opening = [dumps(item) for item in surface.opening()]

    async def session(
        self,
        client: httpx.AsyncClient,
        sid: str,
        stream: bool,
        samples: list[float],
        turns: int = TURNS,
    ) -> None:
        history = list(self.opening)
        self.sent.api[sid] = self.surface.name
        self.sent.requests[sid] = 0
        headers = {"X-Session-Id": sid, "content-type": "application/json"}
        for turn in range(turns):
            body = self.heads[stream] + b"[" + b",".join(history) + b"]}"
            t0 = time.perf_counter()
            try:
                if stream:
                    reply = await self._streamed(client, body, headers)
                else:
                    response = await client.post(self.url, content=body, headers=headers)
                    if response.status_code != 200:
                        raise RuntimeError(f"HTTP {response.status_code}: {response.text[:600]}")
                    reply = self.surface.reply(response.json())
            except (RuntimeError, KeyError, TypeError, ValueError, httpx.HTTPError) as exc:
                raise RuntimeError(
                    f"{self.surface.name} (stream={stream}) session {sid} turn {turn}: {exc!r}"
                ) from exc
            samples.append(time.perf_counter() - t0)
            self.sent.requests[sid] += 1
            history += [dumps(item) for item in reply.echo]
            result = self.surface.tool_result(reply.call_id, tool_output(turn))
            history += [dumps(item) for item in result]

    async def _streamed(
        self, client: httpx.AsyncClient, body: bytes, headers: dict[str, str]
    ) -> Reply:
        events: list[tuple[str | None, JSON]] = []
        name: str | None = None
        async with client.stream("POST", self.url, content=body, headers=headers) as response:
            if response.status_code != 200:
                detail = (await response.aread())[:600]
                raise RuntimeError(f"HTTP {response.status_code}: {detail!r}")
            async for line in response.aiter_lines():
                if line.startswith("event:"):
                    name = line[6:].strip()
                elif line.startswith("data:"):
                    payload = line[5:].strip()
                    if payload != "[DONE]":
                        events.append((name, json.loads(payload)))
                    name = None
        return self.surface.streamed_reply(events)


@dataclass
class SurfacePhase:
    api: str
    concurrency: int
    streamed: bool
    round: int
    latencies_s: list[float]
    requests: int
    sessions: int
    wall_s: float
    cpu_s: dict[str, float]

    def cpu_ms_per_request(self, key: str = "gateway") -> float:
        return 1000 * self.cpu_s[key] / self.requests


async def run_sessions(
    load: SessionLoad,
    clients: list[httpx.AsyncClient],
    per: int,
    c: int,
    stream: bool,
    sessions_per_worker: int,
    tag: str,
    procs: overhead.Procs,
    on_edge: Callable[[], None] | None,
) -> tuple[list[float], int, float, dict[str, float]]:
    """``c`` closed-loop workers, each running ``sessions_per_worker`` whole sessions: every
    API gets the same mix of turns (early turns are cheaper: less history to read)."""
    samples: list[float] = []

    async def worker(wid: int) -> None:
        for n in range(sessions_per_worker):
            sid = f"{load.surface.name}-{tag}-w{wid}-s{n}"
            await load.session(clients[wid // per], sid, stream, samples)

    if on_edge is not None:
        on_edge()
    cpu0, t0 = procs.cpu(), time.perf_counter()
    tasks = [asyncio.create_task(worker(w)) for w in range(c)]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        raise
    wall, cpu1 = time.perf_counter() - t0, procs.cpu()
    if on_edge is not None:
        on_edge()
    return samples, c * sessions_per_worker, wall, {k: cpu1[k] - cpu0[k] for k in cpu0}


# -- checks against EVENTS ------------------------------------------------------------------


def canonical_keys(messages: list[JSON]) -> list[tuple[object, ...]]:
    """``message_key`` of each message, tool-call ids left out (each API makes its own)."""
    from gateway.core.conversation import message_key

    return [(*message_key({**m, "tool_call_id": None})[:3], m.get("name")) for m in messages]


async def check_sessions(js: Any, sent: SentSessions) -> dict[str, Any]:
    """Per session: one SessionOpened, then TurnCompleted 0..n-1 with n = requests answered,
    each recorded as its API's, each with a tool call, each extending the previous turn's
    tokens and messages whole (no fork). Per API, the conversations of a whole session (the
    first measured) are the same canonical messages, tools and prompt token counts as Chat's."""
    from schemas.events import SessionOpened, TurnCompleted

    sessions: dict[str, JSON] = {}
    for sid, n in sent.requests.items():
        events = await read_session(js, overhead.RUN, sid, stream=overhead.STREAM)
        opened = [e for e in events if isinstance(e, SessionOpened)]
        turns = sorted((e for e in events if isinstance(e, TurnCompleted)), key=lambda e: e.turn)
        where = f"session {sid} ({sent.api[sid]}, {n} requests answered)"
        if len(opened) != 1 or [t.turn for t in turns] != list(range(n)):
            raise RuntimeError(
                f"{where}: EVENTS has {len(opened)} SessionOpened and turns "
                f"{[t.turn for t in turns]}"
            )
        messages: list[JSON] = []
        prompt_lengths = []
        for k, turn in enumerate(turns):
            if turn.request.get("api") != RECORDED_API[sent.api[sid]] or not turn.tool_calls:
                raise RuntimeError(
                    f"{where}: turn {k} recorded as {turn.request.get('api')!r} "
                    f"with tool calls {turn.tool_calls}"
                )
            if k:
                previous = turns[k - 1]
                context = previous.prefix_len + len(previous.prompt_ids)
                context += len(previous.completion_ids)
                if (turn.prefix_len, turn.message_prefix_len) != (context, len(messages) + 1):
                    raise RuntimeError(
                        f"{where}: turn {k} forked: prefix_len {turn.prefix_len} of {context} "
                        f"tokens, message_prefix_len {turn.message_prefix_len} of "
                        f"{len(messages) + 1} messages"
                    )
                messages = [*messages, previous.assistant_message]
            messages = messages[: turn.message_prefix_len] + list(turn.new_messages)
            prompt_lengths.append(turn.prefix_len + len(turn.prompt_ids))
        sessions[sid] = {
            "api": sent.api[sid],
            "messages": canonical_keys(messages),
            "tools": turns[0].tools if turns else None,
            "prompt_tokens": prompt_lengths,
        }
    same = compare_canonical(sessions)
    checked = {"sessions": len(sessions), "turns": sum(sent.requests.values())}
    say(
        f"\nchecked: {checked['turns']:,} TurnCompleted in {checked['sessions']} sessions, "
        "every one its API's, a tool call, extending the previous turn (no fork)"
    )
    return {**checked, "same_canonical_conversation": same}


def compare_canonical(sessions: dict[str, JSON]) -> dict[str, bool]:
    """Whole sessions of each API against Chat's: messages, tools, prompt tokens per turn."""
    whole = {}
    for s in sessions.values():
        if len(s["prompt_tokens"]) == TURNS:
            whole.setdefault(s["api"], s)
    out = {}
    reference = whole.get("chat")
    for api, s in whole.items():
        if reference is None or api == "chat":
            continue
        diffs = [
            what for what in ("messages", "tools", "prompt_tokens") if s[what] != reference[what]
        ]
        out[api] = not diffs
        if diffs:
            say(f"WARNING: {api}'s canonical conversation differs from chat's in {diffs}")
            for what in diffs:
                mine, theirs = s[what], reference[what]
                if isinstance(mine, list) and isinstance(theirs, list):
                    at = next(
                        (i for i, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b),
                        min(len(mine), len(theirs)),
                    )
                    a = mine[at] if at < len(mine) else None
                    b = theirs[at] if at < len(theirs) else None
                    say(f"  {what}[{at}]: {str(a)[:300]}\n  chat: {str(b)[:300]}")
    if out:
        say(
            "checked: whole sessions of "
            + ", ".join(f"{api} ({'same' if ok else 'NOT the same'})" for api, ok in out.items())
            + " against chat: canonical messages, tools, prompt tokens per turn"
        )
    return out


# -- the run --------------------------------------------------------------------------------


def reply_ids(model_dir: Path) -> list[int]:
    """The tool call's tokens and the end of turn, as the tiny model's tokenizer makes them."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [*tokenizer.encode(REPLY_TEXT, add_special_tokens=False), int(tokenizer.eos_token_id)]


@dataclass
class BenchStack:
    """The processes a gateway benchmark runs against, up and healthy."""

    model_dir: Path
    gateway_url: str
    procs: overhead.Procs
    js: Any  # a JetStream context on the stack's nats-server


@contextlib.asynccontextmanager
async def fixed_latency_stack(
    args: argparse.Namespace,
    tmp: Path,
    max_context: int,
    name: str,
    *,
    model_dir: Path | None = None,
    completion: list[int] | None = None,
    source_tree: Path | None = None,
) -> AsyncIterator[BenchStack]:
    """nats-server, the fixed-latency backend (its reply: ``completion``, by default the Bash
    tool call) and a gateway serving ``model_dir`` (default: the tiny model), all with
    ``max_context``; the logs' tails are printed when the body fails. ``source_tree``: the
    checkout whose code the gateway runs (``_gateway_launcher.py --source-tree``)."""
    from gateway.model import ensure_tiny_model

    t0 = time.perf_counter()
    model_dir = model_dir or ensure_tiny_model(Path(args.model_cache))
    completion = completion or reply_ids(model_dir)
    conv = overhead.Conversation([], [], (completion[-1],), completion, len(completion))
    say(f"tiny model ready in {time.perf_counter() - t0:.1f} s; reply: {len(completion)} tokens")
    log_dir = tmp / "logs"
    log_dir.mkdir()
    nats = NatsServer(tmp / "nats").start()
    backend_port, gateway_port = free_port(), free_port()
    backend_url = f"http://127.0.0.1:{backend_port}"
    gateway_url = f"http://127.0.0.1:{gateway_port}"
    backend_cmd = overhead.backend_command(args, backend_port, conv, model_dir.name)
    backend = overhead.spawn(
        [*backend_cmd, "--max-model-len", str(max_context)], log_dir / "backend.log", os.environ
    )
    gateway_cmd = overhead.gateway_command(
        args,
        model_dir,
        nats.url,
        backend_url,
        gateway_port,
        tmp / "data",
        tmp / "gc.json",
        source_tree,
    )
    gateway_cmd[gateway_cmd.index("--max-context") + 1] = str(max_context)
    gateway: Any = None
    nc = None
    try:
        await overhead.wait_http(f"{backend_url}/health", backend, "fixed-latency backend", 30)
        gateway = overhead.spawn(gateway_cmd, log_dir / "gateway.log", overhead.gateway_env(args))
        procs = overhead.Procs(backend, gateway, nats)
        await overhead.wait_http(f"{gateway_url}/health", gateway, "gateway", 120)
        say(
            f"backend (pid {backend.pid}), gateway (pid {gateway.pid}), nats-server "
            f"(pid {nats.pid}) up in {time.perf_counter() - t0:.1f} s"
        )
        nc = await connect(nats.url, name=name)
        yield BenchStack(model_dir, gateway_url, procs, nc.jetstream())
    except BaseException:
        for log_file in sorted(log_dir.iterdir()):
            say(f"--- {log_file.name} (tail) ---\n{log_file.read_text(errors='replace')[-4000:]}")
        raise
    finally:
        if nc is not None:
            await nc.close()
        if gateway is not None:
            overhead.stop_process(gateway, signal.SIGINT, 60 if args.profile_gateway else 20)
        overhead.stop_process(backend, signal.SIGTERM)
        nats.stop()


async def bench(args: argparse.Namespace, plan: SurfacePlan, apis: list[str], tmp: Path) -> JSON:
    shape = claude_code_shape()
    say(
        f"system {sum(map(len, shape.system)):,} chars in {len(shape.system)} blocks, "
        f"{len(shape.tools)} tools ({len(dumps(list(shape.tools))):,} bytes of JSON)"
    )
    async with fixed_latency_stack(args, tmp, MAX_CONTEXT, "gateway-bench-apis") as stack:
        per = args.workers_per_client
        c_max = max(c for c, _ in plan.variants)
        limits = httpx.Limits(max_connections=per + 2, max_keepalive_connections=per + 2)
        sent = SentSessions()
        loads = {
            api: SessionLoad(SURFACES[api](shape, stack.model_dir.name), stack.gateway_url, sent)
            for api in apis
        }
        async with contextlib.AsyncExitStack() as clients_stack:
            clients = [
                await clients_stack.enter_async_context(
                    httpx.AsyncClient(limits=limits, timeout=120.0)
                )
                for _ in range(-(-c_max // per))
            ]
            # Warm-up, unmeasured: the first WARMUP_TURNS turns of a session per API, streamed
            # and not (lazy imports, first tokenizations, connections).
            t1 = time.perf_counter()
            for api in apis:
                for stream in (False, True):
                    sid = f"{api}-warm-{'s' if stream else 'n'}"
                    await loads[api].session(clients[0], sid, stream, [], WARMUP_TURNS)
            say(
                f"warm-up: {WARMUP_TURNS} turns per API, streamed and not, in "
                f"{time.perf_counter() - t1:.1f} s"
            )
            gc.collect()
            gc.freeze()
            phases = await run_rounds(args, plan, apis, loads, clients, stack.procs, stack.js)
        checks = await check_sessions(stack.js, sent)
    return {"phases": phases, "checks": checks}


async def run_rounds(
    args: argparse.Namespace,
    plan: SurfacePlan,
    apis: list[str],
    loads: dict[str, SessionLoad],
    clients: list[httpx.AsyncClient],
    procs: overhead.Procs,
    js: Any,
) -> list[SurfacePhase]:
    say(
        f"\n{plan.rounds} rounds; per round and variant, a phase per API (order reversed every "
        f"other round): each of c workers runs {plan.sessions_per_worker} whole session(s) of "
        f"{TURNS} turns"
    )
    phases: list[SurfacePhase] = []
    for rnd in range(plan.rounds):
        order = apis if rnd % 2 == 0 else apis[::-1]
        for c, stream in plan.variants:
            line = []
            for api in order:
                tag = f"c{c}{'s' if stream else 'n'}r{rnd}"
                before = await overhead.stream_messages(js)
                # Profiled: every phase of the odd rounds; the even rounds give unprofiled CPU.
                profiled = args.profile_gateway and rnd % 2 == 1
                edge = procs.toggle_profile if profiled else None
                samples, sessions, wall, cpu = await run_sessions(
                    loads[api],
                    clients,
                    args.workers_per_client,
                    c,
                    stream,
                    plan.sessions_per_worker,
                    tag,
                    procs,
                    edge,
                )
                phase = SurfacePhase(
                    api, c, stream, rnd, samples, len(samples), sessions, wall, cpu
                )
                grown = await overhead.stream_messages(js) - before
                if grown != phase.requests + phase.sessions:
                    raise RuntimeError(
                        f"{api} c={c} stream={stream} round {rnd}: EVENTS grew by {grown}; "
                        f"{phase.requests} turns answered + {phase.sessions} sessions opened"
                    )
                phases.append(phase)
                line.append(
                    f"{api} {phase.cpu_ms_per_request():6.2f} ms CPU/req, "
                    f"p50 {overhead.pct(samples, 50) * 1000:6.1f} ms"
                )
            say(
                f"  round {rnd + 1}/{plan.rounds} c={c} "
                f"{'streamed    ' if stream else 'not streamed'}: " + " | ".join(line)
            )
    return phases


def report(phases: list[SurfacePhase], plan: SurfacePlan, apis: list[str]) -> JSON:
    """Per API and variant: CPU ms per request (pooled over rounds), the ratio to Chat's (the
    median of the per-round ratios: each round's phases ran back to back; and the ratio of the
    pooled figures), p50 latency."""
    rows = []
    pooled_chat: dict[tuple[int, bool], float] = {}
    say(
        f"\n{'API':<10}{'streamed':>9}{'c':>3}{'gateway CPU ms/req':>20}{'user ms/req':>13}"
        f"{'vs chat':>9}{'pooled':>8}{'p50 ms':>9}{'p90 ms':>9}{'req':>6}  vs chat per round"
    )
    for c, stream in plan.variants:
        by_api = {
            api: sorted(
                (p for p in phases if (p.api, p.concurrency, p.streamed) == (api, c, stream)),
                key=lambda p: p.round,
            )
            for api in apis
        }
        for api, ps in by_api.items():
            requests = sum(p.requests for p in ps)
            cpu = 1000 * sum(p.cpu_s["gateway"] for p in ps) / requests
            user = 1000 * sum(p.cpu_s["gateway_user"] for p in ps) / requests
            latencies = [x * 1000 for p in ps for x in p.latencies_s]
            ratios = None
            if api == "chat":
                pooled_chat[(c, stream)] = cpu
            if "chat" in by_api:
                ratios = [
                    p.cpu_ms_per_request() / q.cpu_ms_per_request()
                    for p, q in zip(ps, by_api["chat"], strict=True)
                ]
            row = {
                "api": api,
                "streamed": stream,
                "concurrency": c,
                "cpu_ms_per_request": round(cpu, 3),
                "user_cpu_ms_per_request": round(user, 3),
                "ratio_vs_chat": round(statistics.median(ratios), 3) if ratios else None,
                "pooled_ratio_vs_chat": (
                    round(cpu / pooled_chat[(c, stream)], 3) if ratios else None
                ),
                "round_ratios_vs_chat": [round(r, 3) for r in ratios] if ratios else None,
                "round_cpu_ms_per_request": [round(p.cpu_ms_per_request(), 3) for p in ps],
                "p50_ms": round(overhead.pct(latencies, 50), 2),
                "p90_ms": round(overhead.pct(latencies, 90), 2),
                "requests": requests,
                "requests_per_s": round(requests / sum(p.wall_s for p in ps), 1),
                "cpu_ms_per_request_other": {
                    k: round(1000 * sum(p.cpu_s[k] for p in ps) / requests, 3)
                    for k in ("backend", "nats", "loadgen")
                },
            }
            rows.append(row)
            rounds = " ".join(f"{r:.2f}" for r in ratios or ())
            say(
                f"{api:<10}{'yes' if stream else 'no':>9}{c:>3}{cpu:>20.2f}{user:>13.2f}"
                f"{row['ratio_vs_chat'] or float('nan'):>9.3f}"
                f"{row['pooled_ratio_vs_chat'] or float('nan'):>8.3f}"
                f"{row['p50_ms']:>9.1f}{row['p90_ms']:>9.1f}{requests:>6}  {rounds}"
            )
    return {"rows": rows}


def surface_plan(args: argparse.Namespace) -> SurfacePlan:
    """Full: not streamed at every level, streamed at the first; quick: the first level only,
    not streamed and streamed."""
    levels = [int(c) for c in (args.concurrency or "1,4").split(",")]
    if args.quick:
        plan = SurfacePlan(2, 1, ((levels[0], False), (levels[0], True)))
    else:
        plan = SurfacePlan(6, 1, (*((c, False) for c in levels), (levels[0], True)))
    if args.rounds is not None:
        plan = SurfacePlan(args.rounds, plan.sessions_per_worker, plan.variants)
    return plan


async def api_surfaces_main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    apis = [api.strip() for api in args.api_surfaces.split(",") if api.strip()]
    unknown = sorted(set(apis) - set(APIS))
    if unknown or not apis:
        parser.error(f"--api-surfaces takes a comma-separated subset of {','.join(APIS)}")
    if args.compare_with is not None or args.backend_kind != "fixed-latency":
        parser.error("--api-surfaces runs one gateway on the fixed-latency backend")
    if args.profile_gateway and (args.rounds or 2) < 2:
        parser.error("--profile-gateway profiles odd rounds and needs at least 2")
    apis = [api for api in APIS if api in apis]
    plan = surface_plan(args)
    if args.max_inflight_per_replica is None:
        args.max_inflight_per_replica = max(c for c, _ in plan.variants)
    started = time.perf_counter()
    info = overhead.machine_info()
    banner("gateway CPU per API surface", args.quick, info)
    say(
        f"APIs: {', '.join(apis)}; Claude-Code-shaped sessions of {TURNS} turns, every reply a "
        f"tool call; backend: {args.ttft_ms:g} ms to the reply (itl {args.itl_ms:g} ms); "
        f"max context {MAX_CONTEXT}; log level {args.gateway_log_level or 'as shipped'}"
        + (", UNDER cProfile in odd rounds" if args.profile_gateway else "")
    )
    with tempfile.TemporaryDirectory(prefix="ts-gwapis-", dir=args.store_dir) as tmp:
        result = await bench(args, plan, apis, Path(tmp))
    out = report(result["phases"], plan, apis)
    profile = None
    if args.profile_gateway:
        phases = result["phases"]
        plain = [p for p in phases if p.round % 2 == 0]
        cpu_ms = 1000 * sum(p.cpu_s["gateway"] for p in plain) / sum(p.requests for p in plain)
        profiled = sum(p.requests for p in phases if p.round % 2 == 1)
        profile = overhead.print_profile(args.profile_gateway, args.profile_top, profiled, cpu_ms)
    ratios = {
        f"{r['api']}_c{r['concurrency']}{'_stream' if r['streamed'] else ''}": r["ratio_vs_chat"]
        for r in out["rows"]
        if r["api"] != "chat" and r["ratio_vs_chat"] is not None
    }
    worst = max(ratios.values(), default=None)
    targets = {
        "ratio_vs_chat_max": TARGET_RATIO,
        "worst_ratio": worst,
        "met": worst is not None and worst <= TARGET_RATIO,
    }
    if worst is not None:
        say(
            f"\ntarget: every API's CPU per request within {TARGET_RATIO}x of chat's: worst "
            f"{worst:.3f} ({max(ratios, key=lambda k: ratios[k])}): "
            f"{'met' if targets['met'] else 'NOT met'}"
        )
    figures = {
        **{
            f"cpu_ms_per_request_{r['api']}_c{r['concurrency']}"
            f"{'_stream' if r['streamed'] else ''}": r["cpu_ms_per_request"]
            for r in out["rows"]
        },
        **{f"ratio_vs_chat_{k}": v for k, v in ratios.items()},
        "targets": targets,
        "rows": out["rows"],
        "checks": result["checks"],
        "settings": {
            "apis": apis,
            "turns_per_session": TURNS,
            "sessions_per_worker": plan.sessions_per_worker,
            "rounds": plan.rounds,
            "variants": [{"concurrency": c, "streamed": s} for c, s in plan.variants],
            "max_tokens": MAX_TOKENS,
            "max_context": MAX_CONTEXT,
            "system_chars": SYSTEM_CHARS,
            "reply": REPLY_TEXT,
            "ttft_ms": args.ttft_ms,
            "itl_ms": args.itl_ms,
            "max_inflight_per_replica": args.max_inflight_per_replica,
            "gateway_log_level": args.gateway_log_level or "as shipped",
            "profiled": bool(args.profile_gateway),
        },
        **({"gateway_profile": profile} if profile else {}),
    }
    finish(figures, quick=args.quick, duration_s=time.perf_counter() - started, info=info)
