"""A generation's chunks read whole: its tokens and their log-probs, in order."""

from __future__ import annotations

from gateway.backends.interface import GenerationChunk

__all__ = ["logprobs", "tokens"]


def tokens(chunks: list[GenerationChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def logprobs(chunks: list[GenerationChunk]) -> list[float]:
    return [lp for c in chunks for lp in c.logprobs]
