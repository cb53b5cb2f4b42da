"""The event log runtime: embedded nats-server, connection, provisioning, publisher, outbox."""

from schemas.log.config import LogSettings, PublisherSettings, StreamNames, check_retry_horizon
from schemas.log.connection import connect
from schemas.log.outbox import Outbox, OutboxRecord
from schemas.log.provision import ProvisionAction, provision
from schemas.log.publisher import JetStreamPublisher, Publisher, PublisherStats, PublishReceipt
from schemas.log.pull import (
    FetchSizer,
    PullConsumer,
    delivery_count,
    fetch,
    keep_alive,
    release,
    stream_seq,
)
from schemas.log.reader import StoredMessage, read_session, read_session_messages
from schemas.log.server import NatsServer, find_nats_server, free_port

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
