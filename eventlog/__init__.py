"""The event log runtime: embedded nats-server, connection, provisioning, publisher, outbox."""

from eventlog.config import LogSettings, PublisherSettings, StreamNames, check_retry_horizon
from eventlog.connection import connect
from eventlog.outbox import Outbox, OutboxRecord
from eventlog.provision import ProvisionAction, provision
from eventlog.publisher import JetStreamPublisher, Publisher, PublisherStats, PublishReceipt
from eventlog.pull import (
    FetchSizer,
    PullConsumer,
    delivery_count,
    fetch,
    keep_alive,
    release,
    stream_seq,
)
from eventlog.reader import StoredMessage, read_session, read_session_messages
from eventlog.server import NatsServer, find_nats_server, free_port

__all__ = [
    "FetchSizer",
    "JetStreamPublisher",
    "LogSettings",
    "NatsServer",
    "Outbox",
    "OutboxRecord",
    "ProvisionAction",
    "PublishReceipt",
    "Publisher",
    "PublisherSettings",
    "PublisherStats",
    "PullConsumer",
    "StoredMessage",
    "StreamNames",
    "check_retry_horizon",
    "connect",
    "delivery_count",
    "fetch",
    "find_nats_server",
    "free_port",
    "keep_alive",
    "provision",
    "read_session",
    "read_session_messages",
    "release",
    "stream_seq",
]
