"""Errors of the event-log runtime beyond the shared ones (``schemas.errors``).

    TurnstreamError                  (schemas.errors)
    └── ShardStoreError              the shard target (a directory, s3://...) failed
        ├── ShardWriteFailed         a shard could not be written: nothing was acked, so its
        │                            trajectories are redelivered; fix the target and restart
        └── ShardUnreadable          a committed shard's footer or sequences cannot be read

Shard errors name the shard's path. nats-py's errors never leave this package: the pull loop,
the readers, the buckets and the publisher raise ``EventLogUnavailable`` (transient) or
``ProvisioningError`` (a configuration JetStream refused) with the nats error as the cause.
"""

from __future__ import annotations

from schemas.errors import TurnstreamError

__all__ = ["ShardStoreError", "ShardUnreadable", "ShardWriteFailed"]


class ShardStoreError(TurnstreamError):
    """The shard target failed (pyarrow filesystem errors, translated at the store)."""

    reason = "shard_store_error"


class ShardWriteFailed(ShardStoreError):
    """A shard could not be written and committed."""


class ShardUnreadable(ShardStoreError):
    """A committed shard whose footer or sequence column cannot be read."""
