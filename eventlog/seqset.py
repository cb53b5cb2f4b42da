"""A set of stream sequences kept as merged closed intervals (pure).

The shard writer remembers which TRAJ sequences are already in a committed shard (or were
dead-lettered), a live sink which ones its trainer committed (``eventlog.commits``), so that a
redelivered message is skipped. Sequences get committed roughly in
order and every one eventually is, so the intervals keep merging: after a long run the set is a
handful of intervals, not millions of integers.

>>> seqs = SeqSet()
>>> seqs.add_range(1, 4); seqs.add(7); seqs.add_many([5, 9, 8])
>>> seqs.intervals, 6 in seqs, 5 in seqs, len(seqs)
([(1, 5), (7, 9)], False, True, 8)
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable

import numpy as np

__all__ = ["SeqSet"]


class SeqSet:
    """Stream sequences as sorted, disjoint, non-adjacent closed intervals."""

    __slots__ = ("_ends", "_starts")

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []

    def __contains__(self, seq: object) -> bool:
        if not isinstance(seq, int):
            return False
        i = bisect_right(self._starts, seq) - 1
        return i >= 0 and self._ends[i] >= seq

    def __len__(self) -> int:
        """How many sequences the set holds."""
        return sum(hi - lo + 1 for lo, hi in zip(self._starts, self._ends, strict=True))

    @property
    def intervals(self) -> list[tuple[int, int]]:
        return list(zip(self._starts, self._ends, strict=True))

    def add(self, seq: int) -> None:
        self.add_range(seq, seq)

    def add_range(self, lo: int, hi: int) -> None:
        """Add every sequence in ``[lo, hi]``; merges with overlapping and adjacent intervals."""
        if hi < lo:
            return
        # Intervals i..j-1 touch [lo, hi]: their end reaches lo - 1 and their start is <= hi + 1.
        i = bisect_left(self._ends, lo - 1)
        j = bisect_right(self._starts, hi + 1)
        if i < j:
            lo = min(lo, self._starts[i])
            hi = max(hi, self._ends[j - 1])
        self._starts[i:j] = [lo]
        self._ends[i:j] = [hi]

    def add_many(self, seqs: Iterable[int] | np.ndarray) -> None:
        """Add many sequences at once, one interval per consecutive stretch of them."""
        values = np.unique(np.asarray(seqs if isinstance(seqs, np.ndarray) else list(seqs)))
        if values.size == 0:
            return
        breaks = np.flatnonzero(np.diff(values) != 1)
        starts = np.concatenate(([values[0]], values[breaks + 1]))
        ends = np.concatenate((values[breaks], [values[-1]]))
        for lo, hi in zip(starts.tolist(), ends.tolist(), strict=True):
            self.add_range(lo, hi)
