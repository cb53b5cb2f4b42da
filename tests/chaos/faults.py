"""The soak's faults besides SIGKILL (issue 38): what a cluster has when nothing crashes.

- ``freeze``: SIGSTOP for 1-30 s, then SIGCONT (any faulted process: a VM paused for a live
  migration, a long GC, a host swapping). A frozen gateway holds its requests and its copy of
  its sessions; its clients time out and retry on the other one, which serves and stores their
  turns; when it comes back its copy is stale and the log's expectations must catch it. A
  frozen worker or sink keeps deliveries it cannot ack (redelivered elsewhere after ack-wait);
  a frozen nats-server holds every client's publish, ack and ping.
- ``disk-full``: the filesystem under nats-server's store (a tmpfs of its own,
  ``tests.helpers.small_disk``) has no byte left for 1-10 s. Each write of the store fails
  with ENOSPC; nats-server 2.15 then keeps that stream's write error (every later publish to it
  goes unanswered) until it restarts, also once space has returned. So the fault ends as an
  operator ends it: room made, nats-server restarted (SIGTERM, then the supervisor starts it).
- ``slow``: every byte between the clients and nats-server held 0.05-1 s each way for 2-15 s
  (the nats proxy, ``tests.chaos.proxy --delay-file``): acks and pings late, publishes past
  their ack timeout retried.

Each ends early when the soak stops faulting: the agents then finish against a whole system.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable
from pathlib import Path

from tests.chaos.targets import Fault, Target
from tests.helpers.small_disk import SmallDisk

log = logging.getLogger("soak")

KILL, FREEZE, DISK_FULL, SLOW = "kill", "freeze", "disk-full", "slow"
ACTIONS = (KILL, FREEZE, DISK_FULL, SLOW)
NATS_ONLY = (DISK_FULL, SLOW)
FREEZE_S = (1.0, 30.0)
DISK_FULL_S = (1.0, 10.0)
SLOW_S = (2.0, 15.0)
SLOW_DELAY_S = (0.05, 1.0)


def planned_s(action: str, rng: random.Random, max_down_s: float) -> float:
    """How long the fault lasts (a kill: the downtime until the restart is started)."""
    low, high = {FREEZE: FREEZE_S, DISK_FULL: DISK_FULL_S, SLOW: SLOW_S}.get(
        action, (0.2, max_down_s)
    )
    return rng.uniform(low, high)


async def _hold(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)


async def freeze(
    target: Target, fault: Fault, stop: asyncio.Event, elapsed: Callable[[], float]
) -> None:
    started = time.monotonic()
    await asyncio.to_thread(target.freeze)  # nats-server's: until each thread has stopped
    try:
        await _hold(stop, fault.downtime_s - (time.monotonic() - started))
    finally:
        target.thaw()
        target.busy = False
    fault.back_after_s = elapsed() - fault.at_s


async def fill_disk(
    target: Target,
    disk: SmallDisk,
    fault: Fault,
    stop: asyncio.Event,
    elapsed: Callable[[], float],
) -> None:
    try:
        disk.fill()
        fault.detail = f"full at {disk.used_bytes() / 2**20:.1f} MiB"
        await _hold(stop, fault.downtime_s)
    finally:
        disk.make_room()
    # The stream's write error stays until nats-server restarts (see the module's doc).
    target.wanted = False
    try:
        await asyncio.to_thread(target.stop)
    finally:
        target.wanted = True  # the supervisor starts it
    await target.up.wait()
    target.busy = False
    fault.detail += ", restarted"
    fault.back_after_s = elapsed() - fault.at_s


async def slow_down(
    target: Target,
    delay_file: Path,
    fault: Fault,
    stop: asyncio.Event,
    rng: random.Random,
    elapsed: Callable[[], float],
) -> None:
    delay = rng.uniform(*SLOW_DELAY_S)
    fault.detail = f"delay {delay:.2f}s each way"
    set_delay(delay_file, delay)
    try:
        await _hold(stop, fault.downtime_s)
    finally:
        set_delay(delay_file, 0.0)
        target.busy = False
    fault.back_after_s = elapsed() - fault.at_s


def set_delay(delay_file: Path, seconds: float) -> None:
    """What the nats proxy reads within a second (``tests.chaos.proxy``)."""
    temporary = delay_file.with_suffix(".tmp")
    temporary.write_text(f"{seconds:g}")
    temporary.replace(delay_file)
