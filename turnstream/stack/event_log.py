"""The log every command opens: the one at ``--log.url``, else a nats-server of its own
(embedded, supervised), provisioned either way."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from eventlog import Connection, JetStream, ProvisionAction, connect, provision
from eventlog.connection import close_connection
from eventlog.server import NatsServer, ensure_log_security, supervised
from schemas.errors import TurnstreamError
from turnstream.stack.settings import ServiceSettings

__all__ = ["EventLog", "open_log", "require_log_url"]

log = logging.getLogger(__name__)


@dataclass
class EventLog:
    nc: Connection
    js: JetStream
    url: str
    server: NatsServer | None  # None when connected to an external server
    provisioned: list[ProvisionAction]


def require_log_url(settings: ServiceSettings, command: str) -> None:
    """Consumers join an existing log: an embedded server of their own would hold nothing."""
    if settings.log.url is None:
        raise TurnstreamError(
            f"{command} needs the log's URL: --log.url nats://HOST:4222 (or TURNSTREAM_LOG__URL)"
        )


@contextlib.asynccontextmanager
async def open_log(
    settings: ServiceSettings, *, name: str, stop: asyncio.Event | None = None
) -> AsyncIterator[EventLog]:
    """Connect to ``settings.log.url``, or start an embedded nats-server; provision; yield.

    An embedded server is supervised while the block runs (restarted when it dies); if it keeps
    dying, ``stop`` is set and ``ServerCrashLoop`` is raised when the block ends.
    """
    server: NatsServer | None = None
    url = settings.log.url
    client = settings.log
    if url is None:
        security = ensure_log_security(settings.nats_auth_dir) if settings.log.secure else None
        server = NatsServer(
            settings.nats_store_dir,
            port=settings.log.port,
            max_payload=settings.log.max_payload,
            sync_always=settings.log.sync_always,
            extra_config=security.server_config(settings.log.names) if security else "",
        ).start()
        url = server.url
        if security is not None:
            # One connection serves every service in this process (up: gateway, workers,
            # shard writer), so it logs in as admin; the roles keep other processes apart.
            url = url.replace("nats://", "tls://", 1)
            client = security.client_settings(settings.log, "admin")
        log.info("embedded nats-server at %s, store %s", url, settings.nats_store_dir)
    try:
        nc = await connect(url, client, name=name)
        try:
            js = nc.jetstream()
            actions = await provision(js, settings.log)
            async with supervised(server, stop=stop) if server else contextlib.nullcontext():
                yield EventLog(nc, js, url, server, actions)
        finally:
            await close_connection(nc)
    finally:
        if server is not None:
            server.stop()
