"""Telling gateways which weight version they serve, for trainers that sync their own servers.

verl (and any trainer that pushes weights into its own vLLM/SGLang servers) has no checkpoint for
a gateway to load: after each weight sync it only needs every turn from then on to carry the new
version. ``publish_weight_version(log_url, run, version)`` puts PolicyUpdated without a
checkpoint (``schemas.policy``) under the run's key in ``ts_policy``; gateways in front of remote
backends follow it (``gateway.backends.policy_watch.PolicyVersion``) within milliseconds. Call it
after each sync: verl's trainer loop is synchronous, so ``publish_weight_version`` is too;
``publish_weight_version_async`` is the same for asyncio code, and ``put_weight_version`` for a
trainer that holds a connection already.

Versions only grow: gateways ignore an entry older than the one they serve (a redelivered or
late entry must not roll the weights back), so publishing an older version than the run's is
refused with ``WeightVersionError`` instead of being ignored in silence. Publishing the version
the run already has changes nothing (verl syncs version 0 before its first step).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging

from eventlog import LogSettings, connect
from eventlog.buckets import Bucket
from eventlog.connection import close_connection
from schemas.ids import validate_id
from schemas.policy import PolicyUpdate, encode_policy_update, parse_policy_update
from turnstream.integrations.errors import WeightVersionError

__all__ = ["publish_weight_version", "publish_weight_version_async", "put_weight_version"]

log = logging.getLogger(__name__)

_CONFLICT_TRIES = 5  # another writer changed the entry between our read and write


async def put_weight_version(bucket: Bucket, run: str, version: int) -> bool:
    """Make ``version`` the served weight version of ``run`` in ``bucket`` (``ts_policy``).

    True when written, False when the run is at ``version`` already. Raises
    ``WeightVersionError`` when the run is at a newer version, ``EventLogUnavailable`` when the
    log does not answer.
    """
    validate_id(run, "run")
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"a weight version is a non-negative integer, not {version!r}")
    for _ in range(_CONFLICT_TRIES):
        entry = await bucket.get(run)
        if entry is not None:
            try:
                current: PolicyUpdate | None = parse_policy_update(entry.value)
            except ValueError as exc:
                log.warning("replacing run %r's unreadable entry in %s: %s", run, bucket.name, exc)
                current = None
            if current is not None and current.version > version:
                raise WeightVersionError(
                    f"run {run!r} is at weight version {current.version} in {bucket.name}, "
                    f"newer than {version}: gateways ignore older versions and would go on "
                    f"recording {current.version} on every turn. Publish versions that only "
                    f"grow (verl's global_steps do, within one job); for a new training job use "
                    f"a new run, or delete the run's key in {bucket.name}"
                )
            if current is not None and current.version == version:
                return False
        # Compare-and-set: a concurrent writer's newer version must not be overwritten.
        written = await bucket.swap(
            run, encode_policy_update(PolicyUpdate(version)), entry.revision if entry else 0
        )
        if written is not None:
            log.info("run %r: weight version %d published in %s", run, version, bucket.name)
            return True
    raise WeightVersionError(
        f"run {run!r}'s entry in {bucket.name} kept changing under {_CONFLICT_TRIES} tries to "
        f"publish weight version {version}: is another trainer publishing for this run?"
    )


async def publish_weight_version_async(
    log_url: str, run: str, version: int, *, log_settings: LogSettings | None = None
) -> bool:
    """``put_weight_version`` on a connection of its own to ``log_url`` (``log_settings``:
    credentials and TLS, as every turnstream client takes them)."""
    settings = log_settings or LogSettings()
    nc = await connect(log_url, settings, name="turnstream-weight-version")
    try:
        bucket = await Bucket.open(nc.jetstream(), settings.names.policy_bucket)
        return await put_weight_version(bucket, run, version)
    finally:
        await close_connection(nc)


def publish_weight_version(
    log_url: str, run: str, version: int, *, log_settings: LogSettings | None = None
) -> bool:
    """``publish_weight_version_async`` for synchronous code (verl's trainer loop): blocks until
    the log holds the entry. Called from a thread that runs an event loop, it runs on a thread of
    its own rather than fail."""
    publish = publish_weight_version_async(log_url, run, version, log_settings=log_settings)
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # no loop in this thread: the usual case
        return asyncio.run(publish)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="weight-version") as pool:
        return pool.submit(asyncio.run, publish).result()
