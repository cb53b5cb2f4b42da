"""Keeping an embedded nats-server up: restart it when it dies, within a bound.

``turnstream up`` (and every command that embeds a server) runs ``supervised(server, stop=...)``
around its work. When the server process dies on its own (a crash, the OOM killer, a stray
kill -9), it is started again on the same port and store; the clients reconnect by themselves
(``eventlog.connection`` reconnects forever) and publishes in between are retried or spooled by
the publisher. Each restart is logged with the exit status and the tail of the server's log.
More than ``max_restarts`` deaths within ``window_s`` is a crash loop: the supervisor gives up,
sets ``stop`` so the service shuts down, and ``ServerCrashLoop`` is raised where the service
leaves ``supervised``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections import deque
from collections.abc import AsyncIterator

from eventlog.server.errors import ServerCrashLoop
from eventlog.server.process import NatsServer
from schemas.errors import TurnstreamError

__all__ = ["supervise", "supervised"]

log = logging.getLogger(__name__)


def _describe(code: int | None) -> str:
    if code is None:
        return "did not come up"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
        return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _log_tail(server: NatsServer, lines: int = 12) -> str:
    try:
        with server.log_path.open("rb") as log_file:  # appended to across restarts: only its end
            log_file.seek(max(0, log_file.seek(0, 2) - 16384))
            text = log_file.read().decode(errors="replace")
    except OSError as exc:
        return f"(cannot read {server.log_path}: {exc})"
    return "\n".join(text.splitlines()[-lines:])


async def supervise(
    server: NatsServer,
    *,
    max_restarts: int = 5,
    window_s: float = 60.0,
    poll_s: float = 0.25,
) -> None:
    """Restart ``server`` whenever it is not running, until cancelled.

    Raises ``ServerCrashLoop`` when it needed more than ``max_restarts`` restarts within
    ``window_s`` seconds. A restart in progress when cancelled is finished first, so the caller
    can stop the server afterwards without racing the restart's thread.
    """
    restarts: deque[float] = deque()
    while True:
        await asyncio.sleep(poll_s)
        if server.running:
            continue
        code = server.exit_code
        now = time.monotonic()
        while restarts and now - restarts[0] > window_s:
            restarts.popleft()
        if len(restarts) >= max_restarts:
            raise ServerCrashLoop(
                f"nats-server on {server.url} (store {server.store_dir}) {_describe(code)} "
                f"after {len(restarts)} restarts within {window_s:.0f}s: not restarting it "
                f"again; read {server.log_path}, fix the cause and start again. "
                f"Its log ends:\n{_log_tail(server)}"
            )
        restarts.append(now)
        log.error(
            "nats-server on %s (store %s) %s; restarting it (%d of at most %d within %.0fs). "
            "Its log ends:\n%s",
            server.url,
            server.store_dir,
            _describe(code),
            len(restarts),
            max_restarts,
            window_s,
            _log_tail(server),
        )
        if len(restarts) > 1:  # back off a little when it keeps dying (or failing to start)
            await asyncio.sleep(min(0.5 * (len(restarts) - 1), 5.0))
        # start() blocks until JetStream has recovered its streams: off the event loop. The
        # server is forked by the spawner thread, so this worker thread's end cannot kill it.
        restart = asyncio.ensure_future(asyncio.to_thread(server.start))
        try:
            await asyncio.shield(restart)
        except asyncio.CancelledError:
            with contextlib.suppress(TurnstreamError):
                await restart
            raise
        except TurnstreamError as exc:  # counted: the next round tries again, or gives up
            log.error("restarting nats-server on %s failed: %s", server.url, exc)
            continue
        log.warning("nats-server restarted: pid %s on %s", server.pid, server.url)


@contextlib.asynccontextmanager
async def supervised(
    server: NatsServer,
    *,
    stop: asyncio.Event | None = None,
    max_restarts: int = 5,
    window_s: float = 60.0,
) -> AsyncIterator[None]:
    """Supervise ``server`` for the duration of the block (see the module docstring).

    On a crash loop ``stop`` is set, and ``ServerCrashLoop`` is raised when the block ends
    (unless the block raised an error of its own).
    """
    task = asyncio.create_task(
        supervise(server, max_restarts=max_restarts, window_s=window_s),
        name=f"supervise nats-server {server.url}",
    )

    def gave_up(done: asyncio.Task[None]) -> None:
        if not done.cancelled() and done.exception() is not None:
            log.error("%s", done.exception())
            if stop is not None:
                stop.set()

    task.add_done_callback(gave_up)
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, ServerCrashLoop):
            await task
    if not task.cancelled() and (error := task.exception()) is not None:
        raise error
