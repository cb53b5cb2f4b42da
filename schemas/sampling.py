"""What a turn was sampled with, as far as its log-probs depend on it (issue 38): temperature,
top_p, top_k and min_p, and what "greedy" means. Pure Python (no torch): the gateway decides
with it which turns a raw-mode replica can serve, the fold records it per turn, the sink spreads
it over the tokens, and a trainer recomputes the same distribution from it.

Greedy is vLLM's rule (``vllm/sampling_params.py``, ``_SAMPLING_EPS``, 0.32): a temperature
below 1e-5 is greedy, and vLLM then sets top_p 1, top_k 0 and min_p 0, so the log-probs it
reports are the raw ``log_softmax(logits)`` whatever else was asked. The gateway's own sampler
follows the same rule, so a turn means one thing on every backend and in every record.

>>> s = TurnSampling.of({"temperature": 0.7, "top_p": 0.9, "max_tokens": 16})
>>> s, s.distribution
(TurnSampling(temperature=0.7, top_p=0.9, top_k=0, min_p=0.0), (0.7, 0.9))
>>> TurnSampling.of({"temperature": 1e-6, "top_p": 0.5}).distribution  # greedy: the raw one
(1.0, 1.0)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass

__all__ = ["GREEDY_TEMPERATURE", "TurnSampling", "is_greedy"]

GREEDY_TEMPERATURE = 1e-5
"""A temperature below this is greedy (vLLM's ``_SAMPLING_EPS``)."""


def is_greedy(temperature: float) -> bool:
    """Whether a turn at ``temperature`` takes the argmax and records raw log-probs."""
    return temperature < GREEDY_TEMPERATURE


@dataclass(frozen=True)
class TurnSampling:
    """One turn's sampling settings that shape its distribution. ``top_k`` 0 and ``min_p`` 0
    are off (the gateway never sets them: top_k is refused at its API, min_p it does not
    have); temperature and top_p absent from a record are the API's defaults, 1."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0

    @classmethod
    def of(cls, record: Mapping[str, object]) -> TurnSampling:
        """The settings in a ``TurnCompleted.sampling`` record (or a trajectory's per-turn
        ``metadata.sampling`` entry); other keys are ignored."""

        def number(key: str, default: float) -> float:
            value = record.get(key, default)
            return float(value) if isinstance(value, int | float) else default

        return cls(
            temperature=number("temperature", 1.0),
            top_p=number("top_p", 1.0),
            top_k=int(number("top_k", 0)),
            min_p=number("min_p", 0.0),
        )

    @property
    def greedy(self) -> bool:
        return is_greedy(self.temperature)

    @property
    def distribution(self) -> tuple[float, float]:
        """(temperature, top_p) of the distribution the turn's log-probs are of: greedy
        turns' are the raw distribution's, (1, 1)."""
        return (1.0, 1.0) if self.greedy else (self.temperature, self.top_p)

    def unsupported(self) -> str | None:
        """The setting a trainer recomputing the distribution (temperature and top-p) cannot
        honour, as ``name=value``; None when there is none. Greedy turns have none (vLLM
        turns them all off)."""
        if self.greedy:
            return None
        if self.top_k > 0:
            return f"top_k={self.top_k}"
        if self.min_p > 0:
            return f"min_p={self.min_p}"
        return None

    def to_json(self) -> dict[str, float | int]:
        return asdict(self)
