"""Server-sent JSON events from a remote inference server, over httpx.

The one place where httpx errors become gateway errors (STYLE: translate at the adapter
boundary): a server that cannot be reached is ``BackendUnavailable`` (the router may try another
replica); anything else that goes wrong (an HTTP error status, a timeout, a broken stream, an
event that is not JSON, an ``{"error": ...}`` event) is ``BackendError``. Every message names the
server and its URL.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import httpx
import msgspec

from gateway.backends.transport import StreamingTransport
from gateway.errors import BackendError, BackendUnavailable

__all__ = ["RemoteBackend", "post_event_stream"]

_BODY_EXCERPT = 500  # characters of an error body worth putting in a message
_JSON = msgspec.json.Decoder()  # 3-4x json.loads on these events; the same dicts and lists


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
        self._client = (
            client if client is not None else httpx.AsyncClient(transport=StreamingTransport())
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
    client: httpx.AsyncClient,
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
            payloads = _data_payloads(response.aiter_bytes())
            async for payload in payloads:
                if payload == b"[DONE]":
                    # Read to the end, as the OpenAI SDK does: a response left unread closes
                    # the connection, and every turn would pay a new one.
                    async for _ in payloads:
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


async def _data_payloads(body: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The payload of every ``data:`` line, whatever parts the body arrives in.

    Only single-line ``data:`` events are used by these servers; comments (``: ping``) and
    blank separators are skipped. A body part holds as many events as one network read got,
    so they are split here in one pass rather than line by line through httpx's decoders."""
    pending = b""
    async for part in body:
        lines = (pending + part).splitlines() if pending else part.splitlines()
        # A line is complete once its end of line arrived (SSE allows \n, \r\n and \r; a
        # \r\n split across parts only adds a blank line, which is skipped).
        pending = b"" if part.endswith((b"\n", b"\r")) else lines.pop() if lines else b""
        for line in lines:
            if line.startswith(b"data:"):
                yield line[5:].strip()
    if pending.startswith(b"data:"):
        yield pending[5:].strip()


def _decode_event(payload: bytes, url: str, server: str) -> dict[str, Any]:
    try:
        event = _JSON.decode(payload)
    except msgspec.DecodeError:
        # What msgspec refuses and json accepts (NaN, Infinity; invalid UTF-8, which the
        # response's text decoding replaces) is read as json reads the text.
        text = payload.decode("utf-8", errors="replace").strip()
        try:
            event = json.loads(text)
        except ValueError as exc:
            raise BackendError(
                f"{server} at {url} sent an event that is not JSON: {text[:_BODY_EXCERPT]!r}"
            ) from exc
    if not isinstance(event, dict):
        text = payload[:200].decode("utf-8", errors="replace")
        raise BackendError(f"{server} at {url} sent a non-object event: {text!r}")
    error = event.get("error")
    if error is not None:
        # Both servers report failures after the 200 header as a final {"error": {...}} event.
        message = error.get("message", error) if isinstance(error, dict) else error
        raise BackendError(f"{server} at {url} reported an error mid-stream: {message}")
    return event
