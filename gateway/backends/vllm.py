"""vLLM's OpenAI-compatible server as a Backend: token ids in, token ids and logprobs out.

Targets vLLM >= 0.10.2, whose ``/v1/completions`` accepts ``return_token_ids`` (each streamed
choice then carries the delta ``token_ids``, and the first one the ``prompt_token_ids``):

    POST {base_url}/v1/completions
    {"model": ..., "prompt": [151644, 872, ...],      # token ids: vLLM does not tokenize them
     "max_tokens": 256, "temperature": 1.0, "top_p": 1.0, "seed": 7, "stop_token_ids": [151645],
     "logprobs": 5, "return_token_ids": true, "return_tokens_as_token_ids": true,
     "skip_special_tokens": false, "include_stop_str_in_output": true,
     "stream": true, "stream_options": {"include_usage": true}}

    data: {"choices": [{"index": 0, "text": "Hi", "token_ids": [13048],
           "logprobs": {"tokens": ["token_id:13048"], "token_logprobs": [-0.01],
                        "top_logprobs": [{"token_id:13048": -0.01, "token_id:9707": -4.6}],
                        "text_offset": [0]},
           "finish_reason": null}], "usage": null}
    ...
    data: {"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 9, ...}}
    data: [DONE]

``return_tokens_as_token_ids`` makes the logprob keys ``"token_id:<id>"``: top-logprob
alternatives are identified by id, not by decoded text (which is ambiguous for partial UTF-8),
and gives the sampled ids on servers that predate ``return_token_ids``. ``logprobs: k`` returns
the sampled token's logprob plus up to k alternatives (vLLM may add the sampled token as a k+1-th
entry; the k most likely are kept).

Server flags: ``--logprobs-mode processed_logprobs`` (vLLM >= 0.10.2) makes the logprobs those of
the distribution actually sampled from (after temperature, and top-p when < 1), as the Backend
protocol promises; vLLM's default (raw_logprobs) reports the model's raw distribution whatever
the sampling. The gateway cannot choose the mode per request, so it probes each replica
(``gateway.backends.probe``) and refuses a temperature other than 1 or a top_p below 1 on a
raw-mode replica (400), unless ``--allow-raw-logprobs`` marks such turns "raw".
``--max-logprobs`` must be at least the largest ``top_logprobs`` an agent asks for (and 1, for
the probe).

tests/unit/test_remote_backends.py checks this translation against payloads shaped as vLLM
documents them; tests/deploy/test_vllm.py runs it against a real vLLM 0.32 (its CPU build), two
replicas, streamed and not, with log-probs checked against the reference trainer's.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import Any

import httpx

from gateway.backends.base import (
    FinishReason,
    GenerationChunk,
    SamplingParams,
    TopLogprob,
    needs_processed_logprobs,
)
from gateway.backends.payload import as_float, as_int, as_int_list, as_list, member
from gateway.backends.probe import PROBE_PROMPT, GuardedLogprobs, LogprobsGuard, LogprobsKind
from gateway.backends.sse import RemoteBackend
from gateway.errors import BackendError

__all__ = ["StreamEvent", "VLLMBackend", "completion_request", "parse_stream_event"]

_TOKEN_ID_PREFIX = "token_id:"
_FINISH_REASONS: dict[str, FinishReason] = {"stop": "stop", "length": "length"}
_PROCESSED = "Start vLLM with --logprobs-mode processed_logprobs (vLLM >= 0.10.2)"
_ADVICE: dict[LogprobsKind, str] = {
    "raw": "Its --logprobs-mode is the default, raw_logprobs: start it with --logprobs-mode "
    "processed_logprobs (vLLM >= 0.10.2)",
    "tempered": _PROCESSED,
    "processed": _PROCESSED,
    "unknown": _PROCESSED,
}


class VLLMBackend(GuardedLogprobs, RemoteBackend):
    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        backend_id: str,
        max_context: int,
        client: httpx.AsyncClient | None = None,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 5.0,
        logprobs_kind: LogprobsKind | None = None,
        probe_prompt: Sequence[int] = PROBE_PROMPT,
    ) -> None:
        """``logprobs_kind``: known already (not probed); ``probe_prompt``: token ids of the
        log-prob probe (``gateway.backends.probe``), valid for the served model."""
        # Accept the base URL with or without the /v1 an OpenAI client would be given.
        root = base_url.rstrip("/").removesuffix("/v1")
        super().__init__(
            f"{root}/v1/completions",
            "vLLM",
            backend_id=backend_id,
            max_context=max_context,
            client=client,
            timeout_s=timeout_s,
            connect_timeout_s=connect_timeout_s,
        )
        self._model = model
        self._logprobs = LogprobsGuard(
            replica=backend_id,
            where=self._where,
            sample=lambda prompt, params: self._stream(prompt, params, checked=False),
            advice=_ADVICE,
            prompt=probe_prompt,
            kind=logprobs_kind,
        )

    def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, session: str | None = None
    ) -> AsyncIterator[GenerationChunk]:
        return self._stream(prompt_ids, params, checked=True)

    async def _stream(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, checked: bool
    ) -> AsyncGenerator[GenerationChunk, None]:
        # Checked before anything is sent: a refusal (InvalidRequest) or the "raw" mark.
        mark = None
        if checked and needs_processed_logprobs(params):
            mark = await self._logprobs.admit(params)
        sent = list(prompt_ids)
        body = completion_request(self._model, sent, params)
        stream = self._events(body)
        finished: GenerationChunk | None = None
        usage: dict[str, float] = {}
        try:
            async with aclosing(stream) as events:
                async for raw in events:
                    event = parse_stream_event(
                        raw, top_logprobs=params.top_logprobs, where=self._where
                    )
                    if event.prompt_token_ids is not None and event.prompt_token_ids != sent:
                        raise BackendError(
                            f"{self._where} generated from a different prompt than sent"
                        )
                    usage.update(event.usage)
                    chunk = event.chunk
                    if chunk is None:
                        continue
                    if finished is not None:
                        raise BackendError(f"{self._where} sent tokens after finish_reason")
                    if mark is not None:
                        chunk = replace(chunk, logprobs_kind=mark)
                    if chunk.finish_reason is None:
                        yield chunk
                    else:
                        # Held until the usage event that follows it, so the last chunk has it.
                        finished = chunk
        except BackendError:
            self._logprobs.forget()  # restarted, maybe with another --logprobs-mode
            raise
        if finished is None:
            raise BackendError(f"{self._where}: the stream ended without a finish_reason")
        prompt_tokens = usage.get("prompt_tokens")
        if prompt_tokens is not None and prompt_tokens != len(sent):
            raise BackendError(
                f"{self._where} counted {prompt_tokens:.0f} prompt tokens, {len(sent)} sent"
            )
        yield replace(finished, extra={**finished.extra, **usage})


def completion_request(
    model: str, prompt_ids: Sequence[int], params: SamplingParams
) -> dict[str, Any]:
    """The JSON body of one streamed /v1/completions request."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(prompt_ids),
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "stop_token_ids": list(params.stop_token_ids),
        # Always ask: logprobs are recorded for every sampled token (0 = the sampled one only).
        "logprobs": params.top_logprobs,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "skip_special_tokens": False,
        "include_stop_str_in_output": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if params.seed is not None:
        body["seed"] = params.seed
    return body


@dataclass(frozen=True)
class StreamEvent:
    chunk: GenerationChunk | None  # None: nothing generated in this event (e.g. usage only)
    prompt_token_ids: list[Any] | None = None  # echoed in the first event
    usage: dict[str, float] = field(default_factory=dict)


def parse_stream_event(event: dict[str, Any], *, top_logprobs: int, where: str) -> StreamEvent:
    """One ``data:`` object of the stream as a GenerationChunk (pure)."""
    usage = _usage(member(event, "usage", where), where)
    choices = as_list(member(event, "choices", where) or [], "choices", where)
    if not choices:
        return StreamEvent(None, None, usage)
    if len(choices) != 1:
        raise BackendError(f"{where} sent {len(choices)} choices; the gateway asks for one")
    choice = choices[0]
    prompt_ids = member(choice, "prompt_token_ids", where)
    logprobs = member(choice, "logprobs", where)
    token_ids = _token_ids(choice, logprobs, where)
    finish_reason = _finish_reason(member(choice, "finish_reason", where), where)
    if not token_ids:
        chunk = GenerationChunk([], [], [] if top_logprobs else None, finish_reason)
    else:
        sampled, top = _logprobs(logprobs, len(token_ids), top_logprobs, where)
        chunk = GenerationChunk(token_ids, sampled, top, finish_reason)
    return StreamEvent(
        chunk if token_ids or finish_reason else None,
        # Only compared with the ids sent: list equality checks every element, cheaper than
        # validating each one first (this was ~10% of the gateway's CPU per request).
        None if prompt_ids is None else as_list(prompt_ids, "prompt_token_ids", where),
        usage,
    )


def _token_ids(choice: Any, logprobs: Any, where: str) -> list[int]:
    token_ids = member(choice, "token_ids", where)
    if token_ids is not None:
        return as_int_list(token_ids, "token_ids", where)
    if logprobs is not None:  # a server without return_token_ids: ids from the logprob keys
        tokens = as_list(member(logprobs, "tokens", where), "logprobs.tokens", where)
        return [_token_id(token, where) for token in tokens]
    if member(choice, "text", where):
        raise BackendError(
            f"{where} returned text without token ids; vLLM >= 0.10.2 is needed (return_token_ids)"
        )
    return []


def _logprobs(
    logprobs: Any, count: int, top_logprobs: int, where: str
) -> tuple[list[float], list[list[TopLogprob]] | None]:
    if logprobs is None:
        raise BackendError(f"{where} returned tokens without the logprobs asked for")
    values = as_list(member(logprobs, "token_logprobs", where), "token_logprobs", where)
    if len(values) != count:
        raise BackendError(f"{where} sent {len(values)} logprobs for {count} tokens")
    sampled = [as_float(value, "token_logprobs", where) for value in values]
    if top_logprobs <= 0:
        return sampled, None
    positions = as_list(member(logprobs, "top_logprobs", where), "top_logprobs", where)
    if len(positions) != count:
        raise BackendError(f"{where} sent {len(positions)} top_logprobs for {count} tokens")
    top: list[list[TopLogprob]] = []
    for position in positions:
        if not isinstance(position, dict):
            raise BackendError(f"{where}: a top_logprobs entry should be an object")
        ranked = sorted(
            (
                TopLogprob(_token_id(key, where), as_float(value, "top_logprobs", where))
                for key, value in position.items()
            ),
            key=lambda alternative: -alternative.logprob,
        )
        top.append(ranked[:top_logprobs])
    return sampled, top


def _token_id(token: Any, where: str) -> int:
    if not isinstance(token, str) or not token.startswith(_TOKEN_ID_PREFIX):
        raise BackendError(
            f"{where} sent logprob token {token!r:.50}, not 'token_id:<id>'; "
            "is return_tokens_as_token_ids supported by this vLLM?"
        )
    try:
        return int(token[len(_TOKEN_ID_PREFIX) :])
    except ValueError:
        raise BackendError(f"{where} sent a malformed logprob token {token!r:.50}") from None


def _finish_reason(value: Any, where: str) -> FinishReason | None:
    if value is None:
        return None
    reason = _FINISH_REASONS.get(value) if isinstance(value, str) else None
    if reason is None:
        # "abort": vLLM dropped the request (shutdown, preemption limit); nothing to record.
        raise BackendError(f"{where} ended the generation with finish_reason {value!r}")
    return reason


def _usage(value: Any, where: str) -> dict[str, float]:
    if value is None:
        return {}
    usage = {
        "prompt_tokens": float(as_int(member(value, "prompt_tokens", where), "usage", where)),
        "completion_tokens": float(
            as_int(member(value, "completion_tokens", where), "usage", where)
        ),
    }
    details = member(value, "prompt_tokens_details", where)
    cached = None if details is None else member(details, "cached_tokens", where)
    if cached is not None:  # only with --enable-prompt-tokens-details
        usage["cached_prompt_tokens"] = float(as_int(cached, "cached_tokens", where))
    return usage
