"""The gateway as a hostile (or merely demanding) HTTP client sees it.

- ``keepalive_client``: one connection at most, so ``assert_kept_alive`` can tell whether the
  gateway dropped it (the next request would get a new socket object);
- ``raw_json``: JSON text that ``json.dumps`` cannot write (a lone surrogate escape, NaN, 1e309);
- ``assert_error``: the OpenAI error body of a 4xx, with a message that names the problem;
- ``lazy_body``: a large body generated chunk by chunk, never held in memory;
- ``half_sent``: a request whose body stops short of its Content-Length;
- ``PeakRss``: a process's peak resident memory since a reset (VmHWM, reset via clear_refs);
- ``concurrently``: n calls released together by a barrier, their results in order.
"""

from __future__ import annotations

import json
import re
import socket
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import httpx

T = TypeVar("T")
JSON = dict[str, Any]

LONE_SURROGATE = '"x\\ud800"'  # JSON text: valid syntax, a string no UTF-8 can hold
ERROR_TYPES = {401: "authentication_error", 403: "permission_error"}  # others: invalid_request


def keepalive_client(base_url: str, **kwargs: Any) -> httpx.Client:
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    return httpx.Client(base_url=base_url, limits=limits, timeout=60, **kwargs)


def connection_of(response: httpx.Response) -> socket.socket:
    sock = response.extensions["network_stream"].get_extra_info("socket")
    assert isinstance(sock, socket.socket)
    return sock


def assert_kept_alive(client: httpx.Client, earlier: httpx.Response) -> None:
    """``GET /health`` answers 200 on the very connection that answered ``earlier``."""
    health = client.get("/health")
    assert health.status_code == 200, health.text
    assert connection_of(health) is connection_of(earlier), "the connection was dropped"


def assert_error(response: httpx.Response, status: int, code: str, mentions: str) -> JSON:
    """An OpenAI error body with ``status`` and ``code``, its message matching ``mentions``."""
    assert response.status_code == status, f"{response.status_code}: {response.text[:400]}"
    body = response.json()
    assert isinstance(body, dict) and "error" in body, f"not an OpenAI error body: {body}"
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["type"] == ERROR_TYPES.get(status, "invalid_request_error"), error
    assert error["code"] == code, error
    message = error["message"]
    assert isinstance(message, str) and re.search(mentions, message, re.IGNORECASE), error
    return dict(error)


def raw_json(obj: Any, **raw: str) -> bytes:
    """``obj`` as JSON text, each string ``"@name"`` in it replaced by ``raw[name]`` verbatim."""
    text = json.dumps(obj)
    for name, token in raw.items():
        assert f'"@{name}"' in text, name
        text = text.replace(f'"@{name}"', token)
    return text.encode()


def served_model(url: str, key: str | None = None) -> str:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    [model] = httpx.get(f"{url}/v1/models", headers=headers, timeout=10).json()["data"]
    return str(model["id"])


def open_session(client: httpx.Client, **body: Any) -> JSON:
    response = client.post("/v1/sessions", json=body)
    assert response.status_code == 200, response.text
    return dict(response.json())


def chat_url(session: JSON) -> str:
    return f"{session['base_url']}/chat/completions"


def lazy_body(model: str, size: int, started: threading.Event) -> Iterator[bytes]:
    """A chat body of exactly ``size`` bytes (one huge user message), made 1 MiB at a time;
    ``started`` is set when the first chunk is asked for (the headers are out)."""
    head = json.dumps({"model": model, "max_tokens": 1, "messages": [{"role": "user"}]})
    prefix, suffix = head[:-3].encode() + b', "content": "', b'"}]}'
    started.set()
    yield prefix
    left = size - len(prefix) - len(suffix)
    chunk = b"x" * (1 << 20)
    while left > 0:
        yield chunk[:left]
        left -= len(chunk)
    yield suffix


def half_sent(port: int, path: str, declared: int, sent: bytes, timeout: float) -> tuple[int, JSON]:
    """Declare ``declared`` body bytes, send only ``sent``, and read the answer (status, JSON)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {declared}\r\n\r\n"
        )
        sock.sendall(head.encode() + sent)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            assert chunk, f"connection closed without an answer: {data!r}"
            data += chunk
        header, _, body = data.partition(b"\r\n\r\n")
        length = re.search(rb"content-length:\s*(\d+)", header, re.IGNORECASE)
        assert length is not None, header
        while len(body) < int(length.group(1)):
            chunk = sock.recv(65536)
            assert chunk, "connection closed mid-answer"
            body += chunk
        return int(header.split()[1]), json.loads(body)


class PeakRss:
    """Peak resident memory of process ``pid`` since ``reset()``, as growth in MB."""

    def __init__(self, pid: int) -> None:
        self.status = Path(f"/proc/{pid}/status")
        self.clear_refs = Path(f"/proc/{pid}/clear_refs")
        self.base_kb = 0

    def _kb(self, field: str) -> int:
        [line] = [x for x in self.status.read_text().splitlines() if x.startswith(f"{field}:")]
        return int(line.split()[1])

    def rss_mb(self) -> float:
        return self._kb("VmRSS") / 1024

    def reset(self) -> None:
        self.clear_refs.write_text("5")  # VmHWM := VmRSS (Linux >= 4.0)
        self.base_kb = self._kb("VmRSS")

    def growth_mb(self) -> float:
        return (self._kb("VmHWM") - self.base_kb) / 1024


def concurrently(n: int, call: Callable[[int], T]) -> list[T]:
    """``call(0) .. call(n - 1)`` in n threads, released together; the results in order."""
    barrier = threading.Barrier(n)

    def run(i: int) -> T:
        barrier.wait()
        return call(i)

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(run, range(n)))
