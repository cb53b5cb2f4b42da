"""Errors of the event-log runtime beyond the shared ones (``schemas.errors``).

    TurnstreamError                  (schemas.errors)
    ├── EventLogError                (schemas.errors)
    │   ├── StoreInUse               another nats-server (or the process starting one) holds
    │   │                            the JetStream store's lock; the message names its PIDs
    │   ├── ServerCrashLoop          an embedded nats-server kept dying: restarted its allowed
    │   │                            number of times within the window; its log tail is shown
    │   ├── PublishForbidden         the log refused a publish: these credentials' role may not
    │   │                            write that subject (permissions violation); never spooled
    │   └── LogSecurityError         the embedded log's CA, certificates or role credentials
    │                                (``--log.secure``) cannot be made or read; names the file
    └── ShardStoreError              the shard target (a directory, s3://...) failed
        ├── ShardWriteFailed         a shard could not be written: nothing was acked, so its
        │                            trajectories are redelivered; fix the target and restart
        └── ShardUnreadable          a committed shard's footer or sequences cannot be read

Shard errors name the shard's path. nats-py's errors never leave this package: the pull loop,
the readers, the buckets and the publisher raise ``EventLogUnavailable`` (transient) or
``ProvisioningError`` (a configuration JetStream refused) with the nats error as the cause.
"""

from __future__ import annotations

from schemas.errors import EventLogError, TurnstreamError

__all__ = [
    "LogSecurityError",
    "PublishForbidden",
    "ServerCrashLoop",
    "ShardStoreError",
    "ShardUnreadable",
    "ShardWriteFailed",
    "StoreInUse",
]


class StoreInUse(EventLogError):
    """A JetStream store is locked by another server: two must never share one."""

    reason = "store_in_use"
    permanent = True  # retrying cannot help until the holder is stopped


class ServerCrashLoop(EventLogError):
    """An embedded nats-server died more often than its supervisor may restart it."""

    reason = "server_crash_loop"
    permanent = True


class ShardStoreError(TurnstreamError):
    """The shard target failed (pyarrow filesystem errors, translated at the store)."""

    reason = "shard_store_error"
    fatal = True  # the writer stops; what it had not acked goes to the next one


class ShardWriteFailed(ShardStoreError):
    """A shard could not be written and committed."""


class ShardUnreadable(ShardStoreError):
    """A committed shard whose footer or sequence column cannot be read."""


class PublishForbidden(EventLogError):
    """The log refused a publish because the connection's user may not publish there."""

    reason = "publish_forbidden"
    # Not permanent: the same message goes through once the credentials or the server's
    # permissions are fixed, so a worker retries it instead of dead-lettering good data.


class LogSecurityError(EventLogError):
    """The embedded log's security material (CA, certificates, role credentials) is unusable."""

    reason = "log_security"
    permanent = True
