"""The log client: connect to a NATS JetStream log, provision it, publish, read, consume.

nats.py is a library and the server someone else's process: this package is the client side
only, and the one place in turnstream that imports nats-py. Running a server of our own is
``eventlog.server``; the Parquet shards are ``shardstore``. What the other packages use:

- settings (``config``): ``LogSettings``, ``PublisherSettings``, ``ConsumerSettings``,
  ``StreamNames``; ``connection``: ``connect`` gives a ``Connection`` (its ``JetStream``
  API), ``map_nats_errors`` turns a direct request's nats errors into ours;
  ``provision`` makes the streams and buckets (an admin client's job, any server).
- publishing: the ``Publisher`` port and ``JetStreamPublisher`` (acked, retried with one
  Msg-Id, spooled to the ``Outbox``), an append's ``Expectation`` (refused:
  ``AppendRefused``); reading: ``read_session`` / ``read_session_messages`` (one session, direct
  get), ``read_session_after`` (what follows a sequence: a catch-up), the same as methods of a
  held ``DirectReader`` (one inbox subscription for every read: a process that reads often,
  like the gateway catching up, holds one), ``reader``'s scans
  (``read_subject``, ``read_range``, ``msg_id_counts``, ``stored_msg_ids``); ``follow``: a
  subject from now on.
- consuming: a ``ConsumerSpec`` run by the one ``PullLoop``; handlers take a ``Delivery`` and
  return an ``Outcome`` (``ACK``, ``HOLD``, ``Reject``); ``dispositions`` decides retries and
  dead letters, ``metrics`` counts them; ``commits`` (``CommitLedger``), ``seqset`` and
  ``streams`` (stream and consumer facts) serve the writers and sinks.
- consumer state: ``Bucket`` (JetStream KV, compare-and-set, ``watch``).
- images (``objects``): the ``ImageStore`` port and ``JetStreamImageStore`` (a JetStream object
  store bucket: put-if-absent by SHA-256, reads checked against the name; ``ImageMissing``,
  ``ImageAltered``), its retention following the events' (``ImageRetention``).

Errors: ``schemas.errors`` (``EventLogUnavailable``, ``ProvisioningError``) and ``errors``.
"""

from eventlog.buckets import Bucket, Entry
from eventlog.config import (
    ConsumerSettings,
    LogSettings,
    PublisherSettings,
    StreamNames,
    check_retry_horizon,
)
from eventlog.connection import (
    Connection,
    JetStream,
    answered,
    close_connection,
    connect,
    map_nats_errors,
)
from eventlog.direct import DirectReader
from eventlog.errors import (
    AppendRefused,
    ImageAltered,
    ImageMissing,
    LogStoreFull,
    PublishForbidden,
)
from eventlog.expectation import Expectation
from eventlog.follow import Following, follow
from eventlog.loop import ACK, HOLD, BatchHandler, Delivery, Handler, Outcome, PullLoop, Reject
from eventlog.objects import ImageInfo, ImageRetention, ImageStore, JetStreamImageStore
from eventlog.outbox import Outbox
from eventlog.provision import ProvisionAction, provision
from eventlog.publisher import JetStreamPublisher, Publisher, PublishReceipt
from eventlog.pull import ConsumerSpec
from eventlog.reader import (
    SessionTail,
    StoredMessage,
    read_session,
    read_session_after,
    read_session_messages,
)

__all__ = [
    "ACK",
    "HOLD",
    "AppendRefused",
    "BatchHandler",
    "Bucket",
    "Connection",
    "ConsumerSettings",
    "ConsumerSpec",
    "Delivery",
    "DirectReader",
    "Entry",
    "Expectation",
    "Following",
    "Handler",
    "ImageAltered",
    "ImageInfo",
    "ImageMissing",
    "ImageRetention",
    "ImageStore",
    "JetStream",
    "JetStreamImageStore",
    "JetStreamPublisher",
    "LogSettings",
    "LogStoreFull",
    "Outbox",
    "Outcome",
    "ProvisionAction",
    "PublishForbidden",
    "PublishReceipt",
    "Publisher",
    "PublisherSettings",
    "PullLoop",
    "Reject",
    "SessionTail",
    "StoredMessage",
    "StreamNames",
    "answered",
    "check_retry_horizon",
    "close_connection",
    "connect",
    "follow",
    "map_nats_errors",
    "provision",
    "read_session",
    "read_session_after",
    "read_session_messages",
]
