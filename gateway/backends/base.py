"""The one small interface every inference backend implements (DESIGN §4).

Token ids and sampling parameters in; token ids and their logprobs out, streamed. The gateway
owns tokenization and chat templates: a backend never sees text it must tokenize, and what it
streams back is exactly what the model sampled.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

__all__ = [
    "Backend",
    "GenerationChunk",
    "SamplingParams",
    "TopLogprob",
    "needs_processed_logprobs",
]

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class SamplingParams:
    """What the gateway asks of one generation.

    ``logprobs`` are always returned for every sampled token: they are the log-probabilities
    under the distribution the token was sampled from, ``log_softmax(logits / temperature)``
    restricted to the top-p nucleus and renormalized over it (the raw ``log_softmax(logits)``
    when temperature is 0, i.e. greedy). ``top_logprobs`` > 0 also returns up to that many
    alternatives per position, from the same distribution: tokens outside the nucleus have
    probability 0 and may be left out.
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: Sequence[int] = ()  # generation ends after emitting one of these
    top_logprobs: int = 0
    # A backend that can only return the model's raw log-probs (vLLM's default logprobs mode)
    # refuses a sampling whose distribution differs from them, unless this is set (the
    # gateway's --allow-raw-logprobs): then it generates and marks its chunks "raw".
    allow_raw_logprobs: bool = False


def needs_processed_logprobs(params: SamplingParams) -> bool:
    """Whether the distribution sampled from differs from the model's raw one: a temperature
    other than 1 (greedy's log-probs are the raw ones by definition) or a top-p below 1.

    >>> needs_processed_logprobs(SamplingParams(max_tokens=1, temperature=0.5))
    True
    >>> needs_processed_logprobs(SamplingParams(max_tokens=1, temperature=0.0))
    False
    """
    return params.temperature not in (0.0, 1.0) or params.top_p < 1.0


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    logprob: float


@dataclass(frozen=True)
class GenerationChunk:
    """One or more newly sampled tokens, in order. The last chunk has ``finish_reason`` set
    ("stop": a stop token was sampled, and is included in ``token_ids``; "length": max_tokens)."""

    token_ids: list[int]
    logprobs: list[float]  # one per token
    top_logprobs: list[list[TopLogprob]] | None = None  # one list per token when asked
    finish_reason: FinishReason | None = None
    weight_version: int | None = None  # policy version that sampled these tokens, if known
    extra: dict[str, float] = field(default_factory=dict)  # backend timings etc.
    replica: str | None = None  # the replica that generated them, when a router chose one
    # Set (on every chunk) by a backend whose log-probs are not those of the distribution sampled
    # from: "raw" (the model's untempered distribution). None: the sampled one's, as promised.
    logprobs_kind: str | None = None


@runtime_checkable
class Backend(Protocol):
    """An inference server (or in-process model) behind the gateway."""

    @property
    def id(self) -> str:
        """Stable name of this backend replica, recorded in every TurnCompleted."""
        ...

    @property
    def max_context(self) -> int:
        """Longest prompt + completion the model accepts, in tokens."""
        ...

    def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, session: str | None = None
    ) -> AsyncIterator[GenerationChunk]:
        """Stream the completion of ``prompt_ids``. Raises BackendError (gateway.errors) when
        the backend fails; cancelling the iteration stops the generation. ``session`` is a
        routing hint (replicas keep a session's prefix cached); a single backend ignores it."""
        ...

    async def admit(self, params: SamplingParams) -> str | None:
        """Check, before a turn starts streaming, that this backend can record ``params``'
        sampling as promised: raises InvalidRequest (a 400) when its log-probs would not be
        those of the distribution sampled from (a vLLM replica in its default raw mode asked
        for temperature 0.5) and ``params.allow_raw_logprobs`` is off. Returns the log-prob kind
        its chunks will carry ("raw"), or None for the sampled distribution's."""
        ...

    async def close(self) -> None: ...
