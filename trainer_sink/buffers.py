"""Memory for padded batches, reused once nothing refers to a batch any more.

A padded batch is large (a [256, 17k] batch of agent sessions: ~200 MB in eight arrays, ten
since the per-token sampling of issue 38) and a
fresh allocation of it is not free: the kernel maps and zeroes every page the first time
assembly writes it. Measured on the 2-core VM (docs/PERFORMANCE.md, section 6): allocating and
first-touching the batch was 35 of the padded assembly's 57 ms. A trainer takes a batch, trains
on it and lets it go; the next batch can then be written into the same pages.

``BatchBuffers`` keeps the flat byte buffers the arrays of earlier batches were views of. A
buffer is free again when nothing but the pool refers to it: every array handed out is a view
that keeps its buffer alive (``torch.from_numpy`` keeps the array, every tensor view keeps the
storage), so while any tensor of a batch, a slice of it or a copy's source is alive, its buffer
is not reused. The check is CPython's reference count. A buffer is never handed out twice at
once, so a batch a trainer keeps (a replay buffer, a prefetch) is never written over; memory a
trainer holds only as a raw pointer without a Python reference (none of torch's own paths do
this) would need ``AssemblySettings.reuse_memory=False``.
"""

from __future__ import annotations

import sys
from math import prod
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["BatchBuffers"]

# The references a free buffer has while its count is read: the pool's list and the argument.
_FREE_REFS = 2
# Room for the next batch's slightly longer rows: a buffer is made this much larger than asked.
_HEADROOM = 1.125


class BatchBuffers:
    """A pool of flat byte buffers; ``take`` gives an array of the asked shape backed by one
    (its bytes are what an earlier batch left: the caller writes every element).

    Keeps at most ``keep`` buffers (enough for two padded batches by default): past that, the
    free ones go first (smallest first), then the oldest of those in use, which stay alive for
    as long as their batch does and are then freed as any array is.
    """

    def __init__(self, keep: int = 20) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.keep = keep
        self._buffers: list[npt.NDArray[np.uint8]] = []
        self.reused = 0  # takes served from an earlier batch's memory
        self.allocated = 0  # takes that needed new memory

    def take(self, shape: tuple[int, ...], dtype: type[np.generic]) -> npt.NDArray[Any]:
        """An array of ``shape`` and ``dtype``, its contents undefined (an earlier batch's)."""
        nbytes = prod(shape) * np.dtype(dtype).itemsize
        index = self._best_free(nbytes)
        if index is None:
            buffer = np.empty(max(1, int(nbytes * _HEADROOM)), dtype=np.uint8)
            self._buffers.append(buffer)
            self.allocated += 1
            self._trim()
        else:
            buffer = self._buffers[index]
            self.reused += 1
        return buffer[:nbytes].view(dtype).reshape(shape)

    def _free(self, index: int) -> bool:
        return sys.getrefcount(self._buffers[index]) == _FREE_REFS

    def _best_free(self, nbytes: int) -> int | None:
        """The smallest free buffer that holds ``nbytes``."""
        fitting = [i for i in range(len(self._buffers)) if self._buffers[i].nbytes >= nbytes]
        free = [i for i in fitting if self._free(i)]
        return min(free, key=lambda i: self._buffers[i].nbytes) if free else None

    def _trim(self) -> None:
        while len(self._buffers) > self.keep:
            free = [i for i in range(len(self._buffers)) if self._free(i)]
            index = min(free, key=lambda i: self._buffers[i].nbytes) if free else 0
            self._buffers.pop(index)
