"""The event log runtime: embedded nats-server, connection, provisioning, publisher, outbox."""

from eventlog.config import LogSettings, PublisherSettings, StreamNames, check_retry_horizon
from eventlog.connection import answered, connect
from eventlog.errors import PublishForbidden
from eventlog.loop import ACK, HOLD, BatchHandler, Delivery, Handler, Outcome, PullLoop, Reject
from eventlog.outbox import Outbox, OutboxRecord
from eventlog.provision import ProvisionAction, provision
from eventlog.publisher import JetStreamPublisher, Publisher, PublisherStats, PublishReceipt
from eventlog.pull import ConsumerSpec
from eventlog.reader import StoredMessage, read_session, read_session_messages

__all__ = [
    "ACK",
    "HOLD",
    "BatchHandler",
    "ConsumerSpec",
    "Delivery",
    "Handler",
    "JetStreamPublisher",
    "LogSettings",
    "Outbox",
    "OutboxRecord",
    "Outcome",
    "ProvisionAction",
    "PublishForbidden",
    "PublishReceipt",
    "Publisher",
    "PublisherSettings",
    "PublisherStats",
    "PullLoop",
    "Reject",
    "StoredMessage",
    "StreamNames",
    "answered",
    "check_retry_horizon",
    "connect",
    "provision",
    "read_session",
    "read_session_messages",
]
