"""The edge of the gateway: keys, runs, and bounded, strictly decoded request bodies.

``RequestGuard`` is plain ASGI middleware (starlette's BaseHTTPMiddleware costs a task and a
memory stream per request). Before any route runs it:

- checks the bearer key and records which runs it may touch (``allowed_runs``);
- reads the body under a size limit (a Content-Length over it is refused at once; a chunked
  body is counted as it streams; nothing past the limit is buffered) and a read deadline (a
  half-sent body is answered 408, not held forever);
- decodes a JSON body strictly: UTF-8 (no lone surrogates), finite numbers, integers within
  int64, nesting at most ``max_json_depth`` deep. The routes read that decoded body
  (``GuardedRoute``) instead of parsing it again.

An answer sent before the body was read whole leaves the rest to uvicorn, which discards it
and keeps the connection alive.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import msgspec
from fastapi import Request, Response
from fastapi.routing import APIRoute
from prometheus_client import Histogram
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import InvalidRequest, RequestTimeout, RequestTooLarge, Unauthorized
from gateway.http.kept_bodies import KeptBodies
from gateway.metrics import GatewayMetrics
from gateway.protocol.validated_once import KEPT_MEMO
from gateway.protocol.wire import INT64_MAX, INT64_MIN
from schemas.ids import ID_PATTERN

__all__ = [
    "GUARD_ERRORS",
    "SESSION_HEADERS",
    "BodyLimits",
    "GuardedRoute",
    "RequestGuard",
    "allowed_runs",
    "decode_json",
    "decoded_json",
    "parse_api_keys",
    "validation_context",
]

_JSON_KEY = "turnstream.json"
_MEMO_KEY = "turnstream.kept_memo"
_RUNS_KEY = "turnstream.runs"
_RUN_LIST = re.compile(f"^{ID_PATTERN}(,{ID_PATTERN})*$")
# An integer outside int64 has at least 19 digits: bodies without such a run of digits skip the
# walk that checks integers (digits -> "0", the rest -> " ": one C pass, ~5 ns a byte).
_DIGITS = bytes(48 if 48 <= i <= 57 else 32 for i in range(256))
_LONG_DIGITS = b"0" * 19
# Bodies this large are decoded and checked on a worker thread: the event loop (and /health)
# keeps answering while a huge body is refused. A session's first large body (nothing kept to
# reuse) from a quarter of that: decoding and indexing a coding agent's 400 KB first turn took
# ~4-8 ms of the loop, where its later bodies decode only their new items (issue 40).
_OFF_LOOP_BYTES = 1024 * 1024
_OFF_LOOP_FIRST_BYTES = 256 * 1024
_DECODER = msgspec.json.Decoder()
_CONTAINERS = (dict, list)
# Where a /v1 turn route finds its session (routes.scoped_routes.header_session): ours, then the
# session headers of the clients that send their own (Claude Code, Codex CLI); the first
# present wins. Same rules for all.
SESSION_HEADERS = ("X-Session-Id", "X-Claude-Code-Session-Id", "session-id")
# What names a client session (``_client_session``): the key, the run and the session
# headers, as ASGI spells them.
_CLIENT_HEADERS = frozenset(
    {b"authorization", b"x-api-key", b"x-run-id", *(h.lower().encode() for h in SESSION_HEADERS)}
)
# What RequestGuard.admit raises: answered with the error's status before any route runs.
GUARD_ERRORS = (Unauthorized, InvalidRequest, RequestTooLarge, RequestTimeout)


@dataclass(frozen=True)
class BodyLimits:
    max_bytes: int = 8 * 1024 * 1024
    timeout_s: float = 30.0
    max_json_depth: int = 64
    # The last large body of each client session, kept to decode only what its next request
    # adds (``KeptBodies``); 0: off.
    kept_bytes: int = 256 * 1024 * 1024


def parse_api_keys(entries: Sequence[str]) -> dict[str, frozenset[str] | None]:
    """``KEY`` (every run) or ``KEY=RUN[,RUN...]`` (only those runs) -> key: runs or None.

    >>> keys = parse_api_keys(["k1", "k2=runA,runB"])
    >>> keys["k1"], sorted(keys["k2"] or ())
    (None, ['runA', 'runB'])
    """
    keys: dict[str, frozenset[str] | None] = {}
    for entry in entries:
        key, sep, runs = entry.rpartition("=")
        if sep and key and _RUN_LIST.match(runs):
            keys[key] = frozenset(runs.split(","))
        else:
            keys[entry] = None
    return keys


def allowed_runs(request: Request) -> frozenset[str] | None:
    """The runs the request's key may touch; None: any."""
    runs: frozenset[str] | None = request.scope.get(_RUNS_KEY)
    return runs


def decode_json(body: bytes, max_depth: int) -> Any:
    """``body`` as JSON, or InvalidRequest saying what is wrong with it."""
    try:
        value = _DECODER.decode(body)
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"the body is not valid UTF-8: {exc}") from exc
    except RecursionError as exc:
        raise InvalidRequest(f"the JSON body is nested deeper than {max_depth} levels") from exc
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        # msgspec >= 0.23 reports invalid UTF-8 as a DecodeError (before: UnicodeDecodeError).
        if "UTF-8" in str(exc):
            raise InvalidRequest(f"the body is not valid UTF-8: {exc}") from exc
        # msgspec reports a lone surrogate escape (\ud800) as truncated input.
        raise InvalidRequest(
            f"the body is not valid JSON ({exc}); strings must be valid Unicode "
            "(no lone surrogates such as \\ud800) and numbers finite"
        ) from exc
    # The walk is exact; the byte scans only tell when it can be skipped (fewer brackets than
    # the depth limit cannot nest past it; no run of digits long enough to be an integer
    # outside int64). Each costs what it reads: the walk ~0.15 us an item, the scans ~1.5 ns
    # a byte. So the walk goes first, within a budget of an item per 64 bytes (a chat body at
    # 100k tokens: ~100 items in 400 KB, walked in ~15 us where the scans took ~480); past it
    # (a prompt of token ids: an item every few bytes; a short body) the scans decide.
    if not _check_tree(value, max_depth, budget=len(body) // 64) and (
        body.count(b"{") + body.count(b"[") > max_depth or _LONG_DIGITS in body.translate(_DIGITS)
    ):
        _check_tree(value, max_depth, budget=None)
    return value


def _check_tree(root: Any, max_depth: int, *, budget: int | None) -> bool:
    """Raise on nesting past ``max_depth`` or an integer outside int64; False where more than
    ``budget`` items were left unvisited (None: no bound)."""
    if not isinstance(root, _CONTAINERS):
        root = [root]  # a bare value: checked as an item
    stack: list[tuple[Any, int, str]] = [(root, 1, "$")]
    visited = 0
    while stack:
        node, depth, path = stack.pop()
        if depth > max_depth:
            raise InvalidRequest(
                f"the JSON body is nested deeper than {max_depth} levels at {path}"
            )
        if budget is not None:
            visited += len(node)
            if visited > budget:
                return False
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, child in items:
            if isinstance(child, _CONTAINERS):
                stack.append((child, depth + 1, f"{path}.{key}"))
            elif type(child) is int and not INT64_MIN <= child <= INT64_MAX:
                raise InvalidRequest(
                    f"integer at {path}.{key} is outside the 64-bit range", param=str(key)
                )
    return True


class RequestGuard:
    def __init__(
        self,
        app: ASGIApp,
        *,
        keys: Mapping[str, frozenset[str] | None],
        open_paths: frozenset[str],
        limits: BodyLimits,
        reject: Callable[[BaseException, str], JSONResponse],
        metrics: GatewayMetrics,
        kept: KeptBodies,
    ) -> None:
        self.app = app
        self.keys = dict(keys)
        self.open_paths = open_paths
        self.limits = limits
        self.kept = kept
        self.reject = reject
        self.metrics = metrics
        self._latency: dict[str, Histogram] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        admitted = await self.admitted(scope, receive, send)
        if admitted is not None:
            await self.app(scope, admitted, send)
            self.observe(getattr(scope.get("route"), "path", "unmatched"), started)

    async def admitted(self, scope: Scope, receive: Receive, send: Send) -> Receive | None:
        """``admit``, or None when a check failed: the error is answered, the request goes no
        further."""
        try:
            return await self.admit(scope, receive)
        except GUARD_ERRORS as problem:
            await self.reject(problem, scope["path"])(scope, receive, send)
            return None

    async def admit(self, scope: Scope, receive: Receive) -> Receive:
        """The checks before any route runs (one of ``GUARD_ERRORS`` when one fails): the key
        and its runs, then a POST/PUT/PATCH body read and decoded (``decoded_json``); returns
        the receive the app reads the body from."""
        if self.keys and scope["path"] not in self.open_paths:
            scope[_RUNS_KEY] = self._runs_of_key(scope)
        if scope["method"] in ("POST", "PUT", "PATCH"):
            receive = await self._read_body(scope, receive)
        return receive

    def observe(self, route: str, started: float) -> None:
        """The request's latency, by route (``route`` a route's path, or "unmatched")."""
        latency = self._latency.get(route)
        if latency is None:  # prometheus' labels() takes a lock and builds a key per call
            latency = self._latency[route] = self.metrics.request_latency.labels(route)
        latency.observe(time.perf_counter() - started)

    def _runs_of_key(self, scope: Scope) -> frozenset[str] | None:
        # Bearer (OpenAI clients) or x-api-key (Anthropic clients: Claude Code, the SDK).
        header = _header(scope, b"authorization")
        key = header[7:] if header.startswith("Bearer ") else _header(scope, b"x-api-key")
        if not key or key not in self.keys:
            raise Unauthorized(
                "missing or invalid API key (Authorization: Bearer KEY, or x-api-key: KEY)"
            )
        return self.keys[key]

    async def _read_body(self, scope: Scope, receive: Receive) -> Receive:
        limit = self.limits.max_bytes
        declared = _header(scope, b"content-length")
        if declared.isdigit() and int(declared) > limit:
            raise RequestTooLarge(_too_large(int(declared), limit))
        parts: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self.limits.timeout_s):
                while True:
                    message = await receive()
                    if message["type"] != "http.request":
                        return receive  # the client left: nothing to answer
                    part = message.get("body", b"")
                    size += len(part)
                    if size > limit:
                        raise RequestTooLarge(_too_large(size, limit, streamed=True))
                    parts.append(part)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            raise RequestTimeout(
                f"the request body did not arrive within {self.limits.timeout_s:g} s "
                f"({size} bytes received); send the whole body at once"
            ) from None
        body = b"".join(parts)
        if body and _is_json(_header(scope, b"content-type")):
            depth = self.limits.max_json_depth
            decode: Callable[[bytes], Any] = partial(decode_json, max_depth=depth)
            off_loop = len(body) > _OFF_LOOP_BYTES
            session = _client_session(scope) if self.kept.worth_keeping(body) else None
            if session is not None:
                decode = partial(self.kept.decode, session, decode=decode)
                off_loop |= len(body) > _OFF_LOOP_FIRST_BYTES and not self.kept.holds(session)
            if off_loop:
                scope[_JSON_KEY] = await asyncio.to_thread(decode, body)
            else:
                scope[_JSON_KEY] = decode(body)
            if session is not None:
                scope[_MEMO_KEY] = self.kept.memo_of(session)
        return _replay(body, receive)


def decoded_json(scope: Scope) -> tuple[bool, Any]:
    """(True, the body ``RequestGuard`` decoded) or (False, None): no JSON body was decoded."""
    if _JSON_KEY in scope:
        return True, scope[_JSON_KEY]
    return False, None


def validation_context(scope: Scope) -> dict[str, Any] | None:
    """pydantic's context for validating the body ``RequestGuard`` decoded: the memo of its
    kept members (``validated_once``), where it has some."""
    memo = scope.get(_MEMO_KEY)
    return None if memo is None else {KEPT_MEMO: memo}


def _client_session(scope: Scope) -> tuple[object, ...]:
    """Whose conversation a body continues: its path and the headers that name the key, run
    and session (so one client is never answered faster for another's bytes)."""
    headers = sorted((k, bytes(v)) for k, v in scope["headers"] if k in _CLIENT_HEADERS)
    return (scope["path"], *headers)


def _too_large(size: int, limit: int, *, streamed: bool = False) -> str:
    got = f"more than {limit}" if streamed else str(size)
    return (
        f"the request body is {got} bytes, over this gateway's limit of {limit} bytes "
        "(--max-body-bytes)"
    )


def _header(scope: Scope, name: bytes) -> str:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value).decode("latin-1")
    return ""


def _is_json(content_type: str) -> bool:
    kind = content_type.split(";", 1)[0].strip().lower()
    return not kind or kind == "application/json" or kind.endswith("+json")


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that hands the app the body read already, then the client's own messages
    (a streamed reply listens for the client's disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


class _GuardedRequest(Request):
    async def json(self) -> Any:
        if _JSON_KEY in self.scope:
            return self.scope[_JSON_KEY]
        return await super().json()


class GuardedRoute(APIRoute):
    """A route that reads the body ``RequestGuard`` decoded already."""

    def get_route_handler(self) -> Callable[[Request], Any]:
        handler = super().get_route_handler()

        async def guarded(request: Request) -> Response:
            response: Response = await handler(_GuardedRequest(request.scope, request.receive))
            return response

        return guarded
