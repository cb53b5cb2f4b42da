"""Discovery: a logging fake of the Anthropic and OpenAI Responses APIs, scripted per script.py.

Not used by the tests: it is how the request fixtures under tests/fixtures/agents were captured
(what Claude Code and Codex really send), and how to capture them again for a new CLI version::

    .venv/bin/python -m tests.agents.capture --port 8765 --log /tmp/capture.jsonl

Every request is appended to the log as ``{"method", "path", "query", "headers", "body"}`` (the
API key redacted). ``POST .../v1/messages`` answers Anthropic SSE (or JSON when not streamed),
``POST .../v1/responses`` typed Responses SSE, each the step of script.py that the number of tool
results in the conversation selects; ``HEAD /`` and ``GET /`` answer 200; the rest 404.
"""

from __future__ import annotations

import argparse
import json
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from tests.agents.script import FINAL_TEXT, claude_bash_call, codex_shell_call, step_for

__all__ = ["main", "redact_headers"]

_SECRET_HEADERS = {"authorization", "x-api-key", "api-key"}


def redact_headers(headers: dict[str, str]) -> dict[str, str]:
    return {
        name: ("<redacted>" if name.lower() in _SECRET_HEADERS else value)
        for name, value in headers.items()
    }


def _anthropic_tool_results(body: dict[str, Any]) -> int:
    return sum(
        1
        for message in body.get("messages", [])
        if isinstance(message.get("content"), list)
        for block in message["content"]
        if isinstance(block, dict) and block.get("type") == "tool_result"
    )


def _responses_tool_results(body: dict[str, Any]) -> int:
    items = body.get("input", [])
    return sum(
        1
        for item in items
        if isinstance(items, list)
        if isinstance(item, dict) and item.get("type", "").endswith("call_output")
    )


def _sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()


def anthropic_reply(body: dict[str, Any]) -> tuple[dict[str, Any], list[bytes]]:
    """The scripted message (for a non-streamed answer) and its SSE events."""
    names = {tool.get("name") for tool in body.get("tools", [])}
    command = step_for(_anthropic_tool_results(body)) if "Bash" in names else None
    if command is None:
        block: dict[str, Any] = {"type": "text", "text": FINAL_TEXT}
        start: dict[str, Any] = {"type": "text", "text": ""}
        delta = {"type": "text_delta", "text": FINAL_TEXT}
        stop_reason = "end_turn"
    else:
        name, arguments = claude_bash_call(command)
        call_id = f"toolu_{uuid.uuid4().hex[:20]}"
        block = {"type": "tool_use", "id": call_id, "name": name, "input": arguments}
        start = {"type": "tool_use", "id": call_id, "name": name, "input": {}}
        delta = {"type": "input_json_delta", "partial_json": json.dumps(arguments)}
        stop_reason = "tool_use"
    usage = {"input_tokens": 100, "output_tokens": 20}
    message = {
        "id": f"msg_{uuid.uuid4().hex[:20]}",
        "type": "message",
        "role": "assistant",
        "model": body.get("model", "tiny"),
        "content": [block],
        "stop_reason": stop_reason,
        "stop_sequence": None,
        "usage": usage,
    }
    events = [
        _sse(
            "message_start",
            {
                "type": "message_start",
                "message": {
                    **message,
                    "content": [],
                    "stop_reason": None,
                    "usage": {**usage, "output_tokens": 1},
                },
            },
        ),
        _sse(
            "content_block_start",
            {"type": "content_block_start", "index": 0, "content_block": start},
        ),
        _sse("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}),
        _sse("content_block_stop", {"type": "content_block_stop", "index": 0}),
        _sse(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop_reason, "stop_sequence": None},
                "usage": {"output_tokens": 20},
            },
        ),
        _sse("message_stop", {"type": "message_stop"}),
    ]
    return message, events


def responses_events(body: dict[str, Any]) -> list[bytes]:
    """The typed Responses SSE events of the scripted step."""
    names = {
        tool["name"]
        for tool in body.get("tools", [])
        if isinstance(tool, dict) and isinstance(tool.get("name"), str)
    }
    command = step_for(_responses_tool_results(body)) if names else None
    response_id = f"resp_{uuid.uuid4().hex[:20]}"
    base = {
        "id": response_id,
        "object": "response",
        "created_at": 0,
        "model": body.get("model", "tiny"),
        "status": "in_progress",
        "output": [],
    }
    seq = iter(range(1000))
    events = [
        _sse(
            "response.created",
            {"type": "response.created", "sequence_number": next(seq), "response": base},
        )
    ]
    if command is None:
        item_id = f"msg_{uuid.uuid4().hex[:20]}"
        part = {"type": "output_text", "text": FINAL_TEXT, "annotations": []}
        item: dict[str, Any] = {
            "type": "message",
            "id": item_id,
            "role": "assistant",
            "status": "completed",
            "content": [part],
        }
        common = {"item_id": item_id, "output_index": 0, "content_index": 0}
        events += [
            _sse(
                "response.output_item.added",
                {
                    "type": "response.output_item.added",
                    "sequence_number": next(seq),
                    "output_index": 0,
                    "item": {**item, "status": "in_progress", "content": []},
                },
            ),
            _sse(
                "response.content_part.added",
                {
                    "type": "response.content_part.added",
                    "sequence_number": next(seq),
                    **common,
                    "part": {**part, "text": ""},
                },
            ),
            _sse(
                "response.output_text.delta",
                {
                    "type": "response.output_text.delta",
                    "sequence_number": next(seq),
                    **common,
                    "delta": FINAL_TEXT,
                },
            ),
            _sse(
                "response.output_text.done",
                {
                    "type": "response.output_text.done",
                    "sequence_number": next(seq),
                    **common,
                    "text": FINAL_TEXT,
                },
            ),
            _sse(
                "response.content_part.done",
                {
                    "type": "response.content_part.done",
                    "sequence_number": next(seq),
                    **common,
                    "part": part,
                },
            ),
        ]
    else:
        name, arguments = codex_shell_call(names, command)
        item_id = f"fc_{uuid.uuid4().hex[:20]}"
        text = json.dumps(arguments)
        item = {
            "type": "function_call",
            "id": item_id,
            "call_id": f"call_{uuid.uuid4().hex[:20]}",
            "name": name,
            "arguments": text,
            "status": "completed",
        }
        events += [
            _sse(
                "response.output_item.added",
                {
                    "type": "response.output_item.added",
                    "sequence_number": next(seq),
                    "output_index": 0,
                    "item": {**item, "arguments": "", "status": "in_progress"},
                },
            ),
            _sse(
                "response.function_call_arguments.delta",
                {
                    "type": "response.function_call_arguments.delta",
                    "sequence_number": next(seq),
                    "item_id": item_id,
                    "output_index": 0,
                    "delta": text,
                },
            ),
            _sse(
                "response.function_call_arguments.done",
                {
                    "type": "response.function_call_arguments.done",
                    "sequence_number": next(seq),
                    "item_id": item_id,
                    "output_index": 0,
                    "arguments": text,
                },
            ),
        ]
    events += [
        _sse(
            "response.output_item.done",
            {
                "type": "response.output_item.done",
                "sequence_number": next(seq),
                "output_index": 0,
                "item": item,
            },
        ),
        _sse(
            "response.completed",
            {
                "type": "response.completed",
                "sequence_number": next(seq),
                "response": {
                    **base,
                    "status": "completed",
                    "output": [item],
                    "usage": {
                        "input_tokens": 100,
                        "input_tokens_details": {"cached_tokens": 0},
                        "output_tokens": 20,
                        "output_tokens_details": {"reasoning_tokens": 0},
                        "total_tokens": 120,
                    },
                },
            },
        ),
    ]
    return events


def _handler(log_path: str, lock: threading.Lock) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _record(self) -> dict[str, Any]:
            length = int(self.headers.get("content-length") or 0)
            raw = self.rfile.read(length) if length else b""
            try:
                body: Any = json.loads(raw) if raw else None
            except ValueError:
                body = raw.decode(errors="replace")
            url = urlsplit(self.path)
            entry = {
                "method": self.command,
                "path": url.path,
                "query": dict(parse_qsl(url.query)),
                "headers": redact_headers(dict(self.headers.items())),
                "body": body,
            }
            with lock, open(log_path, "a") as log:
                log.write(json.dumps(entry) + "\n")
            return entry

        def _send(self, status: int, content_type: str, chunks: list[bytes]) -> None:
            payload = b"".join(chunks)
            self.send_response(status)
            self.send_header("content-type", content_type)
            self.send_header("content-length", str(len(payload)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(payload)

        def do_HEAD(self) -> None:
            self._record()
            self._send(200, "text/plain", [b""])

        def do_GET(self) -> None:
            entry = self._record()
            if entry["path"] == "/":
                self._send(200, "text/plain", [b"ok"])
            elif entry["path"].endswith("/models"):
                models = {"object": "list", "data": [{"id": "tiny", "object": "model"}]}
                self._send(200, "application/json", [json.dumps(models).encode()])
            else:
                self._send(404, "application/json", [b'{"error": {"message": "not found"}}'])

        def do_POST(self) -> None:
            entry = self._record()
            body = entry["body"] if isinstance(entry["body"], dict) else {}
            if entry["path"].endswith("/v1/messages"):
                message, events = anthropic_reply(body)
                if body.get("stream"):
                    self._send(200, "text/event-stream", events)
                else:
                    self._send(200, "application/json", [json.dumps(message).encode()])
            elif entry["path"].endswith("/v1/responses"):
                self._send(200, "text/event-stream", responses_events(body))
            else:
                self._send(404, "application/json", [b'{"error": {"message": "not found"}}'])

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--log", required=True, help="JSON-lines file the requests go to")
    args = parser.parse_args()
    server = ThreadingHTTPServer(("127.0.0.1", args.port), _handler(args.log, threading.Lock()))
    server.serve_forever()


if __name__ == "__main__":
    main()
