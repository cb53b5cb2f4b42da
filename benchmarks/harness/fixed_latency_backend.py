"""A fixed-latency stand-in for vLLM's OpenAI-compatible server (benchmarks and tests only).

It speaks the subset of ``POST /v1/completions`` that ``gateway.backends.vllm.VLLMBackend`` uses
(token-id ``prompt``, ``stream`` true or false, ``return_token_ids``,
``return_tokens_as_token_ids``, ``logprobs: k``, ``stream_options.include_usage``) and answers
every request with the same fixed tokens after a fixed delay::

    data: {"id": ..., "choices": [{"index": 0, "text": "T", "token_ids": [84],
           "prompt_token_ids": [...],                  # first event only, as vLLM does
                                                       # (both ids: with return_token_ids)
           "logprobs": {"tokens": ["token_id:84"], "token_logprobs": [-0.1],
                        "top_logprobs": [{"token_id:84": -0.1, ...}], "text_offset": [0]},
           "finish_reason": null, "stop_reason": null}], "usage": null}
    ...                                                # one event per token (--tokens-per-event)
    data: {... "finish_reason": "stop" ...}            # on the last token
    data: {"id": ..., "choices": [], "usage": {"prompt_tokens": P, "completion_tokens": N, ...}}
    data: [DONE]

or, with ``stream: false``, all tokens in one JSON body (one choice, after ``--ttft-ms`` plus
``--itl-ms`` per further token); plus ``GET /health``, ``GET /v1/models`` (the model and its
``max_model_len``, as vLLM lists them) and ``GET /stats`` (connections accepted, completions
served: a client that opens a new connection per request shows up as connections ~
completions; completions in flight, and the most at once; tokens served).

A trainer's pause for a weight update (``benchmarks/interrupted_turns.py``), as vLLM's
``/pause?mode=abort`` ... ``/resume`` does it, on cue: ``POST /interrupt {"after_tokens": k}``
makes the next completion end after its k-th token with ``finish_reason: "abort"`` (streamed: an
event without tokens, as vLLM ends an aborted request; not streamed: the k tokens) and pauses the
server then; ``GET /paused`` answers once it is paused; completions that arrive while paused wait
(vLLM queues them) until ``POST /resume``, which answers how long the pause lasted and how many
waited. A request whose prompt is the aborted one's plus its k tokens (the continuation) is
served the rest of the tokens, so that the two parts make the uninterrupted answer.

Timing: the response headers go out at once (as a streaming server sends them); the first event
after ``--ttft-ms``, each further event ``--itl-ms`` after the previous one. With ``--itl-ms 0``
(the default) all events leave in one write after ``--ttft-ms``: the client still parses one
event per token, but the server pays one timer and one write per request, so its own CPU cost is
as small as possible and the same whichever client (the gateway or the benchmark) sends the
request. ``max_tokens`` smaller than the token list cuts it (``finish_reason: "length"``).

The HTTP/1.1 server is a bare ``asyncio.Protocol`` (keep-alive, ``Content-Length`` bodies,
chunked responses): no framework, so what it costs is small next to what is measured.
``--reuse-port`` lets several processes serve one port (the scale-out benchmark on many cores),
``--uvloop`` runs it on uvloop. Run::

    .venv/bin/python benchmarks/harness/fixed_latency_backend.py --port 8100 --tokens 84,104,101,258
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

__all__ = ["BackendConfig", "serve"]

_MAX_HEADER = 64 * 1024
_STATUS_TEXT = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed"}


@dataclass(frozen=True)
class BackendConfig:
    tokens: tuple[int, ...]  # the completion, every time (the last one is usually the stop id)
    texts: tuple[str, ...]  # text of each token (what vLLM puts in "text")
    ttft_s: float = 0.020
    itl_s: float = 0.0
    tokens_per_event: int = 1
    model: str = "fixed-latency"
    max_model_len: int = 4096
    vision: Any = None  # a gateway.images.VisionSpec: /inference/v1/generate expands images


@dataclass
class Stats:
    connections: int = 0
    open_connections: int = 0
    completions: int = 0
    bad_requests: int = 0
    in_flight: int = 0  # completions started and not yet answered
    most_in_flight: int = 0  # the most at once (tests assert overlap by it, not by time)
    tokens: int = 0  # completion tokens served (an aborted part's too)

    def started(self) -> None:
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)


class Pause:
    """A trainer's pause, on cue (the module's docstring): the abort armed, the pause, what
    waits for its end, and the aborted request a continuation extends."""

    def __init__(self) -> None:
        self.armed: int | None = None  # the next completion ends "abort" after this many tokens
        self.since: float | None = None  # paused (perf_counter) since
        self.waiting: list[Callable[[], None]] = []  # completions queued until /resume
        self.watchers: list[Callable[[], None]] = []  # GET /paused answers
        self.aborted: tuple[int, ...] = ()  # the aborted request's prompt + tokens
        self.served: int = 0  # how many tokens of the answer it was served

    def begin(self, prompt: list[int], served: tuple[int, ...]) -> None:
        self.since = time.perf_counter()
        self.aborted, self.served = (*prompt, *served), len(served)
        watchers, self.watchers = self.watchers, []
        for answer in watchers:
            answer()

    def start_of(self, prompt: list[int]) -> int:
        """The first token to serve ``prompt``: after the aborted part's, for its continuation."""
        if self.aborted and len(prompt) == len(self.aborted) and tuple(prompt) == self.aborted:
            self.aborted = ()
            return self.served
        return 0

    def resume(self) -> dict[str, float]:
        paused_s = 0.0 if self.since is None else time.perf_counter() - self.since
        waiting, self.waiting, self.since = self.waiting, [], None
        for start in waiting:
            start()
        return {"paused_s": paused_s, "queued": len(waiting)}


class Completions:
    """The events of one answer, pre-encoded per (top-k, first token, token count, ids, finish);
    only the first event (which echoes the prompt ids) and the usage event are built per
    request. ``start``: the first of the tokens served (a continuation's, after an abort)."""

    def __init__(self, config: BackendConfig) -> None:
        self.config = config
        self._cache: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
        self._encoded: dict[tuple[Any, ...], list[bytes]] = {}

    def count(self, start: int, max_tokens: int) -> int:
        """How many tokens a request is served: the rest of the answer, at most ``max_tokens``."""
        return max(1, min(len(self.config.tokens) - start, max_tokens))

    def _finish(self, start: int, n: int) -> str:
        return "stop" if start + n == len(self.config.tokens) else "length"

    def _choices(
        self, k: int, start: int, n: int, ids: bool, finish: str | None
    ) -> list[dict[str, Any]]:
        """The choices of tokens ``start`` .. ``start + n``, the last with ``finish``."""
        key = (k, start, n, ids, finish)
        if key not in self._cache:
            config = self.config
            step = config.tokens_per_event
            end = start + n
            choices = []
            for at in range(start, end, step):
                part = list(config.tokens[at : min(at + step, end)])
                logprobs = [round(-0.05 - 0.01 * (at + i), 4) for i in range(len(part))]
                top = [
                    {
                        f"token_id:{token}": lp,
                        **{f"token_id:{(token + j) % 256}": lp - j for j in range(1, k)},
                    }
                    for token, lp in zip(part, logprobs, strict=True)
                ]
                offsets = [
                    sum(len(t) for t in config.texts[start : at + i]) for i in range(len(part))
                ]
                choices.append(
                    {
                        "index": 0,
                        "text": "".join(config.texts[at : at + len(part)]),
                        "logprobs": {
                            "text_offset": offsets,
                            "token_logprobs": logprobs,
                            "tokens": [f"token_id:{t}" for t in part],
                            "top_logprobs": top,
                        },
                        "finish_reason": finish if at + len(part) >= end else None,
                        "stop_reason": None,
                        **({"token_ids": part} if ids else {}),
                    }
                )
            self._cache[key] = choices
            self._encoded[key] = [
                _sse(self._event([choice], None)) for choice in choices[1:]
            ]  # events 2.. are identical for every request
        return self._cache[key]

    def _event(self, choices: list[dict[str, Any]], usage: dict[str, int] | None) -> dict[str, Any]:
        return {
            "id": "cmpl-fixed",
            "object": "text_completion",
            "created": 0,
            "model": self.config.model,
            "choices": choices,
            "usage": usage,
        }

    def _usage(self, prompt: list[int], n: int) -> dict[str, int]:
        return {
            "prompt_tokens": len(prompt),
            "total_tokens": len(prompt) + n,
            "completion_tokens": n,
        }

    def events(
        self, prompt: list[int], k: int, n: int, ids: bool, *, start: int = 0, abort: bool = False
    ) -> list[bytes]:
        """The streamed events of ``n`` tokens from ``start`` (``ids``: the request's
        ``return_token_ids``: the ids, and the prompt's echoed); ``abort``: then an event without
        tokens that ends the request "abort", as vLLM ends one aborted mid-generation."""
        finish = None if abort else self._finish(start, n)
        choices = self._choices(k, start, n, ids, finish)
        first = {**choices[0], "prompt_token_ids": prompt} if ids else choices[0]
        ended = []
        if abort:
            empty = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
            choice = {"index": 0, "text": "", "logprobs": empty, "finish_reason": "abort"}
            ended = [_sse(self._event([{**choice, **({"token_ids": []} if ids else {})}], None))]
        return [
            _sse(self._event([first], None)),
            *self._encoded[(k, start, n, ids, finish)],
            *ended,
            _sse(self._event([], self._usage(prompt, n))),
            b"data: [DONE]\n\n",
        ]

    def whole(
        self, prompt: list[int], k: int, n: int, ids: bool, *, start: int = 0, abort: bool = False
    ) -> bytes:
        """The non-streamed answer (``stream: false``): the ``n`` tokens from ``start`` in one
        choice (``abort``: ended "abort", the tokens so far kept, as vLLM answers)."""
        finish = "abort" if abort else self._finish(start, n)
        key = (-1 - k, start, n, ids, finish)
        if key not in self._encoded:
            parts = self._choices(k, start, n, ids, finish)
            logprobs = {
                name: [item for part in parts for item in part["logprobs"][name]]
                for name in ("text_offset", "token_logprobs", "tokens", "top_logprobs")
            }
            choice = {
                "index": 0,
                "text": "".join(part["text"] for part in parts),
                "logprobs": logprobs,
                "finish_reason": finish,
                "stop_reason": None,
            }
            if ids:
                choice["token_ids"] = [t for part in parts for t in part["token_ids"]]
            # Cached encoded up to the prompt ids, which vLLM echoes (with return_token_ids).
            head = json.dumps(choice, separators=(",", ":"))[:-1]
            self._encoded[key] = [(head + ',"prompt_token_ids":' if ids else head).encode()]
        event = self._event([], self._usage(prompt, n))
        del event["choices"]
        rest = json.dumps(event, separators=(",", ":"))[1:]
        return b"".join(
            (
                b'{"choices":[',
                self._encoded[key][0],
                json.dumps(prompt, separators=(",", ":")).encode() if ids else b"",
                b"}],",
                rest.encode(),
            )
        )


class _Completion(msgspec.Struct):
    """What the backend reads of a ``POST /v1/completions`` body (other members ignored)."""

    prompt: list[int]
    stream: bool = False
    logprobs: Any = None
    max_tokens: Any = None
    return_token_ids: Any = None


_COMPLETION = msgspec.json.Decoder(_Completion)


def _image_size(url: str) -> tuple[int, int]:
    """The (width, height) of a base64 data URL's image (its header read, as vLLM loads it)."""
    import base64
    import io

    from PIL import Image

    head, _, data = url.partition(",")
    if not head.startswith("data:") or not head.endswith(";base64"):
        raise ValueError("a content part is not a base64 data URL")
    with Image.open(io.BytesIO(base64.b64decode(data))) as image:
        return image.size


def _sse(event: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


class HTTPConnection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection; requests are answered in order."""

    def __init__(self, completions: Completions, stats: Stats, pause: Pause) -> None:
        self.completions = completions
        self.config = completions.config
        self.stats = stats
        self.pause = pause
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.busy = False  # a streamed answer is under way: later requests wait in the buffer
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream transport (uvloop's too)
        self.stats.connections += 1
        self.stats.open_connections += 1

    def connection_lost(self, exc: Exception | None) -> None:
        self.stats.open_connections -= 1
        if self.busy and self.timer is not None:
            self.stats.in_flight -= 1  # a completion its client gave up on
        if self.timer is not None:
            self.timer.cancel()
        self.transport = None

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        self._next_request()

    def _next_request(self) -> None:
        while not self.busy and self.transport is not None:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buffer) > _MAX_HEADER:
                    self._respond(400, {"error": "headers too large"}, close=True)
                return
            head = bytes(self.buffer[:end]).decode("latin-1").split("\r\n")
            try:
                method, path, _ = head[0].split(" ", 2)
            except ValueError:
                self._respond(400, {"error": "bad request line"}, close=True)
                return
            headers = {}
            for line in head[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            length = int(headers.get("content-length", "0"))
            if len(self.buffer) < end + 4 + length:
                return  # the body is still coming
            body = bytes(self.buffer[end + 4 : end + 4 + length])
            del self.buffer[: end + 4 + length]
            close = headers.get("connection", "").lower() == "close"
            self._handle(method, path.split("?", 1)[0], body, close)

    def _handle(self, method: str, path: str, body: bytes, close: bool) -> None:
        if path == "/health":
            self._respond(200, {"status": "ok"}, close=close)
        elif path == "/stats":
            self._respond(200, vars(self.stats), close=close)
        elif path == "/v1/models":
            card = {"id": self.config.model, "object": "model", "owned_by": "vllm"}
            card["max_model_len"] = self.config.max_model_len
            self._respond(200, {"object": "list", "data": [card]}, close=close)
        elif path == "/v1/completions":
            if method != "POST":
                self._respond(405, {"error": "POST only"}, close=close)
                return
            self._complete(body, close)
        elif path == "/v1/chat/completions" and method == "POST":
            self._chat(body, close)
        elif path == "/inference/v1/generate" and method == "POST":
            self._generate(body, close)
        elif path == "/interrupt" and method == "POST":
            try:
                self.pause.armed = int(json.loads(body)["after_tokens"])
            except (ValueError, KeyError, TypeError) as exc:
                self._respond(400, {"error": {"message": f"after_tokens: {exc}"}}, close=close)
                return
            self._respond(200, {"armed": self.pause.armed}, close=close)
        elif path == "/paused":
            if self.pause.since is not None:
                self._respond(200, {"paused": True}, close=close)
            else:  # answered when the pause begins
                self.busy = True
                self.pause.watchers.append(lambda: self._answer_later({"paused": True}, close))
        elif path == "/resume" and method == "POST":
            self._respond(200, self.pause.resume(), close=close)
        else:
            self._respond(404, {"error": f"no route {path}"}, close=close)

    def _chat(self, body: bytes, close: bool) -> None:
        """``POST /v1/chat/completions``, not streamed (for a proxy in front of this backend,
        as LiteLLM in ``benchmarks/litellm_compare.py``): the same text after the same delay."""
        try:
            request = json.loads(body)
            if request.get("stream"):
                raise ValueError("stream is not supported on /v1/chat/completions here")
            chars = sum(len(str(m.get("content") or "")) for m in request["messages"])
            n = max(1, min(len(self.config.tokens), int(request.get("max_tokens") or 1 << 30)))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            self.stats.bad_requests += 1
            self._respond(400, {"error": {"message": str(exc)}}, close=close)
            return
        stopped = n == len(self.config.tokens)  # the last token is the stop token: no text
        content = "".join(self.config.texts[: n - 1 if stopped else n])
        answer = {
            "id": "chatcmpl-fixed",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.config.model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": content},
                    "finish_reason": "stop" if stopped else "length",
                    "logprobs": None,
                }
            ],
            "usage": {"prompt_tokens": chars, "completion_tokens": n, "total_tokens": chars + n},
        }
        self.busy = True
        delay = self.config.ttft_s + max(n - 1, 0) * self.config.itl_s
        loop = asyncio.get_running_loop()
        self.timer = loop.call_later(delay, self._send_whole, json.dumps(answer).encode(), close)

    def _generate(self, body: bytes, close: bool) -> None:
        """``POST /inference/v1/generate`` (vLLM 0.32's token-in/token-out endpoint, the
        gateway's path for prompts with images): each image placeholder expanded from its data
        URL's image size with the served model's rule (``--vision-model-dir``), as vLLM's
        processor does, echoed with ``return_token_ids``; the same tokens after the same delay.
        The image's bytes are decoded (as vLLM must) to read its size."""
        try:
            request = json.loads(body)
            vision = self.config.vision
            if vision is None:
                raise ValueError("start the backend with --vision-model-dir for image prompts")
            parts = request.get("content_parts") or []
            sizes = [_image_size(part["url"]) for part in parts]
            pad = vision.image_token_id
            prompt: list[int] = []
            ranges = []
            images = iter(sizes)
            for token in request["token_ids"]:
                if token != pad:
                    prompt.append(token)
                    continue
                length, _ = vision.placeholders(*next(images))
                ranges.append({"offset": len(prompt), "length": length})
                prompt += [pad] * length
            sampling = request.get("sampling_params") or {}
            n = self.completions.count(0, int(sampling.get("max_tokens") or 1 << 30))
            k = int(sampling.get("logprobs") or 0)
        except (ValueError, KeyError, TypeError, StopIteration) as exc:
            self.stats.bad_requests += 1
            self._respond(400, {"error": {"message": str(exc)}}, close=close)
            return
        tokens = list(self.config.tokens[:n])
        finish = "stop" if n == len(self.config.tokens) else "length"
        positions = [
            {
                "token_id": token,
                "logprob": -0.05,
                "top_logprobs": [
                    {"token_id": (token + j) % 256, "logprob": -0.05 - j, "rank": j + 1}
                    for j in range(max(k, 1))
                ],
            }
            for token in tokens
        ]
        usage = {
            "prompt_tokens": len(prompt),
            "completion_tokens": n,
            "total_tokens": len(prompt) + n,
        }
        echo = {}
        if request.get("return_token_ids"):
            echo = {"prompt_token_ids": prompt, "mm_placeholders": {"image": ranges}}
        self.busy = True
        self.stats.tokens += n
        self.stats.started()
        loop = asyncio.get_running_loop()
        if not request.get("stream"):
            choice = {
                "index": 0,
                "finish_reason": finish,
                "token_ids": tokens,
                "logprobs": {"content": positions},
            }
            answer = {"request_id": "generate-fixed", "choices": [choice], "usage": usage, **echo}
            self.timer = loop.call_later(
                self.config.ttft_s, self._send_whole, json.dumps(answer).encode(), close
            )
            return
        events = []
        for i, (token, position) in enumerate(zip(tokens, positions, strict=True)):
            last = i == n - 1
            choice = {
                "index": 0,
                "finish_reason": finish if last else None,
                "token_ids": [token],
                "logprobs": {"content": [position]},
            }
            event = {"request_id": "generate-fixed", "choices": [choice]}
            events.append(_sse({**event, **echo} if i == 0 else event))
        events.append(_sse({"request_id": "generate-fixed", "choices": [], "usage": usage}))
        events.append(b"data: [DONE]\n\n")
        assert self.transport is not None
        self.transport.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
            b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        self.timer = loop.call_later(self.config.ttft_s, self._finish, [b"".join(events)], close)

    def _complete(self, body: bytes, close: bool) -> None:
        try:
            # Typed, in C: a 100k-token prompt read with json.loads and checked id by id cost
            # ~10 ms of this process's CPU a request, which a fleet's load on 2 cores took from
            # the gateway it measures (issue 40); vLLM reads its prompt apart from the gateway.
            request = _COMPLETION.decode(body)
            prompt, stream = request.prompt, request.stream
            k = int(request.logprobs or 0)
            max_tokens = int(request.max_tokens or len(self.config.tokens))
            ids = request.return_token_ids is True
        except (ValueError, KeyError, TypeError) as exc:
            self.stats.bad_requests += 1
            self._respond(400, {"error": {"message": str(exc)}}, close=close)
            return
        self.busy = True
        serve = functools.partial(self._serve, prompt, stream, k, max_tokens, ids, close)
        if self.pause.since is not None:
            self.pause.waiting.append(serve)  # queued until /resume, as a paused vLLM does
        else:
            serve()

    def _serve(
        self, prompt: list[int], stream: bool, k: int, max_tokens: int, ids: bool, close: bool
    ) -> None:
        if self.transport is None:
            return  # the client gave up while it was queued
        start = self.pause.start_of(prompt)
        n = self.completions.count(start, max_tokens)
        # An armed abort: the first k tokens, then the pause (on_sent: once they are out).
        abort = self.pause.armed is not None and self.pause.armed < n
        on_sent = None
        if abort:
            n, self.pause.armed = max(1, self.pause.armed or 0), None
            served = self.config.tokens[start : start + n]
            on_sent = functools.partial(self.pause.begin, prompt, served)
        self.stats.tokens += n
        self.stats.started()
        if not stream:  # one JSON response after ttft + (n - 1) * itl, as vLLM answers it
            data = self.completions.whole(prompt, k, n, ids, start=start, abort=abort)
            delay = self.config.ttft_s + max(n - 1, 0) * self.config.itl_s
            loop = asyncio.get_running_loop()
            self.timer = loop.call_later(delay, self._send_whole, data, close, on_sent)
            return
        events = self.completions.events(prompt, k, n, ids, start=start, abort=abort)
        assert self.transport is not None
        self.transport.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
            b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        loop = asyncio.get_running_loop()
        if self.config.itl_s <= 0:
            payload = b"".join(events)
            self.timer = loop.call_later(
                self.config.ttft_s, self._finish, [payload], close, on_sent
            )
        else:
            last = len(events) - (4 if abort else 3)  # the last token's event
            self.timer = loop.call_later(
                self.config.ttft_s, self._stream, events, 0, last, close, on_sent
            )

    def _stream(
        self,
        events: list[bytes],
        i: int,
        last: int,
        close: bool,
        on_sent: Callable[[], None] | None,
    ) -> None:
        # Token events one by one; the abort, usage event and [DONE] leave with the last token.
        if self.transport is None:
            return
        if i < last:
            self.transport.write(_chunk(events[i]))
            loop = asyncio.get_running_loop()
            self.timer = loop.call_later(
                self.config.itl_s, self._stream, events, i + 1, last, close, on_sent
            )
        else:
            self._finish([b"".join(events[i:])], close, on_sent)

    def _finish(
        self, parts: list[bytes], close: bool, on_sent: Callable[[], None] | None = None
    ) -> None:
        self.timer = None
        if self.transport is None:
            return
        self.transport.write(b"".join(_chunk(p) for p in parts) + b"0\r\n\r\n")
        if on_sent is not None:
            on_sent()  # the abort is out: the pause begins
        self.stats.completions += 1
        self.stats.in_flight -= 1
        self.busy = False
        if close:
            self.transport.close()
            return
        if self.buffer:
            self._next_request()

    def _send_whole(
        self, data: bytes, close: bool, on_sent: Callable[[], None] | None = None
    ) -> None:
        self.timer = None
        if self.transport is None:
            return
        self.transport.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%b" % (len(data), data)
        )
        if on_sent is not None:
            on_sent()
        self.stats.completions += 1
        self.stats.in_flight -= 1
        self.busy = False
        if close:
            self.transport.close()
            return
        if self.buffer:
            self._next_request()

    def _answer_later(self, payload: object, close: bool) -> None:
        """A held request's answer (GET /paused); the connection's next requests then."""
        if self.transport is None:
            return
        self.busy = False
        self._respond(200, payload, close=close)
        if self.buffer:
            self._next_request()

    def _respond(self, status: int, payload: object, *, close: bool) -> None:
        assert self.transport is not None
        data = json.dumps(payload).encode()
        self.transport.write(
            f"HTTP/1.1 {status} {_STATUS_TEXT.get(status, 'Error')}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(data)}\r\n"
            f"{'connection: close' + chr(13) + chr(10) if close else ''}\r\n".encode()
            + data
        )
        if close:
            self.transport.close()


async def serve(config: BackendConfig, host: str, port: int, *, reuse_port: bool = False) -> None:
    loop = asyncio.get_running_loop()
    completions = Completions(config)
    stats = Stats()
    pause = Pause()
    server = await loop.create_server(
        lambda: HTTPConnection(completions, stats, pause),
        host,
        port,
        backlog=1024,
        reuse_port=reuse_port or None,
    )
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(
        f"fixed-latency backend on http://{host}:{port} ({len(config.tokens)} tokens, "
        f"ttft {config.ttft_s * 1000:g} ms, itl {config.itl_s * 1000:g} ms)",
        flush=True,
    )
    async with server:
        await stop.wait()


def _vision(model_dir: str | None) -> Any:
    if model_dir is None:
        return None
    from gateway.images.vision import VisionSpec

    return VisionSpec.load(Path(model_dir))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument(
        "--tokens",
        default=None,
        help="comma-separated completion token ids (default: the bytes of --text, then 258)",
    )
    parser.add_argument("--text", default="The answer: 42.", help="completion text (byte ids)")
    parser.add_argument("--stop-id", type=int, default=258, help="appended stop token id")
    parser.add_argument("--ttft-ms", type=float, default=20.0, help="delay of the first event")
    parser.add_argument("--itl-ms", type=float, default=0.0, help="delay between events")
    parser.add_argument("--tokens-per-event", type=int, default=1)
    parser.add_argument("--model", default="fixed-latency")
    parser.add_argument("--max-model-len", type=int, default=4096, help="in /v1/models")
    parser.add_argument(
        "--reuse-port",
        action="store_true",
        help="SO_REUSEPORT: several processes serve one port, the kernel spreads connections",
    )
    parser.add_argument("--uvloop", action="store_true", help="run on uvloop's event loop")
    parser.add_argument(
        "--vision-model-dir",
        default=None,
        help="a vision model's directory: /inference/v1/generate expands its images' "
        "placeholders with its processor's rule",
    )
    args = parser.parse_args()
    if args.tokens:
        tokens = tuple(int(t) for t in args.tokens.split(","))
        texts = tuple(chr(t) if t < 128 else "" for t in tokens)
    else:
        raw = args.text.encode()
        tokens = (*raw, args.stop_id)
        texts = (*(chr(b) if b < 128 else "" for b in raw), "<|im_end|>")
    config = BackendConfig(
        tokens=tokens,
        texts=texts,
        ttft_s=args.ttft_ms / 1000,
        itl_s=args.itl_ms / 1000,
        tokens_per_event=max(1, args.tokens_per_event),
        model=args.model,
        max_model_len=args.max_model_len,
        vision=_vision(args.vision_model_dir),
    )
    started = time.perf_counter()
    run: Any = asyncio.run
    if args.uvloop:
        import uvloop

        run = uvloop.run
    try:
        run(serve(config, args.host, args.port, reuse_port=args.reuse_port))
    finally:
        print(f"fixed-latency backend stopped after {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
