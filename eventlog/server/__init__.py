"""Operating an embedded nats-server: process, store lock, supervisor, security, permissions."""

from eventlog.errors import LogSecurityError, ServerCrashLoop, StoreInUse
from eventlog.server.permissions import (
    ROLE_DUTIES,
    ROLES,
    Permissions,
    Role,
    authorization_block,
    role_permissions,
)
from eventlog.server.process import NatsServer, find_nats_server, free_port, free_ports
from eventlog.server.security import LogSecurity, RoleCredentials, ensure_log_security
from eventlog.server.store_lock import LOCK_NAME, StoreLock, pid_alive, read_holder
from eventlog.server.supervisor import supervise, supervised

__all__ = [
    "LOCK_NAME",
    "ROLES",
    "ROLE_DUTIES",
    "LogSecurity",
    "LogSecurityError",
    "NatsServer",
    "Permissions",
    "Role",
    "RoleCredentials",
    "ServerCrashLoop",
    "StoreInUse",
    "StoreLock",
    "authorization_block",
    "ensure_log_security",
    "find_nats_server",
    "free_port",
    "free_ports",
    "pid_alive",
    "read_holder",
    "role_permissions",
    "supervise",
    "supervised",
]
