"""Sampling one token from logits, and the log-probs of the distribution it is drawn from: what
the local backend (``gateway.backends.local``) records, what vLLM returns with
``--logprobs-mode processed_logprobs``, and what a trainer recomputes to check them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gateway.backends.interface import SamplingParams, TopLogprob

__all__ = ["SampledToken", "processed_log_probs", "sample_token"]


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
    greedy), and its logprob and ``top_logprobs`` are that distribution's: a trainer
    recomputing them with a forward pass and the same temperature and top-p gets the same
    numbers. Alternatives outside the top-p nucleus have probability 0 and are left out of
    ``top_logprobs`` (fewer than asked for; the OpenAI shapes want finite numbers).
    """
    logprobs = processed_log_probs(logits, params.temperature, params.top_p)
    if params.temperature == 0:
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
    logits: torch.Tensor, temperature: float, top_p: float = 1.0
) -> torch.Tensor:
    """The log-probabilities of the distribution a token is drawn from, for ``logits`` of
    shape ``[..., vocab]`` (float32): what the local backend records, and what vLLM returns
    with ``--logprobs-mode processed_logprobs``.

    Greedy (temperature 0): ``log_softmax(logits)``, the raw distribution, whatever ``top_p``
    (vLLM sets top_p to 1 for greedy requests). Otherwise ``log_softmax(logits / temperature)``
    restricted to the top-p nucleus and renormalized over it; tokens outside it are ``-inf``.

    >>> logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    >>> [round(v, 4) for v in processed_log_probs(logits, 1.0, 0.7).exp().tolist()]
    [0.625, 0.375, 0.0, 0.0]
    """
    if temperature == 0:
        return torch.log_softmax(logits, dim=-1)
    if temperature < 1e-30:
        # logits / T would overflow (or T is 0 in float32) and give inf - inf = NaN: shifted by
        # the max first (log_softmax does not change) and divided by 1e-30, it is the one-hot
        # distribution it tends to.
        scaled = (logits - logits.amax(dim=-1, keepdim=True)) / 1e-30
    else:
        scaled = logits / temperature
    if top_p < 1.0:
        scaled = _nucleus(scaled, top_p)
    return torch.log_softmax(scaled, dim=-1)


def _nucleus(scaled: torch.Tensor, top_p: float) -> torch.Tensor:
    """``scaled`` with every token outside the top-p nucleus set to ``-inf``.

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
    outside = mass <= 1 - torch.tensor(top_p, dtype=torch.float32)
    outside[..., -1] = False
    return scaled.scatter(-1, order, ascending.masked_fill(outside, -torch.inf))
