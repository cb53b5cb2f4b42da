"""A live trainer-sink consumer for the chaos soak: receives TRAJ, "trains", commits each batch.

It stands in for a trainer: ``LiveSource`` on TRAJ, a short pause per batch (the training
step), then a confirmed ``ack`` of the batch (the commit). Everything it sees goes to an
append-only journal the auditor reads after the soak, one record a line:

    started <pid> <time>
    delivered <traj seq> <delivery count> <trajectory id> <time>
    committing <batch> <traj seq>,<traj seq>,... <time>
    committed <batch> <time>
    abandoned <batch> <time>     the ack was never confirmed: released, JetStream delivers it again

(times: Unix seconds, to line the journal up with the soak's faults).

``committing`` is fsynced before the ack and ``committed`` after it is confirmed, so a line
``committed`` means JetStream confirmed the acks before this process could have been killed:
a delivery of one of its sequences after that line is a redelivery after commit. Each record is
one ``write`` on an ``O_APPEND`` descriptor, so a SIGKILL never leaves half a line.

    python -m tests.chaos.sink_consumer --url nats://... --journal J --run soak
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import random
import signal
import time
from collections.abc import Sequence
from pathlib import Path

from eventlog import LogSettings
from schemas.errors import EventLogUnavailable
from trainer_sink import LiveSource, LiveSourceSettings, Received

log = logging.getLogger("soak.sink")

# Short waits: the soak kills this process every minute or so, and what it held uncommitted
# must come back within seconds, not the 10 minutes a real trainer's step may take.
SINK_SETTINGS = LiveSourceSettings(
    durable="soak-sink", fetch_batch=16, max_ack_pending=512, ack_wait_s=8.0, ack_timeout_s=2.0
)
# A killed nats-server is noticed at once (the socket closes); a hung one within ~1.5 s.
SINK_LOG = LogSettings(ping_interval_s=0.5, max_outstanding_pings=2, connect_timeout_s=1.0)
ACK_TRIES = 20


class Journal:
    """The append-only record of deliveries and commits."""

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, lines: Sequence[str], *, sync: bool = False) -> None:
        now = f"{time.time():.3f}"
        os.write(self._fd, "".join(f"{line} {now}\n" for line in lines).encode())
        if sync:
            os.fsync(self._fd)

    def close(self) -> None:
        os.close(self._fd)


async def connect(url: str, run: str, stopping: asyncio.Event) -> LiveSource | None:
    """The live source, retried while the log is down (None once asked to stop)."""
    while not stopping.is_set():
        try:
            return await LiveSource.connect(url, SINK_SETTINGS, log_settings=SINK_LOG, run=run)
        except EventLogUnavailable as exc:
            log.warning("cannot connect yet: %s", exc)
            await asyncio.sleep(0.5)
    return None


async def commit(source: LiveSource, items: list[Received]) -> bool:
    """Ack every item with confirmation, one at a time so a retry re-sends only the rest. After
    ``ACK_TRIES`` the rest is released, as the sink's contract asks of a trainer that gives up
    ("commit again or release the batch"): held, it would be kept alive and never delivered
    again (a soak in make test lost 15 so, 2026-11-26)."""
    left = list(items)
    for _ in range(ACK_TRIES):
        try:
            while left:
                await source.ack(left[:1])
                left.pop(0)
            return True
        except EventLogUnavailable as exc:
            log.warning("commit not confirmed yet (%d left): %s", len(left), exc)
            await asyncio.sleep(0.5)
    await source.nak(left)  # a failed nak is logged: unkept, they come back after ack_wait_s
    return False


async def consume(url: str, journal: Journal, run: str, seed: int) -> None:
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stopping.set)
    rng = random.Random(f"{seed}-{os.getpid()}")
    journal.write([f"started {os.getpid()}"], sync=True)
    source = await connect(url, run, stopping)
    if source is None:
        return
    batches = 0
    try:
        while not stopping.is_set():
            try:
                items = await source.receive(SINK_SETTINGS.fetch_batch, 1.0) or []
            except EventLogUnavailable as exc:
                log.warning("receive: %s", exc)
                await asyncio.sleep(0.5)
                continue
            if not items:
                continue
            journal.write(
                [
                    f"delivered {item.seq} {_deliveries(item)} {item.trajectory.trajectory_id}"
                    for item in items
                ]
            )
            await asyncio.sleep(rng.uniform(0.0, 0.2))  # the training step
            batches += 1
            batch = f"{os.getpid()}-{batches}"
            seqs = ",".join(str(item.seq) for item in items)
            journal.write([f"committing {batch} {seqs}"], sync=True)
            if await commit(source, items):
                journal.write([f"committed {batch}"], sync=True)
            else:
                journal.write([f"abandoned {batch}"], sync=True)
    finally:
        with contextlib.suppress(EventLogUnavailable, OSError):
            await source.close()


def _deliveries(item: Received) -> int:
    return item.handle.delivery if item.handle is not None else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--journal", type=Path, required=True)
    parser.add_argument("--run", required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    journal = Journal(args.journal)
    try:
        asyncio.run(consume(args.url, journal, args.run, args.seed))
    finally:
        journal.close()


if __name__ == "__main__":
    main()
