"""The soak's trainer (issue 37): weight updates in the middle of the agents' turns.

Every so often (uniform 0.5-1.5 x ``--update-interval-s``) it does what the reference trainer
does after a step: it puts ``PolicyUpdate(version, checkpoint, mode)`` under the run's key in
the ``ts_policy`` bucket (``schemas.policy.encode_policy_update`` and ``Bucket.put``, the two
lines of ``ReferenceTrainer.publish``; the trainer itself would need a model, an optimizer and a
training step to get there). Versions count up from 1; the checkpoints alternate between two
tiny models with other weights, the one the gateways start with (version 0, every even version)
and a copy made with another seed (every odd version), so each load changes what is sampled and
each version's weights are known to the audit. The mode is mostly "abort" (the gateways' local
backends end the running generations, and the gateway continues each on the new weights), some
"keep" (they switch at the next token) and "wait" (they finish on the old weights).

A put the log does not answer (nats-server is one of the soak's fault targets) is asked again,
the same version, until it is confirmed: versions go up one by one, and every version a gateway
may load is in the record (``Update``), confirmed or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from eventlog import LogSettings, connect
from eventlog.buckets import Bucket
from schemas.errors import EventLogUnavailable
from schemas.policy import PolicyUpdate, UpdateMode, encode_policy_update

__all__ = ["MODES", "SoakTrainer", "Update", "checkpoint_of"]

log = logging.getLogger("soak.trainer")

# How often each mode is drawn: mostly the one that interrupts turns.
MODES: tuple[tuple[UpdateMode, float], ...] = (("abort", 0.6), ("keep", 0.2), ("wait", 0.2))
PUT_TIMEOUT_S = 5.0

T = TypeVar("T")


@dataclass
class Update:
    """One version the soak's trainer published (or tried to, until the soak stopped)."""

    at_s: float  # since the soak started: the first try
    version: int
    checkpoint: str
    mode: str
    tries: int = 0
    confirmed_s: float | None = None  # since the soak started: the log confirmed the put


def checkpoint_of(version: int, checkpoints: tuple[Path, Path]) -> Path:
    """The weights of ``version``: the served model's for even versions (0 included), the other
    model's for odd ones.

    >>> a, b = Path("a"), Path("b")
    >>> [checkpoint_of(v, (a, b)).name for v in range(4)]
    ['a', 'b', 'a', 'b']
    """
    return checkpoints[version % 2]


class SoakTrainer:
    def __init__(
        self,
        nats_url: str,
        run: str,
        checkpoints: tuple[Path, Path],
        rng: random.Random,
        elapsed: Callable[[], float],
    ) -> None:
        self.nats_url = nats_url
        self.run = run
        self.checkpoints = checkpoints
        self.rng = rng
        self.elapsed = elapsed
        self.updates: list[Update] = []

    async def publish_until(self, stop: asyncio.Event, mean_interval_s: float) -> list[Update]:
        """Publish a new version at random moments until ``stop``; the updates made."""
        nc = await _retried(lambda: connect(self.nats_url, LogSettings(), name="soak-trainer"))
        try:
            bucket = LogSettings().names.policy_bucket
            kv = await _retried(lambda: Bucket.open(nc.jetstream(), bucket))
            while True:
                with contextlib.suppress(TimeoutError):
                    pause = self.rng.uniform(0.5, 1.5) * mean_interval_s
                    await asyncio.wait_for(stop.wait(), pause)
                if stop.is_set():
                    return self.updates
                await self._publish(kv, stop)
        finally:
            await nc.close()

    async def _publish(self, kv: Bucket, stop: asyncio.Event) -> None:
        version = len(self.updates) + 1
        modes, weights = zip(*MODES, strict=True)
        mode: UpdateMode = self.rng.choices(modes, weights)[0]
        checkpoint = checkpoint_of(version, self.checkpoints)
        update = Update(self.elapsed(), version, str(checkpoint), mode)
        self.updates.append(update)
        entry = encode_policy_update(PolicyUpdate(version, checkpoint, mode))
        while not stop.is_set():
            update.tries += 1
            try:
                async with asyncio.timeout(PUT_TIMEOUT_S):
                    await kv.put(self.run, entry)
            except (EventLogUnavailable, TimeoutError) as exc:
                log.info("policy version %d not confirmed (%s); again", version, exc)
                await asyncio.sleep(0.5)
                continue
            update.confirmed_s = self.elapsed()
            log.info("policy version %d (%s, %s) published", version, checkpoint.name, mode)
            return


async def _retried(call: Callable[[], Awaitable[T]]) -> T:
    """``call()`` until the log answers (nats-server may be down, killed by the soak)."""
    while True:
        try:
            return await call()
        except EventLogUnavailable as exc:
            log.info("the log does not answer (%s); again", exc)
            await asyncio.sleep(0.5)
