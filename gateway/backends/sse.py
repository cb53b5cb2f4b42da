"""Server-sent JSON events from a remote inference server, over httpx.

The one place where httpx errors become gateway errors (STYLE: translate at the adapter
boundary): a server that cannot be reached is ``BackendUnavailable`` (the router may try another
replica); anything else that goes wrong (an HTTP error status, a timeout, a broken stream, an
event that is not JSON, an ``{"error": ...}`` event) is ``BackendError``. Every message names the
server and its URL.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncGenerator
from contextlib import AbstractAsyncContextManager
from typing import Any

import httpx

from gateway.errors import BackendError, BackendUnavailable

__all__ = ["ClientPool", "RemoteBackend", "post_event_stream"]

_BODY_EXCERPT = 500  # characters of an error body worth putting in a message


class ClientPool:
    """Several small httpx clients taking requests in turn.

    httpcore 1.0 does work proportional to its pool's size for every request and closes idle
    connections once a pool holds more than ``max_keepalive_connections`` in all; one client at
    64 concurrent streams cost milliseconds of CPU per request (benchmarks/gateway_overhead.py).
    Small pools keep connections reused and cheap."""

    def __init__(self, clients: int = 8, keepalive_per_client: int = 32) -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=keepalive_per_client)
        self._clients = [httpx.AsyncClient(limits=limits) for _ in range(clients)]
        self._turn = itertools.cycle(self._clients)

    def stream(
        self, method: str, url: str, **kwargs: Any
    ) -> AbstractAsyncContextManager[httpx.Response]:
        return next(self._turn).stream(method, url, **kwargs)

    @property
    def is_closed(self) -> bool:
        return all(client.is_closed for client in self._clients)

    async def aclose(self) -> None:
        for client in self._clients:
            await client.aclose()


class RemoteBackend:
    """What the HTTP backends (vLLM, SGLang) share: endpoint, identity, client, timeouts.

    A client passed in (tests, a shared pool) is the caller's to close; one made here is ours.
    ``timeout_s`` bounds the wait for each next event, not the whole generation."""

    def __init__(
        self,
        url: str,
        server: str,
        *,
        backend_id: str,
        max_context: int,
        client: httpx.AsyncClient | None,
        timeout_s: float,
        connect_timeout_s: float,
    ) -> None:
        self._url = url
        self._server = server
        self._id = backend_id
        self._max_context = max_context
        self._owns_client = client is None
        self._client: httpx.AsyncClient | ClientPool = (
            client if client is not None else ClientPool()
        )
        self._timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s)
        self._where = f"{server} at {url}"

    @property
    def id(self) -> str:
        return self._id

    @property
    def max_context(self) -> int:
        return self._max_context

    def _events(self, body: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        return post_event_stream(
            self._client, self._url, body, server=self._server, http_timeout=self._timeout
        )

    async def close(self) -> None:
        if self._owns_client:
            await self._client.aclose()


async def post_event_stream(
    client: httpx.AsyncClient | ClientPool,
    url: str,
    body: dict[str, Any],
    *,
    server: str,
    http_timeout: httpx.Timeout,
) -> AsyncGenerator[dict[str, Any], None]:
    """POST ``body`` as JSON and yield the object of every ``data:`` line until ``[DONE]``.

    Close the iterator (``contextlib.aclosing``) to stop early: that closes the connection, which
    is how vLLM and SGLang learn to abort the request.
    """
    try:
        async with client.stream("POST", url, json=body, timeout=http_timeout) as response:
            if response.status_code != httpx.codes.OK:
                raise await _status_error(response, url, server)
            lines = response.aiter_lines()
            async for line in lines:
                # Only single-line "data:" events are used by these servers; comments
                # (": ping") and blank separators are skipped.
                if not line.startswith("data:"):
                    continue
                payload = line[len("data:") :].strip()
                if payload == "[DONE]":
                    # Read to the end, as the OpenAI SDK does: a response left unread makes
                    # httpcore close the connection, and every turn would pay a new one.
                    async for _ in lines:
                        pass
                    return
                yield _decode_event(payload, url, server)
    except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
        raise BackendUnavailable(
            f"cannot connect to {server} at {url} ({exc}); is the server running?"
        ) from exc
    except httpx.TimeoutException as exc:
        raise BackendError(f"{server} at {url} timed out ({type(exc).__name__})") from exc
    except httpx.HTTPError as exc:
        raise BackendError(f"{server} at {url} failed mid-request: {exc!r}") from exc


async def _status_error(response: httpx.Response, url: str, server: str) -> BackendError:
    detail = (await response.aread()).decode("utf-8", errors="replace")[:_BODY_EXCERPT]
    message = f"{server} at {url} answered HTTP {response.status_code}: {detail}"
    # 503: starting up, overloaded or shutting down; another replica may take the request.
    if response.status_code == httpx.codes.SERVICE_UNAVAILABLE:
        return BackendUnavailable(message)
    return BackendError(message)


def _decode_event(payload: str, url: str, server: str) -> dict[str, Any]:
    try:
        event = json.loads(payload)
    except ValueError as exc:
        raise BackendError(
            f"{server} at {url} sent an event that is not JSON: {payload[:_BODY_EXCERPT]!r}"
        ) from exc
    if not isinstance(event, dict):
        raise BackendError(f"{server} at {url} sent a non-object event: {payload[:200]!r}")
    error = event.get("error")
    if error is not None:
        # Both servers report failures after the 200 header as a final {"error": {...}} event.
        message = error.get("message", error) if isinstance(error, dict) else error
        raise BackendError(f"{server} at {url} reported an error mid-stream: {message}")
    return event
