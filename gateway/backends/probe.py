"""What a remote replica's log-probs are, found by asking it, and the check every turn passes.

The Backend protocol promises the log-probs of the distribution each token was sampled from.
Whether a vLLM or SGLang server keeps that promise depends on its flags, environment and version,
none of which it reports, so the gateway asks: the same one-token request three times, a fixed
short prompt and seed, with ``top_logprobs`` 1 (the most likely next token and its log-prob):

    A  temperature 1.0, top_p 1.0      the model's raw distribution, whatever the mode
    B  temperature 0.5, top_p 1.0      processed: the top token's log-prob rises (sharper)
    C  temperature 1.0, top_p 0.5      processed: it rises too (renormalised over the kept mass)

Temperature and truncation keep the ranking, so the top token is the same in all three; its
log-prob tells the kind:

    B == A, C == A   "raw"        vLLM's default --logprobs-mode (raw_logprobs); SGLang with
                                  SGLANG_RETURN_ORIGINAL_LOGPROB set
    B > A,  C > A    "processed"  vLLM --logprobs-mode processed_logprobs: temperature and top-p
    B > A,  C == A   "tempered"   SGLang's default since sgl-project/sglang#5961: temperature,
                                  not top-p (see gateway/backends/sglang.py)
    anything else    "unknown"    e.g. a next token of probability 1, which no temperature moves

"Equal" is within 1e-4 (the probe's requests run one at a time, so a server computes them alike;
a processed change is orders of magnitude larger). "unknown" is treated as "raw": a turn is
refused rather than recorded with log-probs nobody can vouch for.

A turn whose sampling makes the distribution differ from the raw one
(``needs_processed_logprobs``) is refused on a replica that cannot record it (``InvalidRequest``,
400), before anything is sent, unless the gateway runs with ``--allow-raw-logprobs``: then it is
generated and its chunks are marked ``logprobs_kind="raw"`` (not the sampled distribution's).

A replica is probed at the gateway's start (``turnstream.services.gateway.assembly``), and again
when it is next needed after its probe could not reach it, after any failed request (it may have
been restarted with other flags), and before a refusal once its last probe is ``recheck_s`` old (so
a server restarted in processed mode is served without restarting the gateway).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Literal

from gateway.backends.interface import (
    GenerationChunk,
    SamplingParams,
    TopLogprob,
    needs_processed_logprobs,
)
from gateway.errors import BackendError, BackendUnavailable, InvalidRequest

__all__ = [
    "PROBE_PROMPT",
    "GuardedLogprobs",
    "LogprobsGuard",
    "LogprobsKind",
    "ProbeResult",
    "classify",
    "probe_replicas",
    "records_sampled",
]

log = logging.getLogger(__name__)

LogprobsKind = Literal["processed", "tempered", "raw", "unknown"]

# Token ids below 100 exist in every vocabulary (byte-level BPEs such as Qwen's and Llama 3's put
# the printable ASCII characters there, SentencePiece its byte tokens), so this prompt is valid
# for any model without its tokenizer. It spells nonsense ("Hh%s2" in byte-level BPEs): its
# next token is uncertain, so temperature and top-p visibly move the top token's log-prob (a
# prompt whose continuation is certain, probability 1, leaves the probe unable to tell).
PROBE_PROMPT: tuple[int, ...] = (39, 71, 4, 82, 17)
PROBE_SEED = 0
EQUAL_TOL = 1e-4  # |Δ log-prob| under which two probe answers are the same distribution
RAW_MARK = "raw"  # GenerationChunk.logprobs_kind of a turn recorded under --allow-raw-logprobs

_SETTINGS = ((1.0, 1.0), (0.5, 1.0), (1.0, 0.5))  # (temperature, top_p) of A, B, C

Sample = Callable[[Sequence[int], SamplingParams], AsyncGenerator[GenerationChunk, None]]


@dataclass(frozen=True)
class ProbeResult:
    kind: LogprobsKind
    reason: str  # what the probe saw, in words (logged, and quoted in a refusal)
    seconds: float  # wall time of the probe's requests


def classify(
    base: TopLogprob, tempered: TopLogprob, truncated: TopLogprob
) -> tuple[LogprobsKind, str]:
    """The kind of log-probs a server returned for the probe's requests A, B, C (pure).

    >>> classify(TopLogprob(7, -1.2), TopLogprob(7, -1.2), TopLogprob(7, -1.2))[0]
    'raw'
    >>> classify(TopLogprob(7, -1.2), TopLogprob(7, -0.4), TopLogprob(7, -0.3))[0]
    'processed'
    >>> classify(TopLogprob(7, -1.2), TopLogprob(7, -0.4), TopLogprob(7, -1.2))[0]
    'tempered'
    >>> classify(TopLogprob(7, 0.0), TopLogprob(7, 0.0), TopLogprob(7, 0.0))[0]
    'unknown'
    """
    seen = (
        f"top token {base.token_id}: log-prob {base.logprob:.6g} at temperature 1, "
        f"{tempered.logprob:.6g} at temperature 0.5, {truncated.logprob:.6g} at top_p 0.5"
    )
    if len({base.token_id, tempered.token_id, truncated.token_id}) != 1:
        tokens = (base.token_id, tempered.token_id, truncated.token_id)
        return "unknown", f"the top token changed with temperature or top-p: {tokens}"
    if max(base.logprob, tempered.logprob, truncated.logprob) > EQUAL_TOL:
        # vLLM's raw_logits / processed_logits modes return logits under the same field.
        return "unknown", f"values above 0 are not log-probabilities (logits?): {seen}"
    if base.logprob > -EQUAL_TOL:
        return "unknown", f"the next token has probability 1, which nothing changes: {seen}"
    by_temperature = _moved(base.logprob, tempered.logprob)
    by_top_p = _moved(base.logprob, truncated.logprob)
    kinds: dict[tuple[bool | None, bool | None], LogprobsKind] = {
        (False, False): "raw",
        (True, True): "processed",
        (True, False): "tempered",
    }
    return kinds.get((by_temperature, by_top_p), "unknown"), seen


def _moved(base: float, changed: float) -> bool | None:
    """Whether sharpening raised the top token's log-prob (True), left it (False), or moved it
    the wrong way, which no sampling transform does (None)."""
    if abs(changed - base) <= EQUAL_TOL:
        return False
    return True if changed > base else None


def records_sampled(kind: LogprobsKind, params: SamplingParams) -> bool:
    """Whether a replica whose log-probs are ``kind`` returns those of the distribution
    ``params`` samples from.

    >>> records_sampled("tempered", SamplingParams(max_tokens=1, temperature=0.5))
    True
    >>> records_sampled("tempered", SamplingParams(max_tokens=1, top_p=0.9))
    False
    >>> records_sampled("raw", SamplingParams(max_tokens=1, temperature=0.0))
    True
    """
    if not needs_processed_logprobs(params) or kind == "processed":
        return True
    return kind == "tempered" and params.top_p >= 1.0


_FOUND: dict[LogprobsKind, str] = {
    "raw": "its log-probs are the model's raw distribution (the same at temperature 1 and 0.5)",
    "tempered": "its log-probs follow temperature but not top-p truncation",
    "processed": "its log-probs are those of the distribution sampled from",
    "unknown": "the log-prob probe could not tell what its log-probs are",
}


class LogprobsGuard:
    """One replica's log-prob kind, probed when first needed, and the check of every turn.

    ``sample`` is the replica's unchecked generation; ``advice`` says, per kind, how to start
    that server so that it records the sampled distribution. A ``kind`` given is taken as known
    (no probe) until a failed request makes it forgotten."""

    def __init__(
        self,
        *,
        replica: str,
        where: str,
        sample: Sample,
        advice: Mapping[LogprobsKind, str],
        prompt: Sequence[int] = PROBE_PROMPT,
        kind: LogprobsKind | None = None,
        recheck_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._replica = replica
        self._where = where
        self._sample = sample
        self._advice = advice
        self._prompt = list(prompt)
        self._clock = clock
        self._recheck_s = recheck_s
        self._lock = asyncio.Lock()
        self.result: ProbeResult | None = None
        self._probed_at = -float("inf")
        if kind is not None:
            self.result = ProbeResult(kind, "given, not probed", 0.0)
            self._probed_at = clock()

    @property
    def kind(self) -> LogprobsKind | None:
        """None until a probe reached the replica."""
        return None if self.result is None else self.result.kind

    def forget(self) -> None:
        """The replica failed a request: it may come back with other flags; probe it again."""
        self.result = None

    async def probe(self) -> ProbeResult:
        """Probe now (concurrent callers share one probe). ``BackendUnavailable`` when the
        replica cannot be reached: nothing is recorded, and the next turn that needs it probes
        again. Any other failure is an "unknown" kind naming the error."""
        asked = self._clock()
        async with self._lock:
            if self.result is not None and self._probed_at >= asked:
                return self.result  # probed while this call waited
            started = time.perf_counter()
            try:
                answers = [await self._top(t, p) for t, p in _SETTINGS]
                kind, reason = classify(*answers)
            except BackendUnavailable:
                raise
            except BackendError as exc:
                kind, reason = "unknown", f"the probe request failed: {exc}"
            self.result = ProbeResult(kind, reason, time.perf_counter() - started)
            self._probed_at = self._clock()
            return self.result

    async def _top(self, temperature: float, top_p: float) -> TopLogprob:
        params = SamplingParams(
            max_tokens=1, temperature=temperature, top_p=top_p, seed=PROBE_SEED, top_logprobs=1
        )
        async with aclosing(self._sample(self._prompt, params)) as chunks:
            async for chunk in chunks:
                if chunk.top_logprobs and chunk.top_logprobs[0]:
                    return chunk.top_logprobs[0][0]
        raise BackendError(f"{self._where} answered the log-prob probe without top_logprobs")

    async def admit(self, params: SamplingParams) -> str | None:
        """None: the replica records the distribution ``params`` samples from. ``"raw"``: it
        does not, and ``params.allow_raw_logprobs`` lets it be recorded so marked. Otherwise
        ``InvalidRequest``, before anything is sent."""
        if not needs_processed_logprobs(params):
            return None
        result = self.result if self.result is not None else await self.probe()
        if records_sampled(result.kind, params):
            return None
        if params.allow_raw_logprobs:
            return RAW_MARK
        if self._clock() - self._probed_at >= self._recheck_s:
            result = await self.probe()  # restarted in processed mode since?
            if records_sampled(result.kind, params):
                return None
        raise self._refusal(result, params)

    def _refusal(self, result: ProbeResult, params: SamplingParams) -> InvalidRequest:
        tempers = result.kind in ("processed", "tempered")
        temperature_ok = tempers or params.temperature in (0.0, 1.0)
        found = _FOUND[result.kind]
        if result.kind == "unknown":
            found = f"{found} ({result.reason})"
        return InvalidRequest(
            f"replica {self._replica} ({self._where}) cannot record the log-probs of the "
            f"distribution this turn samples from (temperature {params.temperature:g}, top_p "
            f"{params.top_p:g}): {found}, so importance ratios computed from them would be "
            f"wrong. {self._advice[result.kind]}; or sample at temperature 1 and top_p 1; or "
            "start the gateway with --allow-raw-logprobs to record such turns with "
            "logprobs_kind 'raw' (the trainer refuses them for importance ratios)",
            param="top_p" if temperature_ok else "temperature",
        )


class GuardedLogprobs:
    """What a remote backend holding a ``LogprobsGuard`` shows of it."""

    _logprobs: LogprobsGuard

    @property
    def logprobs_kind(self) -> LogprobsKind | None:
        """What this replica's log-probs are ("processed", "tempered", "raw", "unknown"); None
        until a probe reached it."""
        return self._logprobs.kind

    async def probe_logprobs(self) -> ProbeResult:
        return await self._logprobs.probe()

    async def admit(self, params: SamplingParams) -> str | None:
        """Refuse (``InvalidRequest``) a sampling whose log-probs this replica would record
        wrongly, before a turn starts streaming; ``generate`` checks it again."""
        return await self._logprobs.admit(params)


async def probe_replicas(
    backends: Sequence[object], *, timeout_s: float = 60.0
) -> dict[str, ProbeResult | None]:
    """Probe every replica that can be (concurrently: one server each) and log what its
    log-probs are and how long the probe took; None for a replica that could not be reached
    within ``timeout_s`` (it is probed when next needed)."""

    async def one(backend: GuardedLogprobs) -> ProbeResult | None:
        try:
            async with asyncio.timeout(timeout_s):
                result = await backend.probe_logprobs()
        except (BackendUnavailable, TimeoutError) as exc:
            log.warning(
                "replica %s: log-prob probe: %s; probed again when needed",
                _id(backend),
                str(exc) or f"no answer in {timeout_s:g} s",
            )
            return None
        level = logging.INFO if result.kind == "processed" else logging.WARNING
        log.log(
            level,
            "replica %s: log-probs %s (%s); probed in %.1f ms%s",
            _id(backend),
            result.kind,
            result.reason,
            1000 * result.seconds,
            "" if result.kind == "processed" else _CONSEQUENCE[result.kind],
        )
        return result

    guarded = [b for b in backends if isinstance(b, GuardedLogprobs)]
    results = await asyncio.gather(*(one(b) for b in guarded))
    return {_id(b): r for b, r in zip(guarded, results, strict=True)}


def _id(backend: object) -> str:
    return str(getattr(backend, "id", "?"))


_CONSEQUENCE: dict[LogprobsKind, str] = {
    "raw": ": a turn at a temperature other than 1 or a top_p below 1 is refused (400) "
    "unless the gateway runs with --allow-raw-logprobs",
    "tempered": ": a turn at a top_p below 1 is refused (400) unless the gateway runs with "
    "--allow-raw-logprobs",
    "unknown": ": treated as raw (a turn at a temperature other than 1 or a top_p below 1 is "
    "refused unless the gateway runs with --allow-raw-logprobs)",
    "processed": "",
}
