"""Errors shared by every turnstream package.

One root, two families: bad input in the wire format, and trouble with the event log itself.

    TurnstreamError
    ├── SchemaError                  bad input; never retried, dead-lettered with its reason
    │   ├── UndecodableEvent         bytes that are not a valid event (msgpack, type, fields)
    │   ├── UnsupportedSchemaVersion an event written by a newer turnstream
    │   ├── InvalidIdentifier        a run / session / key that is not [A-Za-z0-9_-]{1,64}
    │   ├── PayloadTooLarge          an encoded event over the configured size limit
    │   └── UntrustedEvent           an event the log holds but must not be believed: its
    │                                subject disagrees with it, it has no Msg-Id, or it
    │                                conflicts with an event stored before it
    └── EventLogError                the log (NATS JetStream) could not do what was asked
        ├── EventLogUnavailable      transient: no connection, timeout; retry later
        ├── OutboxFull               the on-disk outbox is at its byte limit; answer 503
        └── ProvisioningError        a stream or bucket exists with a conflicting config

Every error carries ``reason``, the code its dead letter is filed under, ``permanent``:
whether handling the same message again could ever succeed, and ``fatal``: the consumer itself
cannot go on (a shard target that cannot be written), so the pull loop ends instead of blaming
the message. The pull loop's ``disposition``
reads only these two, so a package adds a failure kind by subclassing, not by editing the loop.

Third-party errors (nats, msgspec) are translated into these at the adapter boundary, with the
original chained as ``__cause__``.
"""

from __future__ import annotations


class TurnstreamError(Exception):
    """Root of every error turnstream raises on purpose."""

    reason: str = "worker_error"  # the dead-letter reason code
    permanent: bool = False  # True: the same message would fail again; do not retry it
    fatal: bool = False  # True: not the message's fault; the consumer must stop (its target)


class SchemaError(TurnstreamError):
    """Input that does not follow the wire format: never retried."""

    reason = "undecodable"
    permanent = True


class UndecodableEvent(SchemaError):
    """Bytes that cannot be decoded into a known event."""


class UnsupportedSchemaVersion(SchemaError):
    """An event whose schema version this build cannot read."""

    reason = "unsupported_version"

    def __init__(self, version: int, supported: int, *, missing_upcaster: bool = False) -> None:
        self.version = version
        self.supported = supported
        if missing_upcaster:
            message = (
                f"event schema version v={version} is older than this build's v={supported} "
                f"and no upcaster from v={version} is registered; add one to the Codec"
            )
        else:
            message = (
                f"event schema version v={version} is newer than this build supports "
                f"(v<={supported}); upgrade turnstream to read it"
            )
        super().__init__(message)


class InvalidIdentifier(SchemaError):
    """A run, session or reward key that cannot be used in a NATS subject."""

    def __init__(self, field: str, value: object, pattern: str) -> None:
        self.field = field
        self.value = value
        super().__init__(
            f"{field}={value!r} is not a valid identifier: it must match {pattern} "
            f"(no '.', '*', '>' or spaces, at most 64 characters)"
        )


class PayloadTooLarge(SchemaError):
    """An encoded event larger than the log accepts."""

    reason = "payload_too_large"

    def __init__(self, what: str, size: int, limit: int) -> None:
        self.size = size
        self.limit = limit
        super().__init__(
            f"{what} is {size} bytes, over the {limit}-byte limit; raise max_payload "
            f"(nats-server and TURNSTREAM_LOG__MAX_PAYLOAD) or send smaller turns"
        )


class UntrustedEvent(SchemaError):
    """An event stored in the log that must not be folded (``reason`` says why)."""

    def __init__(self, reason: str, message: str) -> None:
        self.reason = reason
        super().__init__(message)


class EventLogError(TurnstreamError):
    """The event log failed to do what was asked."""

    reason = "log_refused"


class EventLogUnavailable(EventLogError):
    """The log did not answer in time or is not connected: transient, retry later."""

    reason = "log_unavailable"


class OutboxFull(EventLogError):
    """The on-disk outbox reached its byte limit while the log is unavailable."""


class ProvisioningError(EventLogError):
    """A stream or bucket could not be created or updated as configured."""
