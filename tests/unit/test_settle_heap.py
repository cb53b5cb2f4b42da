"""``turnstream.stack.process.settle_heap``: what every serving process does to its heap once
started."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from turnstream.stack.process import YOUNG_GC_THRESHOLD, settle_heap


@pytest.fixture
def restored_gc() -> Iterator[tuple[int, int, int]]:
    """The test process's GC as it was, whatever the test did to it."""
    before = gc.get_threshold()
    try:
        yield before
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_start_up_objects_are_frozen_and_the_young_generation_waits_longer(
    restored_gc: tuple[int, int, int],
) -> None:
    left_by_start_up = [[] for _ in range(1000)]
    settle_heap()
    assert gc.get_freeze_count() >= len(left_by_start_up)
    # Only the young generation's threshold moves: the older ones keep CPython's, so cyclic
    # garbage that reached them is still collected about as often as before.
    assert gc.get_threshold() == (YOUNG_GC_THRESHOLD, *restored_gc[1:])
    assert gc.isenabled()
