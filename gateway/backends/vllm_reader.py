"""Reading vLLM's ``/v1/completions`` JSON into GenerationChunks (``gateway.backends.vllm``
builds the request): the sampled ids from the logprobs' ``"token_id:<id>"`` keys (or from
``token_ids`` when a server sends them), their logprobs and alternatives, the finish reason, the
usage; a prompt echo checked against the ids sent (as bytes, then as ids).

A non-streamed response is one chunk. Streamed, the events of one network read are passed on as
one chunk (``gateway.backends.remote.merge_chunks``), and the one with the finish reason is held
until the usage event after it. Either way the JSON is decoded straight into typed structs
(msgspec), the ids of several events in one pass; a read's plain events (the tokens in the middle
of a generation, nearly all of them) are checked by the decoder and read in bulk, without a
Python step per event.

tests/unit/test_remote_backends.py checks this reading against payloads shaped as vLLM documents
them.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import msgspec

from gateway.backends.interface import FinishReason, GenerationChunk, Prompt, TopLogprob
from gateway.backends.remote import decode_event
from gateway.errors import BackendError
from gateway.frozen import evolved

__all__ = ["CompletionReader", "read_finish_reason"]

_TOKEN_ID_PREFIX = "token_id:"
# "abort": vLLM ended the request unfinished (paused for a weight update with /pause?mode=abort,
# /abort_requests): the tokens so far are read, and the gateway continues the turn.
_FINISH_REASONS: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


# What the gateway reads of vLLM's JSON, typed, so that msgspec decodes it straight into these
# (checking every type as it goes) and skips all else: "text", "text_offset", a prompt echo's
# ids (kept as raw JSON, compared as bytes), ids and usage fields the gateway does not use.
# gc=False: none of these is ever in a reference cycle, and a streamed batch decodes hundreds,
# which would otherwise set off the cyclic collector every few hundred events.
class _Logprobs(msgspec.Struct, gc=False):
    # Raw JSON, read only when used: the sampled ids in bulk (_token_ids), the alternatives
    # only when asked for (vLLM sends one per token even for logprobs 0).
    tokens: msgspec.Raw = msgspec.Raw()
    token_logprobs: list[float] | None = None
    top_logprobs: msgspec.Raw = msgspec.Raw()


class _Choice(msgspec.Struct, gc=False):
    token_ids: list[int] | None = None
    prompt_token_ids: msgspec.Raw = msgspec.Raw()  # absent: b""; null: b"null"
    logprobs: _Logprobs | None = None
    finish_reason: str | None = None
    text: str | None = None


class _Details(msgspec.Struct, gc=False):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct, gc=False):
    prompt_tokens: int
    completion_tokens: int
    prompt_tokens_details: _Details | None = None


class _Completion(msgspec.Struct, gc=False):
    """A streamed event or the whole non-streamed response: the same fields."""

    choices: list[_Choice] | None = None
    usage: _Usage | None = None
    error: Any = None


# A streamed event in the middle of a generation, as vLLM writes nearly all of them: one choice
# with sampled tokens and their logprobs, no finish, usage, error, ids or prompt echo. A batch
# of these decodes only if every event is one (msgspec checks it in C), and is then read without
# a Python step per event beyond collecting its fields; any other batch is read event by event.
class _PlainLogprobs(msgspec.Struct, gc=False):
    tokens: msgspec.Raw
    token_logprobs: tuple[float, ...]  # a tuple: lists are tracked by the cyclic collector
    top_logprobs: msgspec.Raw = msgspec.Raw()


class _PlainChoice(msgspec.Struct, gc=False):
    logprobs: _PlainLogprobs
    finish_reason: None = None
    token_ids: None = None
    prompt_token_ids: None = None


class _PlainEvent(msgspec.Struct, gc=False):
    choices: tuple[_PlainChoice]
    usage: None = None
    error: None = None


_PLAIN_BATCH = msgspec.json.Decoder(list[_PlainEvent])
# In every event but the last ones of a stream (the finish, the usage), compact as vLLM writes
# it or spaced: where a read's plain events end. Only a marker: the decoder decides.
_UNFINISHED = (b'"finish_reason":null', b'"finish_reason": null')
_DECODER = msgspec.json.Decoder(_Completion)
_INT_LIST = msgspec.json.Decoder(list[int])
_STR_LIST = msgspec.json.Decoder(list[str])
_BATCH = msgspec.json.Decoder(list[_Completion])
_NO_ARRAY = (b"", b"null")  # a Raw field absent, or null


def _given(raw: msgspec.Raw, *, empty: bytes = b"null") -> bool:
    """A Raw field present, neither null nor ``empty`` (a Raw never equals bytes: compare a
    copy, made only of short values)."""
    return not (len(raw) <= 4 and bytes(raw) in (b"", b"null", empty))


_TOP = msgspec.json.Decoder(list[dict[str, float]])
_QUOTED_PREFIX = b'"' + _TOKEN_ID_PREFIX.encode()


class _Tokens(NamedTuple):
    """The tokens of a chunk's events as they are read: ids (a list) or the raw JSON arrays of
    their "token_id:<id>" keys, their logprobs, the raw JSON of their alternatives."""

    parts: list[list[int] | bytes]
    logprobs: list[float]
    tops: list[bytes]


class CompletionReader:
    """Reads the events of one streamed completion, or its one non-streamed response, into
    GenerationChunks; collects the usage; checks a prompt echo against the ids sent."""

    def __init__(self, prompt: Prompt, *, top_logprobs: int, url: str) -> None:
        self._prompt = prompt
        self._top_logprobs = top_logprobs
        self._url = url
        self._where = f"vLLM at {url}"
        self.usage: dict[str, float] = {}
        self.finished = False  # a finish_reason was read
        self._held: GenerationChunk | None = None  # the chunk with it

    def read_whole(self, payload: bytes) -> None:
        """The non-streamed response: its one chunk is the last, held for ``last``."""
        self._held = self._chunk([self._decode(payload)])

    def read_batch(self, payloads: list[bytes]) -> GenerationChunk | None:
        """The events of one network read as one chunk (``remote.merge_chunks`` says why);
        None when they hold no tokens and no finish. The chunk with the finish reason is held
        until the usage event that follows it, so that the last chunk has it (``last``)."""
        if len(payloads) == 1:
            chunk = self._chunk([self._decode(payloads[0])])
        else:
            chunk = self._bulk(payloads)
        if chunk is not None and chunk.finish_reason is not None:
            self._held = chunk
            return None
        return chunk

    def last(self) -> GenerationChunk | None:
        """The chunk with the finish reason, with the usage; checks the prompt tokens counted."""
        finished = self._held
        if finished is None:
            return None
        usage = self.usage
        prompt_tokens = usage.get("prompt_tokens")
        if prompt_tokens is not None and prompt_tokens != len(self._prompt):
            raise BackendError(
                f"{self._where} counted {prompt_tokens:.0f} prompt tokens, {len(self._prompt)} sent"
            )
        return evolved(finished, extra={**finished.extra, **usage})

    def _bulk(self, payloads: list[bytes]) -> GenerationChunk | None:
        """Several events as one chunk: the plain token events before the stream's last ones
        decoded and read in bulk, the rest (or all, if any of them is not plain) in one call,
        their ids and alternatives in bulk."""
        end = len(payloads)
        while end and not any(mark in payloads[end - 1] for mark in _UNFINISHED):
            end -= 1
        head = self._plain(payloads[:end]) if end > 1 else None
        rest = payloads if head is None else payloads[end:]
        events: list[_Completion] = []
        if rest:
            try:
                events = _BATCH.decode(b"[" + b",".join(rest) + b"]")
            except msgspec.DecodeError:
                events = []
            if len(events) != len(rest) or any(event.error is not None for event in events):
                events = [self._decode(payload) for payload in rest]  # names the bad one
        return self._chunk(events, head)

    def _plain(self, payloads: list[bytes]) -> _Tokens | None:
        """The tokens of events that are all plain (``_PlainEvent``), each with tokens; None
        when any is not, to be read event by event."""
        try:
            events = _PLAIN_BATCH.decode(b"[" + b",".join(payloads) + b"]")
        except msgspec.DecodeError:
            return None
        found = [event.choices[0].logprobs for event in events]
        tokens = [bytes(lp.tokens) for lp in found]
        if b"[]" in tokens or b"null" in tokens:
            return None  # an event without tokens: the event-by-event reading decides
        if self.finished:
            raise BackendError(f"{self._where} sent tokens after finish_reason")
        return _Tokens(
            [b"[" + b",".join([array[1:-1] for array in tokens]) + b"]"],
            [logprob for lp in found for logprob in lp.token_logprobs],
            [bytes(lp.top_logprobs) for lp in found] if self._top_logprobs > 0 else [],
        )

    def _decode(self, payload: bytes) -> _Completion:
        try:
            event = _DECODER.decode(payload)
        except msgspec.DecodeError as exc:
            # An {"error": ...} object of another shape, NaN, not JSON at all: the generic
            # reading says which (a BackendError), or else this type error is the message.
            decode_event(payload, self._url, "vLLM")
            raise BackendError(f"{self._where} sent an unexpected event: {exc}") from None
        if event.error is not None:
            decode_event(payload, self._url, "vLLM")  # raises, naming the error
        return event

    def _chunk(
        self, events: list[_Completion], head: _Tokens | None = None
    ) -> GenerationChunk | None:
        """The tokens of ``head`` (events already read) and of ``events``, as one chunk."""
        where = self._where
        parts, logprobs, tops = head or _Tokens([], [], [])
        finish: FinishReason | None = None
        for event in events:
            if event.usage is not None:
                self.usage = _usage(event.usage)
            choices = event.choices
            if not choices:
                continue
            if len(choices) != 1:
                raise BackendError(f"{where} sent {len(choices)} choices; the gateway asks for one")
            choice = choices[0]
            echo = choice.prompt_token_ids
            if _given(echo) and not self._same_prompt(echo):
                raise BackendError(f"{where} generated from a different prompt than sent")
            reason = read_finish_reason(choice.finish_reason, where)
            lp = choice.logprobs
            part: list[int] | bytes = []
            if choice.token_ids:
                part = choice.token_ids
            elif lp is not None and _given(lp.tokens, empty=b"[]"):
                part = bytes(lp.tokens)
            elif choice.token_ids is None and choice.text:
                raise BackendError(
                    f"{where} returned text without token ids; vLLM >= 0.10.2 is needed "
                    "(return_tokens_as_token_ids and logprobs)"
                )
            if not part and reason is None:
                continue
            if self.finished:
                raise BackendError(f"{where} sent tokens after finish_reason")
            if reason is not None:
                self.finished, finish = True, reason
            if not part:
                continue
            if lp is None or lp.token_logprobs is None:
                raise BackendError(f"{where} returned tokens without the logprobs asked for")
            parts.append(part)
            logprobs += lp.token_logprobs
            if self._top_logprobs > 0:
                tops.append(bytes(lp.top_logprobs))
        if not parts:
            if finish is None:
                return None
            return GenerationChunk([], [], [] if self._top_logprobs else None, finish)
        token_ids = _ids(parts, where)
        if len(logprobs) != len(token_ids):
            raise BackendError(f"{where} sent {len(logprobs)} logprobs for {len(token_ids)} tokens")
        top = _alternatives(tops, len(token_ids), self._top_logprobs, where)
        return GenerationChunk(token_ids, logprobs, top, finish)

    def _same_prompt(self, echo: msgspec.Raw) -> bool:
        # As bytes first (vLLM writes compact JSON, as the gateway does), else as ids.
        if memoryview(echo) == memoryview(self._prompt.json()):
            return True
        try:
            return self._prompt.same_ids(_INT_LIST.decode(echo))
        except msgspec.DecodeError:
            raise BackendError(f"{self._where}: prompt_token_ids should be a list of ids") from None


def _ids(parts: list[list[int] | bytes], where: str) -> list[int]:
    """The sampled ids of a chunk's events: given as ids, or as "token_id:<id>" keys (the raw
    JSON arrays of several events joined and read in one pass)."""
    arrays = [part for part in parts if isinstance(part, bytes)]
    if len(arrays) == len(parts):
        if len(arrays) == 1:
            return _logprob_token_ids(arrays[0], where)
        return _logprob_token_ids(b"[" + b",".join(a[1:-1] for a in arrays) + b"]", where)
    ids: list[int] = []
    for part in parts:
        ids += _logprob_token_ids(part, where) if isinstance(part, bytes) else part
    return ids


def _alternatives(
    tops: list[bytes], count: int, top_logprobs: int, where: str
) -> list[list[TopLogprob]] | None:
    """The ``top_logprobs`` most likely alternatives at each of ``count`` positions, best
    first, from the events' raw ``top_logprobs`` arrays."""
    if top_logprobs <= 0:
        return None
    if any(top in _NO_ARRAY for top in tops):
        raise BackendError(f"{where} sent no top_logprobs for {count} tokens")
    joined = tops[0] if len(tops) == 1 else b"[" + b",".join(t[1:-1] for t in tops) + b"]"
    try:
        positions = _TOP.decode(joined)
    except msgspec.DecodeError as exc:
        raise BackendError(f"{where}: top_logprobs should be a list of objects ({exc})") from None
    if len(positions) != count:
        raise BackendError(f"{where} sent {len(positions)} top_logprobs for {count} tokens")
    top: list[list[TopLogprob]] = []
    for position in positions:
        ranked = sorted(
            (TopLogprob(_token_id(key, where), value) for key, value in position.items()),
            key=lambda alternative: -alternative.logprob,
        )
        top.append(ranked[:top_logprobs])
    return top


def _logprob_token_ids(raw: bytes, where: str) -> list[int]:
    """The ids of the sampled tokens' ``"token_id:<id>"`` keys, read in bulk: the JSON array of
    those strings without the prefix and the quotes is the array of the ids. Anything else
    (another spelling, escapes, a key that is not one) is read key by key, which names it."""
    count = raw.count(_QUOTED_PREFIX)
    if raw.count(b'"') == 2 * count:
        try:
            ids = _INT_LIST.decode(raw.replace(_QUOTED_PREFIX, b"").replace(b'"', b""))
        except msgspec.DecodeError:
            pass
        else:
            if len(ids) == count:
                return ids
    try:
        keys = _STR_LIST.decode(raw)
    except msgspec.DecodeError:
        raise BackendError(f"{where}: logprobs.tokens should be a list of strings") from None
    return [_token_id(key, where) for key in keys]


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


def read_finish_reason(value: Any, where: str) -> FinishReason | None:
    if value is None:
        return None
    reason = _FINISH_REASONS.get(value) if isinstance(value, str) else None
    if reason is None:
        raise BackendError(f"{where} ended the generation with finish_reason {value!r}")
    return reason


def _usage(value: _Usage) -> dict[str, float]:
    usage = {
        "prompt_tokens": float(value.prompt_tokens),
        "completion_tokens": float(value.completion_tokens),
    }
    details = value.prompt_tokens_details
    if details is not None and details.cached_tokens is not None:
        # only with --enable-prompt-tokens-details
        usage["cached_prompt_tokens"] = float(details.cached_tokens)
    return usage
