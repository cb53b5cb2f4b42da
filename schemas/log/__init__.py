"""The event log runtime: embedded nats-server, connection, provisioning, publisher, outbox."""

from schemas.log.config import LogSettings, PublisherSettings, StreamNames, check_retry_horizon
from schemas.log.connection import connect
from schemas.log.outbox import Outbox, OutboxRecord
from schemas.log.provision import ProvisionAction, provision
from schemas.log.publisher import JetStreamPublisher, Publisher, PublisherStats, PublishReceipt
from schemas.log.reader import StoredMessage, read_session, read_session_messages
from schemas.log.server import NatsServer, find_nats_server, free_port

__all__ = [
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
    "StoredMessage",
    "StreamNames",
    "check_retry_horizon",
    "connect",
    "find_nats_server",
    "free_port",
    "provision",
    "read_session",
    "read_session_messages",
]
