"""Connecting to NATS: fast failure detection, endless reconnects, errors logged.

nats-py's defaults suit a chat client, not a log writer: a ping every 120 s means a hung server
(SIGSTOP, a frozen VM, a dead link with no RST) goes unnoticed for minutes. We ping every few
seconds and reconnect forever; publishers retry with the same Msg-Id meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import nats
import nats.errors
from nats.aio.client import Client as NATS

from eventlog.config import LogSettings
from schemas.errors import EventLogUnavailable

__all__ = ["close_connection", "connect"]

log = logging.getLogger(__name__)

_RECONNECT_WAIT_S = 0.25


async def connect(
    url: str,
    settings: LogSettings | None = None,
    *,
    name: str = "turnstream",
    on_reconnect: Callable[[], Awaitable[None]] | None = None,
) -> NATS:
    """Connect to ``url`` (comma-separated for a cluster), or raise EventLogUnavailable."""
    settings = settings or LogSettings()

    async def error_cb(exc: Exception) -> None:
        log.warning("nats %s: %s: %s", name, type(exc).__name__, exc)

    client: list[NATS] = []  # set once connected; the callbacks need it to tell close from loss

    async def disconnected_cb() -> None:
        if client and (client[0].is_closed or client[0].is_draining):
            return  # a close() we asked for
        log.warning("nats %s: disconnected from %s; reconnecting", name, url)

    async def reconnected_cb() -> None:
        log.info("nats %s: reconnected", name)
        if on_reconnect is not None:
            await on_reconnect()

    # The first connect must fail fast with a clear error when nothing listens; once connected,
    # reconnect forever. nats-py reads this option on every attempt, so we lift it afterwards.
    first_attempts = max(1, round(settings.connect_wait_s / _RECONNECT_WAIT_S))
    try:
        nc = await nats.connect(
            servers=[u.strip() for u in url.split(",") if u.strip()],
            name=name,
            ping_interval=settings.ping_interval_s,
            max_outstanding_pings=settings.max_outstanding_pings,
            connect_timeout=settings.connect_timeout_s,
            allow_reconnect=True,
            max_reconnect_attempts=first_attempts,
            reconnect_time_wait=_RECONNECT_WAIT_S,
            # While reconnecting, publishes are buffered up to this size; it must hold at least
            # a few max-size events or a retry during an outage fails instead of waiting.
            pending_size=4 * settings.max_payload,
            error_cb=error_cb,
            disconnected_cb=disconnected_cb,
            reconnected_cb=reconnected_cb,
        )
    except Exception as exc:  # nats raises several unrelated types for "could not connect"
        raise EventLogUnavailable(
            f"cannot connect to NATS at {url}: {exc or type(exc).__name__}. Start one with "
            f"`turnstream up` (embedded) or check --log.url"
        ) from exc
    nc.options["max_reconnect_attempts"] = -1
    client.append(nc)
    return nc


async def close_connection(nc: NATS) -> None:
    """Drain (flush what is buffered, let subscriptions finish), bounded: then just close."""
    try:
        async with asyncio.timeout(5.0):
            await nc.drain()
    except (TimeoutError, OSError, nats.errors.Error):
        with contextlib.suppress(OSError, nats.errors.Error):
            await nc.close()
