"""Errors of the shard store; pyarrow's filesystem errors are translated into these in
``shardstore.store``, and each names the shard's path.

    TurnstreamError                  (schemas.errors)
    └── ShardStoreError              the shard target (a directory, s3://...) failed
        ├── ShardWriteFailed         a shard could not be written: nothing was acked, so its
        │                            trajectories are redelivered; fix the target and restart
        └── ShardUnreadable          a committed shard's footer or sequences cannot be read
"""

from __future__ import annotations

from schemas.errors import TurnstreamError

__all__ = ["ShardStoreError", "ShardUnreadable", "ShardWriteFailed"]


class ShardStoreError(TurnstreamError):
    """The shard target failed (pyarrow filesystem errors, translated at the store)."""

    reason = "shard_store_error"
    fatal = True  # the writer stops; what it had not acked goes to the next one


class ShardWriteFailed(ShardStoreError):
    """A shard could not be written and committed."""


class ShardUnreadable(ShardStoreError):
    """A committed shard whose footer or sequence column cannot be read."""
