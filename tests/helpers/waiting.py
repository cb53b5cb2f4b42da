"""Waiting for a condition in async tests, with a deadline and a message when it never holds."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def eventually(condition: Callable[[], bool], within: float, what: str) -> None:
    """Poll ``condition`` until it holds; fail the test naming ``what`` after ``within`` s."""
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {within}s: {what}")
        await asyncio.sleep(0.02)


def wait_for(condition: Callable[[], bool], within: float, what: str) -> None:
    """``eventually`` for synchronous tests: poll ``condition``, fail naming ``what``."""
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {within}s: {what}")
        time.sleep(0.05)
