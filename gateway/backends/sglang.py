"""SGLang's native ``/generate`` as a Backend: token ids in, token ids and logprobs out.

    POST {base_url}/generate
    {"input_ids": [151644, 872, ...],
     "sampling_params": {"max_new_tokens": 256, "temperature": 1.0, "top_p": 1.0,
                         "stop_token_ids": [151645], "sampling_seed": 7},
     "return_logprob": true, "top_logprobs_num": 5, "logprob_start_len": -1, "stream": true}

    data: {"text": ..., "output_ids": [13048, 11],
           "meta_info": {"prompt_tokens": 12, "cached_tokens": 0, "finish_reason": null,
                         "output_token_logprobs": [[-0.01, 13048, null], [-0.3, 11, null]],
                         "output_top_logprobs": [[[-0.01, 13048, null], [-4.6, 9707, null]], ...]}}
    ...
    data: {..., "meta_info": {..., "finish_reason": {"type": "stop", "matched": 151645}}}
    data: [DONE]

By default SGLang streams *cumulative* ``output_ids`` and logprob lists (everything generated
so far in every event); with the server flag ``--incremental-streaming-output`` it streams only
the new ones: pass ``incremental_streaming=True`` to match. Either way each GenerationChunk holds
only the new tokens. ``logprob_start_len: -1`` asks for logprobs of the output only, not of
the prompt. ``sampling_seed`` is omitted when no seed is given, and sent as its low 31 bits:
SGLang builds an int32 tensor of it (only honoured with ``--enable-deterministic-inference``),
and the gateway's derived seeds are 63-bit; a regeneration sends the same bits. A numeric
``meta_info.weight_version`` (set by SGLang's ``update_weights_*`` endpoints) is passed on as the
chunk's ``weight_version``.

What SGLang's log-probs are depends on its version and environment; its ``Sampler.forward``
(python/sglang/srt/layers/sampler.py) computes them, after penalties, logit bias and grammar masks:

- a batch of greedy requests only: ``log_softmax(logits)``, the raw distribution (greedy's, as
  the protocol defines it);
- otherwise ``logits.div_(temperatures); softmax`` and the log of that: temperature applied.
  Top-p was applied too from sgl-project/sglang#2664 (Dec 2024: "the real logprob we sample
  from"; ``log(top_p_normalize_probs_torch(probs, top_ps))``, about lines 85-93 and 123-127 of
  sampler.py at commit 584f55d1) until #5961 (May 2025: "return logprobs independent of
  top-p", as OpenAI's API does); since then top-p, top-k and min-p truncation happen after the
  log-probs are taken;
- with the environment variable SGLANG_RETURN_ORIGINAL_LOGPROB set (#8375, July 2025):
  ``log_softmax(logits)`` before temperature, i.e. raw, whatever the sampling.

So a current SGLang records the sampled distribution at any temperature with top_p 1, and
neither it nor any other setting records a top_p below 1 truthfully. The gateway probes each
replica as it does vLLM's (``gateway.backends.probe``: "tempered", "processed" or "raw") and
refuses what it would record wrongly (400), unless ``--allow-raw-logprobs`` marks it "raw".

A prompt with images is refused (``InvalidRequest``, 400, naming SGLang): SGLang's image path
(``image_data`` beside the ids) runs its own processor over the prompt, and with no SGLang here
to check it against, the gateway cannot hold that it reads the gateway's expanded ids token for
token: image turns through it would not be token-exact. Serve image turns with vLLM
(``gateway.backends.vllm_generate``) or the local backend.

Written against SGLang 0.4.x/0.5.x; it cannot run here (no GPU): tests/unit/
test_remote_backends.py checks the translation against payloads shaped as SGLang produces them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Unpack

import msgspec

from gateway.backends.interface import (
    FinishReason,
    GenerationChunk,
    Prompt,
    SamplingParams,
    TopLogprob,
)
from gateway.backends.payload import as_float, as_int, as_int_list, as_list, member
from gateway.backends.probe import LogprobsKind
from gateway.backends.remote import RemoteBackend, RemoteOptions, decode_event, merge_chunks
from gateway.errors import BackendError, InvalidRequest
from schemas.sampling import is_greedy

__all__ = ["SGLangBackend", "SGLangStreamReader", "generate_request"]

# {"type": "abort"}: SGLang ended the request unfinished (/pause_generation, /abort_request):
# the tokens so far are read, and the gateway continues the turn.
_FINISH_REASONS: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}
_ADVICE: dict[LogprobsKind, str] = {
    "raw": "Start SGLang without SGLANG_RETURN_ORIGINAL_LOGPROB in its environment (it makes "
    "the log-probs those before temperature)",
    # sgl-project/sglang#5961: log-probs are taken before top-p/top-k/min-p truncation.
    "tempered": "SGLang returns log-probs before top-p truncation, whatever its flags: sample "
    "with top_p 1 on SGLang",
    "processed": "",
    "unknown": "Check the SGLang server's version and SGLANG_RETURN_ORIGINAL_LOGPROB",
}


class SGLangBackend(RemoteBackend):
    def __init__(
        self,
        base_url: str,
        *,
        incremental_streaming: bool = False,
        **options: Unpack[RemoteOptions],
    ) -> None:
        super().__init__(f"{base_url.rstrip('/')}/generate", "SGLang", _ADVICE, **options)
        self._incremental = incremental_streaming

    def generate(
        self, prompt: Prompt, params: SamplingParams, *, session: str | None = None
    ) -> AsyncIterator[GenerationChunk]:
        if prompt.images:
            raise InvalidRequest(
                f"the SGLang backend ({self.id}) takes no images: SGLang expands a prompt's "
                "image placeholders itself and the gateway cannot check them token for token; "
                "send text only, or serve this model with vLLM or the local backend",
                param="messages",
            )
        return super().generate(prompt, params, session=session)

    def _request(self, prompt: Prompt, params: SamplingParams) -> dict[str, Any]:
        return generate_request(prompt, params)

    def _reader(self, prompt: Prompt, params: SamplingParams) -> SGLangStreamReader:
        return SGLangStreamReader(
            prompt_len=len(prompt),
            top_logprobs=params.top_logprobs,
            incremental=self._incremental,
            url=self._url,
        )


def generate_request(prompt: Prompt, params: SamplingParams) -> dict[str, Any]:
    """The JSON body of one /generate request, streamed unless ``params.stream`` is False
    (the ids as their JSON text, as for vLLM: ``gateway.backends.vllm.completion_request``)."""
    # Greedy as vLLM and the gateway have it (below 1e-5) is greedy on SGLang only below 1e-6:
    # sent as 0, so that SGLang takes the argmax and returns the raw log-probs the record claims.
    greedy = is_greedy(params.temperature)
    sampling: dict[str, Any] = {
        "max_new_tokens": params.max_tokens,
        "temperature": 0.0 if greedy else params.temperature,
        "top_p": 1.0 if greedy else params.top_p,
        "stop_token_ids": list(params.stop_token_ids),
    }
    if params.seed is not None:
        sampling["sampling_seed"] = params.seed & 0x7FFF_FFFF  # int32 on the server
    return {
        "input_ids": msgspec.Raw(prompt.json()),
        "sampling_params": sampling,
        "return_logprob": True,
        "top_logprobs_num": params.top_logprobs,
        "logprob_start_len": -1,
        "stream": params.stream,
    }


class SGLangStreamReader:
    """Turns the events of one stream (or its one non-streamed response) into chunks of new
    tokens, each passed on as it is read; remembers how many were seen."""

    def __init__(self, *, prompt_len: int, top_logprobs: int, incremental: bool, url: str):
        self._prompt_len = prompt_len
        self._top_logprobs = top_logprobs
        self._incremental = incremental
        self._url = url
        self._where = f"SGLang at {url}"
        self._emitted: list[int] = []  # output tokens already passed on
        self.finished = False

    def read_whole(self, payload: bytes) -> GenerationChunk | None:
        return self.read(decode_event(payload, self._url, "SGLang"))

    def read_batch(self, payloads: list[bytes]) -> GenerationChunk | None:
        """The events of one network read as one chunk (``remote.merge_chunks``)."""
        url = self._url
        read = [
            chunk
            for payload in payloads
            if (chunk := self.read(decode_event(payload, url, "SGLang"))) is not None
        ]
        return merge_chunks(read) if read else None

    def last(self) -> None:
        """Nothing held back: every chunk went out as it was read."""

    def read(self, event: dict[str, Any]) -> GenerationChunk | None:
        """One event (or the response), decoded; None when it holds no new token and no finish."""
        where = self._where
        if self.finished:
            raise BackendError(f"{where} sent an event after finish_reason")
        meta = member(event, "meta_info", where)
        triples = _triples(member(meta, "output_token_logprobs", where), where)
        token_ids = _output_ids(event, triples, where)
        if len(triples) != len(token_ids):
            raise BackendError(f"{where} sent {len(token_ids)} ids and {len(triples)} logprobs")
        start = 0 if self._incremental else len(self._emitted)
        new_ids = token_ids[start:]
        new_triples = triples[start:]
        completion_tokens = member(meta, "completion_tokens", where)
        if completion_tokens is not None:
            completion_tokens = as_int(completion_tokens, "completion_tokens", where)
        total = len(self._emitted) + len(new_ids)
        # Both checks catch a stream read in the wrong mode before it loses or repeats tokens.
        if (not self._incremental and token_ids[:start] != self._emitted) or (
            completion_tokens is not None and completion_tokens != total
        ):
            mode = "incremental" if self._incremental else "cumulative"
            raise BackendError(
                f"{where} sent output ids {token_ids[:8]}... (completion_tokens "
                f"{completion_tokens}) after {len(self._emitted)} tokens, which does not fit "
                f"{mode} streaming: does --incremental-streaming-output match the backend's "
                "incremental_streaming setting?"
            )
        if [token_id for _, token_id in new_triples] != new_ids:
            raise BackendError(f"{where}: output_token_logprobs do not match output_ids")
        top = self._top(member(meta, "output_top_logprobs", where), start, len(token_ids))
        finish_reason = _finish_reason(member(meta, "finish_reason", where), where)
        self._emitted.extend(new_ids)
        self.finished = finish_reason is not None
        if not new_ids and finish_reason is None:
            return None
        return GenerationChunk(
            token_ids=new_ids,
            logprobs=[logprob for logprob, _ in new_triples],
            top_logprobs=top,
            finish_reason=finish_reason,
            weight_version=_weight_version(member(meta, "weight_version", where)),
            extra=self._extra(meta) if finish_reason is not None else {},
        )

    def _top(self, value: Any, start: int, count: int) -> list[list[TopLogprob]] | None:
        if self._top_logprobs <= 0:
            return None
        positions = as_list(value or [], "output_top_logprobs", self._where)
        if len(positions) != count:
            raise BackendError(
                f"{self._where} sent {len(positions)} output_top_logprobs for {count} tokens"
            )
        top = []
        for position in positions[start:]:
            ranked = _triples(position, self._where)[: self._top_logprobs]
            top.append([TopLogprob(token_id, logprob) for logprob, token_id in ranked])
        return top

    def _extra(self, meta: Any) -> dict[str, float]:
        where = self._where
        extra: dict[str, float] = {}
        prompt_tokens = member(meta, "prompt_tokens", where)
        if prompt_tokens is not None:
            if as_int(prompt_tokens, "prompt_tokens", where) != self._prompt_len:
                raise BackendError(
                    f"{where} counted {prompt_tokens} prompt tokens, {self._prompt_len} sent"
                )
            extra["prompt_tokens"] = float(prompt_tokens)
        extra["completion_tokens"] = float(len(self._emitted))
        cached = member(meta, "cached_tokens", where)
        if cached is not None:
            extra["cached_prompt_tokens"] = float(as_int(cached, "cached_tokens", where))
        return extra


def _output_ids(event: dict[str, Any], triples: list[tuple[float, int]], where: str) -> list[int]:
    for key in ("output_ids", "token_ids"):
        value = event.get(key)
        if value is not None:
            return as_int_list(value, key, where)
    # Older servers send no ids when a tokenizer is loaded; the logprob triples carry them.
    return [token_id for _, token_id in triples]


def _triples(value: Any, where: str) -> list[tuple[float, int]]:
    """SGLang's ``[logprob, token_id, text_or_null]`` entries as (logprob, token_id)."""
    if value is None:
        return []
    entries = []
    for entry in as_list(value, "logprob list", where):
        items = as_list(entry, "logprob entry", where)
        if len(items) < 2:
            raise BackendError(f"{where}: a logprob entry should be [logprob, token_id, text]")
        entries.append(
            (as_float(items[0], "logprob", where), as_int(items[1], "logprob token id", where))
        )
    return entries


def _finish_reason(value: Any, where: str) -> FinishReason | None:
    if value is None:
        return None
    kind = member(value, "type", where) if isinstance(value, dict) else value
    reason = _FINISH_REASONS.get(kind) if isinstance(kind, str) else None
    if reason is None:
        raise BackendError(f"{where} ended the generation with finish_reason {value!r:.300}")
    return reason


def _weight_version(value: Any) -> int | None:
    # SGLang reports it as a string ("default" until weights are first updated).
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return None
