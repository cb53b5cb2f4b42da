"""Sampling one token from logits, and the log-probs of the distribution it is drawn from: what
the local backend (``gateway.backends.local``) records, what vLLM returns with
``--logprobs-mode processed_logprobs``, and what a trainer recomputes to check them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gateway.backends.interface import SamplingParams, TopLogprob
from schemas.sampling import GREEDY_TEMPERATURE, is_greedy

__all__ = ["SampledToken", "processed_log_probs", "processed_logits", "sample_token"]


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: float
    top_logprobs: list[TopLogprob] | None


def sample_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> SampledToken:
    """Pick the next token from one position's ``logits`` (shape ``[vocab]``, float32).

    The token is drawn from ``processed_log_probs(logits, temperature, top_p)`` (the argmax when
    greedy: a temperature below 1e-5, as vLLM has it), and its logprob and ``top_logprobs`` are
    that distribution's: a trainer recomputing them with a forward pass and the same
    temperature and top-p gets the same numbers. Alternatives outside the top-p nucleus have
    probability 0 and are left out of ``top_logprobs`` (fewer than asked for; the OpenAI shapes
    want finite numbers).
    """
    logprobs = processed_log_probs(logits, params.temperature, params.top_p)
    if is_greedy(params.temperature):
        token = int(torch.argmax(logprobs))
    else:
        token = int(torch.multinomial(logprobs.exp(), 1, generator=generator))
    top = None
    if params.top_logprobs > 0:
        values, ids = torch.topk(logprobs, min(params.top_logprobs, logprobs.numel()))
        inside = torch.isfinite(values)
        top = [
            TopLogprob(token_id=i, logprob=v)
            for i, v in zip(ids[inside].tolist(), values[inside].tolist(), strict=True)
        ]
    return SampledToken(token, float(logprobs[token]), top)


def processed_log_probs(
    logits: torch.Tensor, temperature: float | torch.Tensor, top_p: float | torch.Tensor = 1.0
) -> torch.Tensor:
    """The log-probabilities of the distribution a token is drawn from, for ``logits`` of
    shape ``[..., vocab]`` (float32): what the local backend records, what vLLM returns
    with ``--logprobs-mode processed_logprobs``, and what a trainer recomputes.
    ``log_softmax(processed_logits(...))``: see there.

    >>> logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    >>> [round(v, 4) for v in processed_log_probs(logits, 1.0, 0.7).exp().tolist()]
    [0.625, 0.375, 0.0, 0.0]
    """
    return torch.log_softmax(processed_logits(logits, temperature, top_p), dim=-1)


def processed_logits(
    logits: torch.Tensor, temperature: float | torch.Tensor, top_p: float | torch.Tensor = 1.0
) -> torch.Tensor:
    """``logits`` (``[..., vocab]``, float32) as the sampler draws from them: divided by the
    temperature, and every token outside the top-p nucleus ``-inf``. Their log-softmax is the
    distribution's log-probs; a trainer that has its own log-prob helper (verl's
    ``logprobs_from_logits``) gives it these.

    ``temperature`` and ``top_p`` are numbers, or tensors of the logits' leading shape
    ``[...]``: one setting per position, e.g. the sink's ``rollout_temperature`` and
    ``rollout_top_p`` for a batch's response logits ``[B, R, vocab]``. Greedy
    (``schemas.sampling``: a temperature below 1e-5): the raw logits, whatever ``top_p`` (vLLM
    sets top_p to 1 for greedy requests and divides by 1).
    """
    if isinstance(temperature, torch.Tensor) or isinstance(top_p, torch.Tensor):
        return _processed_per_position(logits, temperature, top_p)
    if is_greedy(temperature):
        return logits
    scaled = logits / temperature
    return _nucleus(scaled, top_p) if top_p < 1.0 else scaled


def _processed_per_position(
    logits: torch.Tensor, temperature: float | torch.Tensor, top_p: float | torch.Tensor
) -> torch.Tensor:
    """``processed_logits`` with a setting per position: vLLM's batched form, where a greedy
    row is divided by 1 and a row at top_p 1 keeps every token."""
    shape, device = logits.shape[:-1], logits.device
    temperature = torch.as_tensor(temperature, dtype=torch.float32, device=device).expand(shape)
    top_p = torch.as_tensor(top_p, dtype=torch.float32, device=device).expand(shape)
    greedy = temperature < GREEDY_TEMPERATURE
    scaled = logits / torch.where(greedy, 1.0, temperature).unsqueeze(-1)
    truncated = ~greedy & (top_p < 1.0)
    if not bool(truncated.any()):
        return scaled
    return torch.where(truncated.unsqueeze(-1), _nucleus(scaled, top_p), scaled)


def _nucleus(scaled: torch.Tensor, top_p: float | torch.Tensor) -> torch.Tensor:
    """``scaled`` with every token outside the top-p nucleus set to ``-inf``; ``top_p`` a
    number or one per position (``scaled``'s shape without the vocabulary).

    vLLM's rule (``apply_top_k_top_p_pytorch``, v1 sampler, 0.32), step for step so that the
    boundary falls where it does there: sort ascending, and drop a token while the mass up to and
    including it is at most ``1 - top_p`` (float32); the most likely token always stays. In exact
    arithmetic: keep a token when the mass of the tokens above it is below top_p, i.e. the
    smallest head reaching top_p. Ties at the boundary go by the sort's order.
    """
    ascending, order = torch.sort(scaled, dim=-1, descending=False)
    mass = torch.cumsum(torch.softmax(ascending, dim=-1), dim=-1)
    # 1 - p in float32, as vLLM computes it from its float32 top_p tensor; a top_p of 5e-324
    # is 0 there, so everything but the most likely token goes.
    p = torch.as_tensor(top_p, dtype=torch.float32, device=scaled.device)
    outside = mass <= (1 - p).unsqueeze(-1) if p.dim() else mass <= 1 - p
    outside[..., -1] = False
    return scaled.scatter(-1, order, ascending.masked_fill(outside, -torch.inf))
