"""Connecting to NATS: credentials and TLS, fast failure detection, endless reconnects.

nats-py's defaults suit a chat client, not a log writer: a ping every 120 s means a hung server
(SIGSTOP, a frozen VM, a dead link with no RST) goes unnoticed for minutes. We ping every few
seconds and reconnect forever; publishers retry with the same Msg-Id meanwhile.

A first connect that fails says why: the credentials were refused (and which setting holds
them), the server's certificate did not verify, or nothing answered.

Outside ``eventlog`` nothing imports nats-py: a caller holds a ``Connection`` and its
``JetStream`` (nats-py's own types under our names, for annotations and the odd direct
request), and wraps such a request in ``map_nats_errors`` so it raises our
``EventLogUnavailable``, never ``nats.errors.Error``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeAlias, TypeVar

import nats.errors
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js import errors as js_errors

from eventlog.config import LogSettings
from schemas.errors import EventLogUnavailable

__all__ = [
    "ANSWER_TRIES",
    "UNAVAILABLE",
    "Connection",
    "JetStream",
    "answered",
    "close_connection",
    "closed_socket_as_reset",
    "connect",
    "map_nats_errors",
    "reconnects",
]

log = logging.getLogger(__name__)

_RECONNECT_WAIT_S = 0.25
_PERMISSIONS = "permissions violation"

T = TypeVar("T")

Connection: TypeAlias = NATS
"""A connection to the log (``connect`` makes one)."""

JetStream: TypeAlias = JetStreamContext
"""The JetStream API over a ``Connection`` (``connection.jetstream()``)."""

UNAVAILABLE = (TimeoutError, nats.errors.Error, OSError)
"""What nats-py (its JetStream errors included) and the socket raise when the log does not
answer or refuses a request; translated into ``EventLogUnavailable``."""

ANSWER_TRIES = 3
"""How many times ``answered`` sends an idempotent request whose answer was lost."""


def _credentials(settings: LogSettings) -> dict[str, Any]:
    """nats-py's connect options for the one login method the settings give (validated)."""
    for flag, path in (("--log.nkey-seed", settings.nkey_seed), ("--log.creds", settings.creds)):
        if path is not None and not path.is_file():
            raise EventLogUnavailable(f"{flag}={path} does not exist or is not a file")
    if settings.user is not None and settings.password is not None:
        return {"user": settings.user, "password": settings.password.get_secret_value()}
    if settings.token is not None:
        return {"token": settings.token.get_secret_value()}
    if settings.nkey_seed is not None:
        return {"nkeys_seed": str(settings.nkey_seed)}
    if settings.creds is not None:
        return {"user_credentials": str(settings.creds)}
    return {}


def _tls_context(settings: LogSettings) -> ssl.SSLContext | None:
    """The TLS context for ``settings``' CA and client certificate; None: nats-py's default
    (the system's CAs, used when the server requires TLS)."""
    if settings.tls_ca is None and settings.tls_cert is None:
        return None
    try:
        context = ssl.create_default_context(
            cafile=str(settings.tls_ca) if settings.tls_ca is not None else None
        )
    except OSError as exc:  # ssl.SSLError included: a file that is no PEM certificate
        raise EventLogUnavailable(f"cannot load --log.tls-ca={settings.tls_ca}: {exc}") from exc
    if settings.tls_cert is not None:
        try:
            context.load_cert_chain(settings.tls_cert, settings.tls_key)
        except OSError as exc:
            raise EventLogUnavailable(
                f"cannot load the client certificate --log.tls-cert={settings.tls_cert} with "
                f"--log.tls-key={settings.tls_key}: {exc}"
            ) from exc
    return context


def _login(settings: LogSettings) -> tuple[str | None, str]:
    """Who this client says it is, and the settings that say so (for error messages)."""
    if settings.user is not None:
        return f"of user {settings.user!r}", "--log.user and --log.password"
    if settings.token is not None:
        return "of the token", "--log.token"
    if settings.nkey_seed is not None:
        return f"in {settings.nkey_seed}", "--log.nkey-seed"
    if settings.creds is not None:
        return f"in {settings.creds}", "--log.creds"
    return (
        None,
        "--log.user and --log.password (or --log.token, --log.nkey-seed, --log.creds); "
        "`turnstream nats --log.secure` prints where each role's are",
    )


def _why_refused(url: str, settings: LogSettings, errors: list[Exception]) -> str | None:
    """The reason of a failed first connect when the server answered but would not have us."""
    for exc in reversed(errors):
        text = str(exc).lower()
        if isinstance(exc, nats.errors.AuthorizationError) or "authorization violation" in text:
            who, where = _login(settings)
            if who is None:
                return f"the log at {url} requires credentials and none were given: pass {where}"
            return (
                f"the log at {url} refused the credentials {who} (authorization violation): "
                f"check {where}"
            )
        if isinstance(exc, ssl.SSLCertVerificationError):
            ca = f" (now {settings.tls_ca})" if settings.tls_ca is not None else ""
            return (
                f"the TLS certificate of the log at {url} did not verify ({exc.verify_message}): "
                f"pass the CA that signed it with --log.tls-ca{ca}, and --log.tls-server-name "
                f"if it names another host than the URL"
            )
        if isinstance(exc, ssl.SSLError) and not isinstance(
            exc,
            ssl.SSLEOFError | ssl.SSLZeroReturnError,  # a cut connection, not a refusal
        ):
            return (
                f"TLS with the log at {url} failed ({exc}): check --log.tls-ca, and "
                f"--log.tls-cert/--log.tls-key if the server verifies clients"
            )
    return None


async def connect(
    url: str,
    settings: LogSettings | None = None,
    *,
    name: str = "turnstream",
    on_reconnect: Callable[[], Awaitable[None]] | None = None,
) -> NATS:
    """Connect to ``url`` (comma-separated for a cluster), or raise EventLogUnavailable."""
    settings = settings or LogSettings()
    credentials = _credentials(settings)
    tls = _tls_context(settings)
    client: list[NATS] = []  # set once connected; the callbacks need it to tell close from loss
    first_errors: list[Exception] = []  # why the first connect's attempts failed
    hopeless = asyncio.Event()  # the first connect was refused: no retry can help

    async def error_cb(exc: Exception) -> None:
        if not client:
            first_errors[:] = [*first_errors[-3:], exc]
            if _why_refused(url, settings, [exc]) is not None:
                hopeless.set()
        if _PERMISSIONS in str(exc).lower():
            # The server refused one publish or subscription and kept the connection: these
            # credentials' role may not do that (eventlog.server.permissions lists each role's
            # rights).
            who, _ = _login(settings)
            log.error(
                "nats %s: refused to the credentials %s: %s", name, who or "(none given)", exc
            )
            return
        log.warning("nats %s: %s: %s", name, type(exc).__name__, exc)

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
    options: dict[str, Any] = dict(  # nats-py annotates its float options as int
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
        tls=tls,
        tls_hostname=settings.tls_server_name,
        **credentials,
    )
    nc = NATS()
    attempt = asyncio.create_task(nc.connect(**options), name=f"nats-connect-{name}")
    # Refused credentials or an untrusted certificate will not change within the first
    # connect's tries: stop at the first. After a failed TLS handshake nats-py's connect never
    # returns at all (nats.py issue #718), so the tries are also bounded by a deadline.
    refused = asyncio.create_task(hopeless.wait())
    deadline = settings.connect_wait_s + settings.connect_timeout_s + 1.0
    try:
        await asyncio.wait({attempt, refused}, timeout=deadline, return_when="FIRST_COMPLETED")
    finally:
        refused.cancel()
        if not attempt.done():
            attempt.cancel()
            await asyncio.wait({attempt}, timeout=1.0)
    if not attempt.done() or attempt.cancelled() or attempt.exception() is not None:
        with contextlib.suppress(Exception):  # whatever state the failed connect left
            async with asyncio.timeout(1.0):
                await nc.close()
        exc = attempt.exception() if attempt.done() and not attempt.cancelled() else None
        why = _why_refused(url, settings, first_errors)
        if why is not None:
            raise EventLogUnavailable(why) from exc
        cause = exc or (first_errors[-1] if first_errors else None)
        # A server that accepts connections and answers nothing (frozen: SIGSTOP, a paused
        # VM) fails each try with a TimeoutError whose text is empty: its name says it.
        said = str(cause or "")
        if cause is not None and not said:
            said = f"{type(cause).__name__}, no answer"
        raise EventLogUnavailable(
            f"cannot connect to NATS at {url}: {said or f'no answer within {deadline:g}s'}. "
            f"Start one with `turnstream up` (embedded) or check --log.url"
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


def reconnects(js: JetStreamContext) -> int:
    """How often the connection under ``js`` has reconnected (a reaper's outage clock)."""
    return int(js._nc.stats["reconnects"])


async def answered(request: Callable[[], Awaitable[T]], what: str, tries: int = ANSWER_TRIES) -> T:
    """``request()`` (idempotent: provisioning, opening a bucket), sent again when its answer
    is lost or JetStream is not serving yet: a timeout, no responders, a 503, as while
    nats-server restarts (killed mid-request, or down longer than the request's timeout; the
    connection reconnects meanwhile). JetStream's other refusals are answers and raised at once,
    as is the last try's loss.

    A service starting up sends a few such requests right after it connects; without this, a
    nats-server restart in that window made it exit (a restarted gateway in the chaos soak).
    """
    transient = (TimeoutError, nats.errors.NoRespondersError, js_errors.ServiceUnavailableError)
    for attempt in range(1, tries + 1):
        try:
            return await request()
        except transient as exc:  # nats.errors.TimeoutError is a TimeoutError
            if attempt == tries:
                raise
            log.warning(
                "%s: no answer from the log (%s); asking again (%d of %d)",
                what,
                type(exc).__name__,
                attempt + 1,
                tries,
            )
            await asyncio.sleep(_RECONNECT_WAIT_S)
    raise AssertionError("unreachable")


@contextlib.contextmanager
def closed_socket_as_reset() -> Iterator[None]:
    """Inside the block, uvloop's RuntimeError for a write on a closed socket ("unable to
    perform operation on <TCPTransport closed=True ...>; the handler is closed") is the
    ``ConnectionResetError`` it means. nats-py writes inline when its flusher task has ended,
    as it does while the connection breaks; asyncio's own loop drops such a write, uvloop raises,
    and a gateway answered a 500 for it (issue 38's soak: a session read under a nats fault)."""
    try:
        yield
    except RuntimeError as exc:
        if "handler is closed" not in str(exc):
            raise
        raise ConnectionResetError(str(exc)) from exc


@contextlib.contextmanager
def map_nats_errors(what: str) -> Iterator[None]:
    """Inside the block, nats-py's and the socket's errors raise ``EventLogUnavailable`` naming
    ``what`` (the nats error as its cause), as httpx's ``map_httpcore_exceptions`` does."""
    try:
        yield
    except UNAVAILABLE as exc:
        raise EventLogUnavailable(f"{what}: {type(exc).__name__}: {exc}") from exc
