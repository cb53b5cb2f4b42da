"""Errors of the log client beyond the shared ones (``schemas.errors``).

    TurnstreamError                  (schemas.errors)
    └── EventLogError                (schemas.errors)
        ├── EventLogUnavailable      (schemas.errors) the log did not answer: retry
        ├── ProvisioningError        (schemas.errors) JetStream refused a configuration
        └── PublishForbidden         the log refused a publish: these credentials' role may not
                                     write that subject (permissions violation); never spooled

Operating an embedded server has its own (``eventlog.server.errors``: StoreInUse,
ServerCrashLoop, LogSecurityError), as has the shard store (``shardstore.errors``).

nats-py's errors never leave this package: the pull loop, the readers, the buckets and the
publisher raise ``EventLogUnavailable`` (transient) or ``ProvisioningError`` (a configuration
JetStream refused) with the nats error as the cause.
"""

from __future__ import annotations

from schemas.errors import EventLogError

__all__ = ["PublishForbidden"]


class PublishForbidden(EventLogError):
    """The log refused a publish because the connection's user may not publish there."""

    reason = "publish_forbidden"
    # Not permanent: the same message goes through once the credentials or the server's
    # permissions are fixed, so a worker retries it instead of dead-lettering good data.
