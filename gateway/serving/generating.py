"""A turn's generation on the backend, continued through a weight update (DESIGN §4, issue 37).

``Generating.tokens`` is the one generation loop of the gateway: it feeds a turn's
``Generation`` (its detokenizer, each token's policy version) chunk by chunk. A generation the
backend ends with ``finish_reason`` "abort" (a trainer pausing it for a weight update) is sent
again as the turn's prompt plus every token so far (ids, never text), with what is left of
``max_tokens`` and a seed of its own, and the same detokenizer reads on: stop strings, tool
parsing and ``max_tokens`` apply to the whole turn, and the caller sees one generation. Which
version sampled each token: ``gateway.core.versions`` (the contract between trainer and gateway).

A backend whose server expands a prompt's images itself (vLLM's image path,
``gateway.backends.vllm_generate``) says so when it expanded them otherwise than the gateway
did (``GenerationChunk.served_prompt``): the tokens were sampled after *that* prompt, so the
turn is recorded with it (``Generation.served_prompt``; its images where the server put them),
never with the ids the model did not read, and the disagreement is recorded in the turn's
``sampling["prompt_fork"]`` (``prompt_fork``), counted and logged: the kept turn then holds the
server's ids, a later turn continues those, and the fold compares them with its parent's as it
compares any prompt (a fork where they part inside generated history).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable

from gateway.backends.interface import Backend, GenerationChunk, Prompt, SamplingParams
from gateway.core.versions import VersionTimeline
from gateway.decoding import Detokenizer
from gateway.errors import BackendError, GenerationInterrupted
from gateway.frozen import evolved
from gateway.metrics import GatewayMetrics
from gateway.serving.turn_data import Generation, Turn
from gateway.templates import ChatTemplate
from schemas.delta import common_prefix_len
from schemas.errors import EventLogUnavailable

__all__ = ["Generating", "continued_seed", "prompt_fork"]

log = logging.getLogger(__name__)

# A backend that aborts a turn's generation this many times over is not pausing for updates.
_MAX_CONTINUATIONS = 64
SEED_MASK = (1 << 63) - 1  # seeds are non-negative int64s (engine.derived_seed says why)


class Generating:
    """The backend side of turns: generate, continue after an abort, attribute versions."""

    def __init__(
        self,
        *,
        template: ChatTemplate,
        backend: Backend,
        metrics: GatewayMetrics,
        weight_version: Callable[[], int],
        continue_wait_s: float = 120.0,
        max_versions_per_turn: int = 4,
        timeline: VersionTimeline | None = None,
        policy_version: Callable[[], Awaitable[int]] | None = None,
    ) -> None:
        self.template = template
        self.backend = backend
        self.metrics = metrics
        self.weight_version = weight_version
        # A generation the backend aborts continues, waiting at most this long in all for the
        # backend to take it again (0: never, a 503), over at most this many policy versions
        # (then finish_reason "version_limit").
        self.continue_wait_s = continue_wait_s
        self.max_versions_per_turn = max_versions_per_turn
        # The versions the policy watch learned, with the log's time stamps, and a fresh read
        # of the policy bucket (gateway.core.versions); None: the watched version only.
        self.timeline = timeline if timeline is not None else VersionTimeline()
        self.policy_version = policy_version

    def generation(self, turn: Turn) -> Generation:
        """An empty accumulator for ``turn``'s completion."""
        return Generation(Detokenizer(self.template.decode, turn.stop_strings), self.backend.id)

    async def tokens(
        self, turn: Turn, gen: Generation, params: SamplingParams | None = None
    ) -> AsyncIterator[Generation]:
        """Generate (with ``params``, else the turn's), feeding ``gen``; yields it after every
        chunk. Stops at a stop string.

        A generation the backend aborts (``finish_reason`` "abort": a trainer pausing it for a
        weight update) continues (DESIGN §4): the prompt plus the tokens so far (ids) are sent
        again with what is left of ``max_tokens``, the same detokenizer reads on (stop strings
        and tool parsing see the whole turn), and the caller sees one generation. The backend
        has ``continue_wait_s`` in all to start the continuations, else GenerationInterrupted
        (503) and nothing is recorded."""
        params = params or turn.params
        prompt = turn.prompt
        try:
            while True:
                async with contextlib.aclosing(self._part(turn, gen, prompt, params)) as part:
                    async for _ in part:
                        yield gen
                if gen.finish != "abort":
                    return
                if turn.params.max_tokens <= len(gen.detok.ids):  # aborted after its last token
                    gen.finish = "length"
                    return
                prompt, params = self._continuation(turn, gen, params)
        finally:
            gen.detok.finish()

    async def _part(
        self, turn: Turn, gen: Generation, prompt: Prompt, params: SamplingParams
    ) -> AsyncGenerator[None]:
        """One submission of the turn to the backend (the first, or a continuation), feeding
        ``gen``; a continuation's backend gets what is left of the turn's wait to start it."""
        detok, versions = gen.detok, gen.versions
        resumed = bool(gen.continued)
        aborted_at = time.perf_counter()
        # A non-streamed first part arrives whole at its end: what was current then says nothing
        # of its first tokens, so it takes the version as it was submitted, and rule 3 of
        # gateway.core.versions makes it unknown should a newer one be published before it
        # arrives (a /pause?mode=keep mid-generation; or a pause it waited out, which the
        # gateway cannot tell apart). A streamed one reads it as its first token arrives.
        part_version: int | None = None if resumed or params.stream else self.weight_version()
        while True:
            # The session is the routing hint: its replica holds the conversation in its cache.
            stream = aiter(self.backend.generate(prompt, params, session=turn.session.name))
            try:
                first = await self._first_chunk(turn, gen, stream) if resumed else None
            except _Refused:
                # Refused while paused (a server that does not queue): tried again, in time.
                await _close(stream)
                await asyncio.sleep(min(0.5, max(0.0, self._wait_left(gen))))
                continue
            break
        if resumed:
            waited = time.perf_counter() - aborted_at
            gen.interrupted_s += waited
            self.metrics.interrupted_wait.observe(waited)
        try:
            while True:
                if first is not None:
                    chunk, first = first, None
                else:
                    try:
                        chunk = await anext(stream)
                    except StopAsyncIteration:
                        return
                if gen.first_token_at is None:
                    gen.first_token_at = time.perf_counter()
                if chunk.replica is not None:
                    gen.backend_id = chunk.replica
                if chunk.served_prompt is not None:
                    self._served(turn, gen, chunk.served_prompt)
                version, said = chunk.weight_version, chunk.weight_version is not None
                if not said and chunk.token_ids:
                    if part_version is None:
                        part_version = await self._part_version(resumed)
                    version = part_version
                if (
                    chunk.token_ids
                    and version is not None
                    and version not in versions.known
                    and len(versions.known) >= self.max_versions_per_turn
                ):
                    # Sampled by one version too many: not taken, the turn ends here.
                    self.metrics.interruptions.labels("version_limit").inc()
                    gen.finish = "version_limit"
                    return
                versions.add(version, len(chunk.token_ids), said=said, at=time.time())
                detok.add(chunk.token_ids, chunk.logprobs, chunk.top_logprobs)
                if chunk.logprobs_kind is not None:
                    gen.logprobs_kind = chunk.logprobs_kind
                if chunk.finish_reason is not None:
                    gen.finish = chunk.finish_reason
                if chunk.finish_reason == "abort":
                    # Sampled before the pause, so before any newer version was published.
                    versions.seal()
                yield None
                if detok.stopped:
                    gen.finish = "stop"
                    return
        finally:
            await _close(stream)  # stops the generation on the backend

    def _served(self, turn: Turn, gen: Generation, served: Prompt) -> None:
        """The backend read another prompt than the one sent (see the module's docstring); a
        continuation's holds the tokens so far after it, which are the turn's completion."""
        done = len(gen.detok.ids) if gen.continued else 0
        if done:
            served = Prompt(served.ids[: len(served) - done], images=served.images)
        gen.served_prompt = served
        self.metrics.prompt_forks.inc()
        log.warning(
            "session %s: backend %s expanded the prompt's images to %d tokens, the gateway to "
            "%d; the turn is recorded with the backend's (sampling.prompt_fork)",
            turn.session.name,
            gen.backend_id,
            len(served),
            len(turn.prompt),
        )

    async def _first_chunk(
        self, turn: Turn, gen: Generation, stream: AsyncIterator[GenerationChunk]
    ) -> GenerationChunk | None:
        """A continuation's first chunk, within what is left of the turn's wait (a backend
        paused for a weight update queues it until it resumes); None: it ended at once."""
        left = self._wait_left(gen)
        try:
            if left <= 0:
                raise TimeoutError
            async with asyncio.timeout(left):
                return await anext(stream)
        except StopAsyncIteration:
            return None
        except (TimeoutError, BackendError) as exc:
            if isinstance(exc, BackendError) and self._wait_left(gen) > 0:
                raise _Refused from exc
            await _close(stream)
            self.metrics.interruptions.labels("gave_up").inc()
            n = len(gen.detok.ids)
            raise GenerationInterrupted(
                f"session {turn.session.name}: the backend aborted this turn's generation after "
                f"{n} tokens (a weight update?) and did not take it up again within "
                f"{self.continue_wait_s:g} s (--continue-wait-s); nothing was recorded: send the "
                "request again",
                retry_after_s=max(1.0, self.continue_wait_s / 4),
            ) from (exc if isinstance(exc, BackendError) else None)

    def _wait_left(self, gen: Generation) -> float:
        return self.continue_wait_s - gen.interrupted_s - (time.perf_counter() - gen.aborted_at)

    def _continuation(
        self, turn: Turn, gen: Generation, params: SamplingParams
    ) -> tuple[Prompt, SamplingParams]:
        """What to send after an abort: the turn's prompt and every token so far, with what is
        left of max_tokens and a seed of its own (derived from the turn's, where it has one)."""
        done = len(gen.detok.ids)
        gen.aborted_at = time.perf_counter()
        if len(gen.continued) >= _MAX_CONTINUATIONS:  # a backend aborting it again and again
            self.metrics.interruptions.labels("gave_up").inc()
            raise GenerationInterrupted(
                f"session {turn.session.name}: the backend aborted this turn's generation "
                f"{_MAX_CONTINUATIONS + 1} times (after {done} tokens); nothing was recorded: "
                "send the request again",
                retry_after_s=max(1.0, self.continue_wait_s / 4),
            )
        self.metrics.interruptions.labels("continued").inc()
        left = turn.params.max_tokens - done
        seed = None if turn.params.seed is None else continued_seed(turn.params.seed, done)
        gen.continued.append({"at": done, "seed": seed})
        # Debug, not info: an update aborts every turn in flight at once, and an info line (the
        # rich handler) costs about what the resubmission does, ~1 ms of CPU
        # (benchmarks/interrupted_turns.py). The counter above and the policy watch's one line
        # per version say it at info.
        log.debug(
            "session %s: the backend aborted a generation after %d tokens; continuing it",
            turn.session.name,
            done,
        )
        # After the prompt the backend read: a server that expanded it otherwise expands the
        # same images the same way again.
        prompt = gen.served_prompt or turn.prompt
        return prompt.extended(gen.detok.ids), evolved(params, max_tokens=left, seed=seed)

    async def _part_version(self, resumed: bool) -> int:
        """The policy version a part's tokens were sampled by, read as its first token arrived
        (gateway.core.versions, rule 2): afresh from the bucket for a continuation (the
        watch may not have delivered the version its servers resumed with yet)."""
        if resumed and self.policy_version is not None:
            try:
                async with asyncio.timeout(2.0):
                    fresh = await self.policy_version()
            except (TimeoutError, EventLogUnavailable) as exc:
                log.warning("reading the policy version failed (%s); using the watched one", exc)
            else:
                return max(fresh, self.weight_version())
        return self.weight_version()


class _Refused(Exception):
    """The backend refused a continuation while there is time left to ask again."""


async def _close(stream: AsyncIterator[GenerationChunk]) -> None:
    """Stop a backend's stream (an HTTP backend closes the response: the server aborts it)."""
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()


def prompt_fork(sent: Prompt, served: Prompt, backend: str) -> dict[str, int | str]:
    """The record of a turn whose backend read ``served`` where the gateway sent ``sent``
    (``TurnCompleted.sampling["prompt_fork"]``): the first index where they part, both
    lengths, the backend.

    >>> prompt_fork(Prompt([1, 2, 2, 3]), Prompt([1, 2, 2, 2, 3]), "vllm-0")
    {'at': 3, 'sent_tokens': 4, 'served_tokens': 5, 'backend': 'vllm-0'}
    """
    return {
        "at": common_prefix_len(sent.ids, served.ids),
        "sent_tokens": len(sent),
        "served_tokens": len(served),
        "backend": backend,
    }


def continued_seed(seed: int, at: int) -> int:
    """The seed of a turn's continuation after ``at`` tokens (its backend aborted it), from the
    turn's: BLAKE2b of ``turnstream/continue/<seed>/<at>`` as ``derived_seed`` reads it. A fresh
    stream of its own (the turn's seed again would sample its first tokens again), and
    reproducible by ``replay --regenerate`` (``sampling["continued"]``).

    >>> continued_seed(7, 12) == continued_seed(7, 12) != continued_seed(7, 13)
    True
    """
    key = f"turnstream/continue/{seed}/{at}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") & SEED_MASK
