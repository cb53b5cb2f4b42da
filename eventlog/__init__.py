"""The event log runtime: embedded nats-server, connection, provisioning, publisher, outbox."""

from eventlog.config import LogSettings, PublisherSettings, StreamNames, check_retry_horizon
from eventlog.connection import connect
from eventlog.errors import ServerCrashLoop, StoreInUse
from eventlog.loop import ACK, HOLD, BatchHandler, Delivery, Handler, Outcome, PullLoop, Reject
from eventlog.outbox import Outbox, OutboxRecord
from eventlog.provision import ProvisionAction, provision
from eventlog.publisher import JetStreamPublisher, Publisher, PublisherStats, PublishReceipt
from eventlog.pull import FetchSizer, PullConsumer, fetch, release
from eventlog.reader import StoredMessage, read_session, read_session_messages
from eventlog.server import NatsServer, find_nats_server, free_port
from eventlog.supervisor import supervise, supervised

__all__ = [
    "ACK",
    "HOLD",
    "BatchHandler",
    "Delivery",
    "FetchSizer",
    "Handler",
    "JetStreamPublisher",
    "LogSettings",
    "NatsServer",
    "Outbox",
    "OutboxRecord",
    "Outcome",
    "ProvisionAction",
    "PublishReceipt",
    "Publisher",
    "PublisherSettings",
    "PublisherStats",
    "PullConsumer",
    "PullLoop",
    "Reject",
    "ServerCrashLoop",
    "StoreInUse",
    "StoredMessage",
    "StreamNames",
    "check_retry_horizon",
    "connect",
    "fetch",
    "find_nats_server",
    "free_port",
    "provision",
    "read_session",
    "read_session_messages",
    "release",
    "supervise",
    "supervised",
]
