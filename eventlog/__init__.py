"""The event log runtime: embedded nats-server, connection, provisioning, publisher, outbox."""

from eventlog.config import LogSettings, PublisherSettings, StreamNames, check_retry_horizon
from eventlog.connection import answered, connect
from eventlog.errors import LogSecurityError, PublishForbidden, ServerCrashLoop, StoreInUse
from eventlog.loop import ACK, HOLD, BatchHandler, Delivery, Handler, Outcome, PullLoop, Reject
from eventlog.outbox import Outbox, OutboxRecord
from eventlog.permissions import ROLES, Role
from eventlog.provision import ProvisionAction, provision
from eventlog.publisher import JetStreamPublisher, Publisher, PublisherStats, PublishReceipt
from eventlog.pull import FetchSizer, PullConsumer, fetch, release
from eventlog.reader import StoredMessage, read_session, read_session_messages
from eventlog.security import LogSecurity, ensure_log_security
from eventlog.server import NatsServer, find_nats_server, free_port, free_ports
from eventlog.supervisor import supervise, supervised

__all__ = [
    "ACK",
    "HOLD",
    "ROLES",
    "BatchHandler",
    "Delivery",
    "FetchSizer",
    "Handler",
    "JetStreamPublisher",
    "LogSecurity",
    "LogSecurityError",
    "LogSettings",
    "NatsServer",
    "Outbox",
    "OutboxRecord",
    "Outcome",
    "ProvisionAction",
    "PublishForbidden",
    "PublishReceipt",
    "Publisher",
    "PublisherSettings",
    "PublisherStats",
    "PullConsumer",
    "PullLoop",
    "Reject",
    "Role",
    "ServerCrashLoop",
    "StoreInUse",
    "StoredMessage",
    "StreamNames",
    "answered",
    "check_retry_horizon",
    "connect",
    "ensure_log_security",
    "fetch",
    "find_nats_server",
    "free_port",
    "free_ports",
    "provision",
    "read_session",
    "read_session_messages",
    "release",
    "supervise",
    "supervised",
]
