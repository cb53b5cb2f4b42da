"""Following PolicyUpdated: the trainer updates the served policy through the log alone (§3).

The trainer puts ``{"version": int, "checkpoint": "/abs/path"}`` under the run's key in the
``ts_policy`` KV bucket. ``watch_policy`` follows that key and has the backend load every version
newer than the one it serves. Starting the watch delivers the key's current value first, so a
gateway (re)started mid-run catches up before it serves many turns on stale weights.

An entry without a checkpoint says the trainer updated its inference servers itself (verl syncs
its vLLM servers in place): ``PolicyVersion`` (remote backends) takes the version; a backend that
holds its own weights refuses it in ``load_weights``, and keeps serving what it has.

What to do with an entry is decided by the pure ``decide`` below; the loop only fetches and acts.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

from eventlog import Bucket
from gateway.core.versions import VersionTimeline
from schemas.errors import EventLogUnavailable
from schemas.policy import PolicyUpdate, UpdateMode, parse_policy_update

__all__ = ["PolicyTarget", "decide", "watch_policy"]

logger = logging.getLogger(__name__)


@runtime_checkable
class PolicyTarget(Protocol):
    """What a backend must offer to follow the trainer's policy (one that holds its own weights,
    ``local``; a remote backend does not, and the gateway follows the version for it)."""

    @property
    def id(self) -> str: ...

    @property
    def weight_version(self) -> int: ...

    async def load_weights(
        self, checkpoint: Path | None, version: int, mode: UpdateMode = "wait"
    ) -> None:
        """Serve ``version`` from now on. ``checkpoint`` None: the trainer already put those
        weights into the inference servers; a target that holds weights of its own raises.
        ``mode``: what becomes of the generations in flight (``schemas.policy``)."""
        ...


Decision = Literal["load", "ignore"]


def decide(current_version: int, update: PolicyUpdate) -> Decision:
    """Load only what moves the policy forward: the bucket keeps history and a redelivered or
    late older entry must not roll the weights back."""
    return "load" if update.version > current_version else "ignore"


async def watch_policy(
    kv: Bucket,
    run: str,
    target: PolicyTarget,
    *,
    retry_delay_s: float = 1.0,
    timeline: VersionTimeline | None = None,
) -> None:
    """Follow ``run``'s key in the KV bucket ``kv``  until cancelled; each version the target
    takes goes into ``timeline`` with the log's time stamp of its entry (``gateway.core.versions``:
    tokens that arrived after it are not attributed to an older version).

    A value that does not parse, a checkpoint that does not load, or an entry without a
    checkpoint for a backend that holds its own weights is logged and skipped; the backend keeps
    serving the version it has. If the watch itself fails (the broker is unreachable), it is
    re-established after ``retry_delay_s``.
    """
    while True:
        try:
            async for entry in kv.watch(run):  # deletes carry no version to go to: skipped
                await _apply(entry.value, entry.revision, run, target)
                if timeline is not None:
                    timeline.learned(target.weight_version, entry.created_at)
        except EventLogUnavailable as exc:
            logger.warning(
                "cannot watch policy key %r for backend %s, retrying in %.1fs: %s",
                run,
                target.id,
                retry_delay_s,
                exc,
            )
        # The watch only ends when it failed or was stopped under us: watch again.
        await asyncio.sleep(retry_delay_s)


async def _apply(raw: bytes, revision: int, run: str, target: PolicyTarget) -> None:
    try:
        update = parse_policy_update(raw)
    except ValueError as exc:
        logger.warning("ignoring policy entry %d of run %r: %s", revision, run, exc)
        return
    if decide(target.weight_version, update) == "ignore":
        logger.info(
            "run %r policy version %d is not newer than backend %s's %d; ignored",
            run,
            update.version,
            target.id,
            target.weight_version,
        )
        return
    try:
        await target.load_weights(update.checkpoint, update.version, update.mode)
    except Exception as exc:  # keep serving the weights we have; the next version may load
        logger.error(
            "backend %s could not load run %r policy version %d (%s): %s",
            target.id,
            run,
            update.version,
            _source(update),
            exc,
        )
        return
    logger.info(
        "backend %s now serves run %r policy version %d (%s)",
        target.id,
        run,
        update.version,
        _source(update),
    )


def _source(update: PolicyUpdate) -> str:
    if update.checkpoint is None:
        return "no checkpoint: the trainer updated the inference servers itself"
    return f"checkpoint {update.checkpoint}"


class PolicyVersion:
    """A PolicyTarget for backends whose weights a trainer updates directly (vLLM, SGLang):
    the gateway only follows the version, so each turn records the policy that served it. The
    entry's checkpoint, if any, is not this gateway's to load."""

    def __init__(self, version: int = 0) -> None:
        self._version = version

    @property
    def id(self) -> str:
        return "policy-version"

    @property
    def weight_version(self) -> int:
        return self._version

    async def load_weights(
        self, checkpoint: Path | None, version: int, mode: UpdateMode = "wait"
    ) -> None:
        self._version = version  # the trainer paused its servers itself: the mode is its own
