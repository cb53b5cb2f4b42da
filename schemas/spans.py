"""A sample's generated tokens as spans, and the per-token arrays they stand for (DESIGN §6).

A folded sample is mostly prompt: its generated tokens come in a few runs, one per completion.
The wire form (``CompactTrajectory``) stores those runs as spans, sorted and disjoint, each of
one weight version, with one logprob per generated token; every other token has loss mask 0,
logprob 0 and version -1. The fold makes the spans from its turns' boundaries
(``merge_spans``); the per-token arrays are made from the spans here and only here
(``token_arrays``), for a consumer that reads per token (a trainer's sample, a shard's
columns); ``generated_runs`` finds the spans of a sample given per token.

>>> spans, versions = merge_spans(np.array([2, 4, 6]), np.array([4, 4, 8]), np.array([7, 7, 7]))
>>> spans.tolist(), versions.tolist()  # the empty completion goes, the touching ones join
([2, 4, 6, 8], [7, 7])
>>> mask, logprobs, versions = token_arrays(9, spans, versions, np.full(4, -0.5, np.float32))
>>> mask.tolist(), versions.tolist()
([0, 0, 1, 1, 0, 0, 1, 1, 0], [-1, -1, 7, 7, -1, -1, 7, 7, -1])
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = ["generated_runs", "merge_spans", "span_positions", "token_arrays"]

_Int32Array = npt.NDArray[np.int32]


def span_positions(starts: np.ndarray, ends: np.ndarray) -> npt.NDArray[np.int64]:
    """The token positions inside the spans ``[starts[i], ends[i])``, in order, vectorized.

    >>> span_positions(np.array([1, 5]), np.array([3, 6])).tolist()
    [1, 2, 5]
    """
    lengths = ends.astype(np.int64) - starts
    total = int(lengths.sum())
    if total == 0:
        return np.empty(0, dtype=np.int64)
    before = np.cumsum(lengths) - lengths  # generated tokens before each span
    return np.repeat(starts.astype(np.int64) - before, lengths) + np.arange(total)


def _interleaved(starts: np.ndarray, ends: np.ndarray) -> _Int32Array:
    spans = np.empty(2 * len(starts), dtype=np.int32)
    spans[0::2], spans[1::2] = starts, ends
    return spans


def merge_spans(
    starts: np.ndarray, ends: np.ndarray, versions: np.ndarray
) -> tuple[_Int32Array, _Int32Array]:
    """The wire form's spans (start, end pairs, int32) and their versions from runs of
    generated tokens in order (a sample's completions, ``versions[i]`` that of run i): empty
    runs dropped, runs that touch and share a version joined, so the spans are the maximal
    runs ``generated_runs`` finds in the per-token arrays."""
    keep = ends > starts
    starts, ends, versions = starts[keep], ends[keep], versions[keep]
    if not len(starts):
        return np.empty(0, dtype=np.int32), np.empty(0, dtype=np.int32)
    joins = (starts[1:] == ends[:-1]) & (versions[1:] == versions[:-1])
    first = np.concatenate(([True], ~joins))  # the runs that begin a span
    last = np.concatenate((~joins, [True]))  # the runs that end one
    spans = _interleaved(starts[first], ends[last])
    return spans, versions[first].astype(np.int32, copy=False)


def generated_runs(
    generated: npt.NDArray[np.bool_], versions: _Int32Array
) -> tuple[_Int32Array, _Int32Array]:
    """The spans (start, end pairs, int32) of the maximal runs of generated tokens of one
    weight version, and their versions, from the per-token arrays."""
    n = len(generated)
    if n == 0:
        return np.empty(0, dtype=np.int32), np.empty(0, dtype=np.int32)
    changed = (generated[1:] != generated[:-1]) | (generated[1:] & (versions[1:] != versions[:-1]))
    bounds = np.concatenate(([0], np.flatnonzero(changed) + 1, [n])).astype(np.int32)
    starts, ends = bounds[:-1], bounds[1:]
    is_generated = generated[starts]
    starts = starts[is_generated]
    return _interleaved(starts, ends[is_generated]), versions[starts]


def token_arrays(
    n: int, spans: np.ndarray, span_versions: np.ndarray, gen_logprobs: np.ndarray
) -> tuple[npt.NDArray[np.int8], npt.NDArray[np.float32], _Int32Array]:
    """The per-token loss mask, logprobs and versions (int8, float32, int32) of ``n`` tokens
    whose generated ones are ``spans`` (start, end pairs; the spans of several samples laid end
    to end, each shifted by where its sample starts, give the arrays of all at once)."""
    pairs = spans.astype(np.int64).reshape(-1, 2)
    starts, ends = pairs[:, 0].copy(), pairs[:, 1].copy()
    at = span_positions(starts, ends)
    mask = np.zeros(n, dtype=np.int8)
    mask[at] = 1
    logprobs = np.zeros(n, dtype=np.float32)
    logprobs[at] = gen_logprobs
    versions = np.full(n, -1, dtype=np.int32)
    versions[at] = np.repeat(span_versions, ends - starts)
    return mask, logprobs, versions
