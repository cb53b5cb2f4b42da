"""A remote inference server (vLLM, SGLang) as a Backend: the request/stream skeleton they share.

``RemoteBackend.generate`` checks a turn's sampling against the replica's log-prob kind
(``gateway.backends.probe``), POSTs the server's request body to the prompt's endpoint (one per
server, but vLLM's image prompts: ``gateway.backends.vllm``) through the backend transport,
reads the answer (one JSON response when the caller reads the completion whole, else the
server-sent events, a network read's worth at a time) with the server's ``PayloadReader``, and
yields its chunks. A subclass supplies only its request body (``_request``) and its reader
(``_reader``), and where a prompt goes when not to its one URL (``_endpoint``):
``gateway.backends.vllm`` and ``gateway.backends.sglang``.

This module is also the one place where transport errors (httpx's exception classes:
``gateway.backends.transport``) become gateway errors (STYLE: translate at the adapter
boundary): a server that cannot be reached is ``BackendUnavailable`` (the router may try another
replica); anything else that goes wrong (an HTTP error status, a timeout, a broken stream, an
event that is not JSON, an ``{"error": ...}`` event) is ``BackendError``. Every message names
the server and its URL.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import (
    AsyncGenerator,
    AsyncIterable,
    AsyncIterator,
    Iterator,
    Mapping,
    Sequence,
)
from contextlib import aclosing, contextmanager
from dataclasses import replace
from types import MappingProxyType
from typing import Any, NamedTuple, NotRequired, Protocol, TypedDict

import httpx
import msgspec

from gateway.backends.interface import (
    GenerationChunk,
    Prompt,
    SamplingParams,
    needs_processed_logprobs,
)
from gateway.backends.probe import PROBE_PROMPT, GuardedLogprobs, LogprobsGuard, LogprobsKind
from gateway.backends.transport import Response, StreamingTransport, Target, Transport
from gateway.errors import BackendError, BackendUnavailable

__all__ = [
    "Endpoint",
    "PayloadReader",
    "RemoteBackend",
    "RemoteOptions",
    "decode_event",
    "merge_chunks",
    "post_event_batches",
    "post_event_stream",
    "post_whole",
]

_BODY_EXCERPT = 500  # characters of an error body worth putting in a message
# A non-streamed generation may take timeout_s plus max_tokens at this rate (tokens/s) before
# it times out: below any server's decode rate, so only a hung one reaches it.
_SLOWEST_TOKENS_PER_S = 10.0
_JSON = msgspec.json.Decoder()  # 3-4x json.loads on these events; the same dicts and lists
# Request bodies: msgspec copies a prompt's JSON text (msgspec.Raw) as it is, and encodes the
# rest ~10x faster than json.dumps.
_BODY = msgspec.json.Encoder()
_BODY_HEADERS = ((b"content-type", b"application/json"), (b"user-agent", b"turnstream"))
_NO_ADVICE: Mapping[int, str] = MappingProxyType({})


class PayloadReader(Protocol):
    """Reads one generation's payloads from its server into GenerationChunks (a new reader per
    generation). Each method returns the chunk to pass on now, or None; a reader may hold a
    chunk back (vLLM's last one waits for the usage event after it) and give it from ``last``."""

    finished: bool  # a finish_reason was read

    def read_whole(self, payload: bytes) -> GenerationChunk | None:
        """The body of a non-streamed response."""
        ...

    def read_batch(self, payloads: list[bytes]) -> GenerationChunk | None:
        """The ``data:`` payloads of one network read, as one chunk (``merge_chunks`` says why)."""
        ...

    def last(self) -> GenerationChunk | None:
        """After the last payload, once ``finished``: a chunk held back, or None."""
        ...


class Endpoint(NamedTuple):
    """Where a generation is POSTed, and what to tell the operator when the server refuses it
    with a status (``advice``: status -> how to start the server so that it serves it)."""

    target: Target
    advice: Mapping[int, str] = _NO_ADVICE


class RemoteOptions(TypedDict):
    """How a remote backend is set up, whichever server it talks to (the keyword arguments of
    ``VLLMBackend`` and ``SGLangBackend``)."""

    backend_id: str  # the replica's name, recorded in every TurnCompleted
    max_context: int  # the served model's context length
    # A transport passed in (tests, a shared pool) is the caller's to close; one made here is
    # the backend's.
    transport: NotRequired[Transport | None]
    timeout_s: NotRequired[float]  # the wait for each next event, not the whole generation
    connect_timeout_s: NotRequired[float]
    logprobs_kind: NotRequired[LogprobsKind | None]  # known already: not probed
    # Token ids of the log-prob probe (``gateway.backends.probe``), valid for the served model.
    probe_prompt: NotRequired[Sequence[int]]


class RemoteBackend(GuardedLogprobs, ABC):
    """What the HTTP backends (vLLM, SGLang) share: endpoint, identity, transport, timeouts,
    the log-prob guard, and ``generate``; a subclass supplies ``_request`` and ``_reader``.

    ``url``: the endpoint generations are POSTed to; ``server``: its kind, in messages;
    ``advice``: per log-prob kind, how to start that server so that it records the sampled
    distribution (quoted when a turn is refused)."""

    def __init__(
        self,
        url: str,
        server: str,
        advice: Mapping[LogprobsKind, str],
        *,
        backend_id: str,
        max_context: int,
        transport: Transport | None = None,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 5.0,
        logprobs_kind: LogprobsKind | None = None,
        probe_prompt: Sequence[int] = PROBE_PROMPT,
    ) -> None:
        self._url = url
        self._endpoint_of_all = Endpoint(Target(url))  # parsed once, not on every request
        self._server = server
        self._id = backend_id
        self._max_context = max_context
        self._owns_transport = transport is None
        self._transport: Transport = transport if transport is not None else StreamingTransport()
        self._timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s)
        self._where = f"{server} at {url}"
        self._logprobs = LogprobsGuard(
            replica=backend_id,
            where=self._where,
            sample=lambda prompt, params: self._stream(Prompt(prompt), params, checked=False),
            advice=advice,
            prompt=probe_prompt,
            kind=logprobs_kind,
        )

    @property
    def id(self) -> str:
        return self._id

    @property
    def max_context(self) -> int:
        return self._max_context

    @abstractmethod
    def _request(self, prompt: Prompt, params: SamplingParams) -> dict[str, Any]:
        """The JSON body of the server's request for one generation."""

    @abstractmethod
    def _reader(self, prompt: Prompt, params: SamplingParams) -> PayloadReader:
        """A reader of one generation's payloads from the server."""

    def _endpoint(self, prompt: Prompt) -> Endpoint:
        """Where ``prompt``'s generation is POSTed: the backend's URL, unless the server has
        another endpoint for such a prompt (vLLM's token-in/token-out one for images)."""
        return self._endpoint_of_all

    def generate(
        self, prompt: Prompt, params: SamplingParams, *, session: str | None = None
    ) -> AsyncIterator[GenerationChunk]:
        return self._stream(prompt, params, checked=True)

    async def _stream(
        self, prompt: Prompt, params: SamplingParams, *, checked: bool
    ) -> AsyncGenerator[GenerationChunk, None]:
        # Checked before anything is sent: a refusal (InvalidRequest) or the "raw" mark.
        mark = None
        if checked and needs_processed_logprobs(params):
            mark = await self._logprobs.admit(params)
        body = self._request(prompt, params)
        reader = self._reader(prompt, params)
        endpoint = self._endpoint(prompt)
        try:
            if not params.stream:  # one response, one chunk
                whole = await self._whole(endpoint, body, params.max_tokens)
                chunk = reader.read_whole(whole)
                if chunk is not None:
                    yield chunk if mark is None else replace(chunk, logprobs_kind=mark)
            else:
                async with aclosing(self._event_batches(endpoint, body)) as batches:
                    async for batch in batches:
                        chunk = reader.read_batch(batch)  # one network read's events
                        if chunk is not None:
                            yield chunk if mark is None else replace(chunk, logprobs_kind=mark)
        except BackendError:
            self._logprobs.forget()  # restarted, maybe with other flags, environment or version
            raise
        if not reader.finished:
            raise BackendError(f"{self._where}: the stream ended without a finish_reason")
        chunk = reader.last()
        if chunk is not None:
            yield chunk if mark is None else replace(chunk, logprobs_kind=mark)

    def _event_batches(
        self, endpoint: Endpoint, body: dict[str, Any]
    ) -> AsyncGenerator[list[bytes], None]:
        return post_event_batches(
            self._transport,
            endpoint.target,
            body,
            server=self._server,
            http_timeout=self._timeout,
            advice=endpoint.advice,
        )

    async def _whole(self, endpoint: Endpoint, body: dict[str, Any], max_tokens: int) -> bytes:
        """POST a non-streamed request; its response comes when the whole generation is done,
        so the wait is bounded by ``timeout_s`` plus the time of ``max_tokens`` at the slowest
        rate a server is expected to decode at (_SLOWEST_TOKENS_PER_S)."""
        read = self._timeout.read or 0.0
        timeout = self._timeout.as_dict() | {"read": read + max_tokens / _SLOWEST_TOKENS_PER_S}
        return await post_whole(
            self._transport,
            endpoint.target,
            body,
            server=self._server,
            http_timeout=httpx.Timeout(**timeout),
            advice=endpoint.advice,
        )

    async def close(self) -> None:
        if self._owns_transport:
            await self._transport.aclose()


async def post_event_stream(
    transport: Transport,
    url: Target,
    body: dict[str, Any],
    *,
    server: str,
    http_timeout: httpx.Timeout,
) -> AsyncGenerator[dict[str, Any], None]:
    """POST ``body`` as JSON and yield the object of every ``data:`` line until ``[DONE]``.

    Close the iterator (``contextlib.aclosing``) to stop early: that closes the connection, which
    is how vLLM and SGLang learn to abort the request.
    """
    batches = post_event_batches(transport, url, body, server=server, http_timeout=http_timeout)
    async with aclosing(batches):
        async for batch in batches:
            for payload in batch:
                yield decode_event(payload, url, server)


async def post_whole(
    transport: Transport,
    url: Target,
    body: dict[str, Any],
    *,
    server: str,
    http_timeout: httpx.Timeout,
    advice: Mapping[int, str] = _NO_ADVICE,
) -> bytes:
    """POST ``body`` as JSON and return the body of the (non-streamed) response (an error
    status: a BackendError, with ``advice[status]`` where given)."""
    with _translated(url, server):
        response = await _post(transport, url, body, http_timeout)
        if response.status != 200:
            raise await _status_error(response, url, server, advice)
        return await response.read()


async def _post(
    transport: Transport, url: Target, body: dict[str, Any], http_timeout: httpx.Timeout
) -> Response:
    """The response's head; the caller reads the body and closes the response (which hands
    the connection back, or closes it when the body was not read to its end)."""
    return await transport.request(
        b"POST", url, body=_BODY.encode(body), headers=_BODY_HEADERS, timeouts=http_timeout
    )


@contextmanager
def _translated(url: Target, server: str) -> Iterator[None]:
    """httpx's errors as the gateway's (see the module's docstring)."""
    try:
        yield
    except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
        raise BackendUnavailable(
            f"cannot connect to {server} at {url} ({exc}); is the server running?"
        ) from exc
    except httpx.TimeoutException as exc:
        raise BackendError(f"{server} at {url} timed out ({type(exc).__name__})") from exc
    except httpx.HTTPError as exc:
        raise BackendError(f"{server} at {url} failed mid-request: {exc!r}") from exc


async def post_event_batches(
    transport: Transport,
    url: Target,
    body: dict[str, Any],
    *,
    server: str,
    http_timeout: httpx.Timeout,
    advice: Mapping[int, str] = _NO_ADVICE,
) -> AsyncGenerator[list[bytes], None]:
    """POST ``body`` as JSON and yield the payloads of the ``data:`` lines until ``[DONE]``,
    undecoded, a list per network read: the events that arrived together (never an empty list).
    An error status is a BackendError, with ``advice[status]`` where given.

    Close the iterator (``contextlib.aclosing``) to stop early: that closes the connection, which
    is how vLLM and SGLang learn to abort the request.
    """
    with _translated(url, server):
        response = await _post(transport, url, body, http_timeout)
        try:
            if response.status != 200:
                raise await _status_error(response, url, server, advice)
            batches = _data_batches(response)
            async for batch in batches:
                if b"[DONE]" in batch:
                    done = batch.index(b"[DONE]")
                    if done:
                        yield batch[:done]
                    # Read to the end, as the OpenAI SDK does: a response left unread closes
                    # the connection, and every turn would pay a new one.
                    async for _ in batches:
                        pass
                    return
                yield batch
        finally:
            await response.aclose()


async def _status_error(
    response: Response, url: Target, server: str, advice: Mapping[int, str] = _NO_ADVICE
) -> BackendError:
    detail = (await response.read()).decode("utf-8", errors="replace")[:_BODY_EXCERPT]
    message = f"{server} at {url} answered HTTP {response.status}: {detail}"
    if response.status in advice:
        message = f"{message}. {advice[response.status]}"
    # 503: starting up, overloaded or shutting down; another replica may take the request.
    if response.status == 503:
        return BackendUnavailable(message)
    return BackendError(message)


async def _data_batches(body: AsyncIterable[bytes]) -> AsyncIterator[list[bytes]]:
    """The payloads of the ``data:`` lines, a list per body part that completed any.

    Only single-line ``data:`` events are used by these servers; comments (``: ping``) and
    blank separators are skipped. A body part holds as many events as one network read got,
    so they are split here in one pass rather than line by line."""
    pending = b""
    async for part in body:
        lines = (pending + part).splitlines() if pending else part.splitlines()
        # A line is complete once its end of line arrived (SSE allows \n, \r\n and \r; a
        # \r\n split across parts only adds a blank line, which is skipped).
        pending = b"" if part.endswith((b"\n", b"\r")) else lines.pop() if lines else b""
        batch = [line[5:].strip() for line in lines if line.startswith(b"data:")]
        if batch:
            yield batch
    if pending.startswith(b"data:"):
        yield [pending[5:].strip()]


def decode_event(payload: bytes, url: Target | str, server: str) -> dict[str, Any]:
    """One event's JSON object; an ``{"error": ...}`` event or one that is not a JSON object is
    a BackendError naming the server."""
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


def merge_chunks(chunks: Sequence[GenerationChunk]) -> GenerationChunk:
    """Consecutive chunks of one generation as one: their tokens in order, the last chunk's
    finish reason, weight version and log-prob kind, every chunk's ``extra``.

    The HTTP backends pass on the events that arrived in one network read as one chunk: nothing
    waits for more (each read's chunk goes out at once), so no token is later for it, while the
    gateway's cost per chunk (detokenizing, the client's event, its send) is paid once per read.
    """
    if len(chunks) == 1:
        return chunks[0]
    ids: list[int] = []
    logprobs: list[float] = []
    tops: list[list[Any]] | None = [] if chunks[0].top_logprobs is not None else None
    extra: dict[str, float] = {}
    for chunk in chunks:
        ids += chunk.token_ids
        logprobs += chunk.logprobs
        if tops is not None and chunk.top_logprobs is not None:
            tops += chunk.top_logprobs
        extra.update(chunk.extra)
    return replace(chunks[-1], token_ids=ids, logprobs=logprobs, top_logprobs=tops, extra=extra)
