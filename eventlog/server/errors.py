"""Errors of operating an embedded nats-server (the client's are ``eventlog.errors``).

EventLogError                    (schemas.errors)
├── StoreInUse                   another nats-server (or the process starting one) holds
│                                the JetStream store's lock; the message names its PIDs
├── ServerCrashLoop              an embedded nats-server kept dying: restarted its allowed
│                                number of times within the window; its log tail is shown
└── LogSecurityError             the embedded log's CA, certificates or role credentials
                                 (``--log.secure``) cannot be made or read; names the file
"""

from __future__ import annotations

from schemas.errors import EventLogError

__all__ = ["LogSecurityError", "ServerCrashLoop", "StoreInUse"]


class StoreInUse(EventLogError):
    """A JetStream store is locked by another server: two must never share one."""

    reason = "store_in_use"
    permanent = True  # retrying cannot help until the holder is stopped


class ServerCrashLoop(EventLogError):
    """An embedded nats-server died more often than its supervisor may restart it."""

    reason = "server_crash_loop"
    permanent = True


class LogSecurityError(EventLogError):
    """The embedded log's security material (CA, certificates, role credentials) is unusable."""

    reason = "log_security"
    permanent = True
