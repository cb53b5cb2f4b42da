"""Errors of the log client beyond the shared ones (``schemas.errors``).

    TurnstreamError                  (schemas.errors)
    └── EventLogError                (schemas.errors)
        ├── EventLogUnavailable      (schemas.errors) the log did not answer: retry
        │   └── LogStoreFull         JetStream refused a publish for want of storage (its
        │                            store's disk or max_file_store is full): retry once
        │                            space returns
        ├── ProvisioningError        (schemas.errors) JetStream refused a configuration
        ├── PublishForbidden         the log refused a publish: these credentials' role may not
        │                            write that subject (permissions violation); never spooled
        ├── AppendRefused            an append's expectation (the last sequence on its subjects)
        │                            was stale: the caller must catch up; never retried/spooled
        ├── ImageMissing             an image named by an event is not in the image bucket
        │                            (expired, deleted): permanent, dead-lettered
        └── ImageAltered             the bytes stored under an image's digest are not what the
                                     digest names: permanent, dead-lettered

Operating an embedded server has its own (``eventlog.server.errors``: StoreInUse,
ServerCrashLoop, LogSecurityError), as has the shard store (``shardstore.errors``).

nats-py's errors never leave this package: the pull loop, the readers, the buckets and the
publisher raise ``EventLogUnavailable`` (transient) or ``ProvisioningError`` (a configuration
JetStream refused) with the nats error as the cause.
"""

from __future__ import annotations

from schemas.errors import EventLogError, EventLogUnavailable

__all__ = ["AppendRefused", "ImageAltered", "ImageMissing", "LogStoreFull", "PublishForbidden"]


class LogStoreFull(EventLogUnavailable):
    """JetStream had no room for a publish (err_code 10023 / 10047): nothing was stored.
    Transient like any outage of the log: the same publish goes through once space returns,
    so a worker retries it, a gateway answers 503 with Retry-After, an outbox spools it."""

    reason = "log_store_full"


class PublishForbidden(EventLogError):
    """The log refused a publish because the connection's user may not publish there."""

    reason = "publish_forbidden"
    # Not permanent: the same message goes through once the credentials or the server's
    # permissions are fixed, so a worker retries it instead of dead-lettering good data.


class AppendRefused(EventLogError):
    """The log refused an append because the caller's ``Expectation`` was stale: messages were
    stored on ``subjects`` after ``expected_seq`` (the last is at ``last_seq``; None if the
    server's answer did not say). Retrying the same append cannot help: the caller reads what
    follows ``expected_seq`` (``eventlog.reader.read_session_after``), applies it, and appends
    again with the new expectation.

    ``after_retry``: an earlier try of this same publish got no ack. The publisher looks for
    ``msg_id`` after ``expected_seq`` then, and answers a receipt if it had landed; raised with
    ``after_retry``, it had not, unless that look-up failed (the log stopped answering; logged):
    a caller that finds ``msg_id`` in its catch-up read takes it as appended.
    """

    reason = "append_refused"

    def __init__(
        self,
        msg_id: str,
        subjects: str,
        expected_seq: int,
        last_seq: int | None,
        after_retry: bool = False,
    ) -> None:
        self.msg_id = msg_id
        self.subjects = subjects
        self.expected_seq = expected_seq
        self.last_seq = last_seq
        self.after_retry = after_retry
        now = f"is at {last_seq}" if last_seq is not None else "has moved on"
        super().__init__(
            f"the log refused {msg_id}: it expected the last message on {subjects} at stream "
            f"sequence {expected_seq}, but that {now}; read the events after {expected_seq}, "
            f"apply them and append again"
        )


class ImageMissing(EventLogError):
    """The image bucket holds no object (or no data) under ``digest``. The gateway stores a
    turn's images before the event that names them, so an event naming a missing one outlived
    it or was written by someone else: handling it again cannot help."""

    reason = "image_missing"
    permanent = True

    def __init__(self, digest: str, bucket: str, why: str = "no object of that name") -> None:
        self.digest = digest
        self.bucket = bucket
        super().__init__(
            f"image sha256:{digest} is not in the log's image bucket {bucket} ({why}): it "
            f"expired (images outlive the events that name them: was the bucket's max age "
            f"lowered?) or was deleted; the event naming it cannot be used"
        )


class ImageAltered(EventLogError):
    """The bytes the image bucket holds under ``digest`` do not hash to it: changed behind
    the store's back (written with another client), so not the image the event named."""

    reason = "image_altered"
    permanent = True

    def __init__(self, digest: str, bucket: str, why: str) -> None:
        self.digest = digest
        self.bucket = bucket
        super().__init__(
            f"image sha256:{digest} in the log's image bucket {bucket} is not what its name "
            f"says ({why}): it was changed by something other than turnstream; the event "
            f"naming it cannot be used until the right bytes are stored again (a put of them "
            f"repairs it)"
        )
