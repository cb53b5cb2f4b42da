"""Keeping an embedded nats-server up: restart it when it dies, within a bound.

``turnstream up`` (and every command that embeds a server) runs ``supervised(server, stop=...)``
around its work. When the server process dies on its own (a crash, the OOM killer, a stray
kill -9), it is started again on the same port and store; the clients reconnect by themselves
(``eventlog.connection`` reconnects forever) and publishes in between are retried or spooled by
the publisher. Each restart is logged with the exit status and the tail of the server's log.
More than ``max_restarts`` deaths within ``window_s`` is a crash loop: the supervisor gives up,
sets ``stop`` so the service shuts down, and ``ServerCrashLoop`` is raised where the service
leaves ``supervised``.

A server alive but stuck is restarted too: after a write to its store fails (a full disk, ENOSPC),
nats-server 2.15 answers nothing more on that stream, also once space has returned, until it
restarts (docs/RELIABILITY.md, finding 9). The supervisor reads what the server's log gains for
its "Critical write error", waits until the store's filesystem has room again
(``min_free_bytes``), then restarts it: service resumes when space returns, with nothing that
was acknowledged lost (the store's messages before the failed write are all there).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import time
from collections import deque
from collections.abc import AsyncIterator

from eventlog.server.errors import ServerCrashLoop
from eventlog.server.process import NatsServer
from schemas.errors import TurnstreamError

__all__ = ["WriteErrors", "supervise", "supervised"]

log = logging.getLogger(__name__)

# What nats-server logs when a write to a stream's store failed ("Filestore [EVENTS] Critical
# write error: write ...: no space left on device"); the stream answers nothing after it.
_WRITE_ERROR = b"Critical write error"
_LOG_READ_MAX = 1024 * 1024  # per look: a log that grew by more is read from its last MiB


class WriteErrors:
    """The critical write errors a server's log gains from now on, read a little at a time.

    Only what is appended after construction counts (the log is appended to across restarts,
    and an error before the last restart is over)."""

    def __init__(self, path: os.PathLike[str] | str) -> None:
        self.path = path
        self.offset = self._size()
        self._partial = b""  # a line not yet ended at the last look

    def _size(self) -> int:
        try:
            return os.stat(self.path).st_size
        except OSError:
            return 0

    def skip(self) -> None:
        """Forget what the log holds so far (a restart ended the error it logged)."""
        self.offset, self._partial = self._size(), b""

    def seen(self) -> str | None:
        """The first critical write error logged since the last look, or None."""
        size = self._size()
        if size < self.offset:  # a new log file: read it from its start
            self.offset, self._partial = 0, b""
        if size == self.offset:
            return None
        start = max(self.offset, size - _LOG_READ_MAX)
        try:
            with open(self.path, "rb") as log_file:
                log_file.seek(start)
                gained = log_file.read(size - start)
        except OSError:
            return None
        self.offset = start + len(gained)
        lines = (self._partial + gained).split(b"\n")
        self._partial = lines.pop()[-4096:]
        for line in lines:
            if _WRITE_ERROR in line:
                return line.decode(errors="replace").strip()
        return None


def _free_bytes(path: os.PathLike[str] | str) -> int:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 0


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
    min_free_bytes: int = 64 * 1024 * 1024,
) -> None:
    """Restart ``server`` whenever it is not running, or it is stuck after a critical write
    error and its store has ``min_free_bytes`` free again, until cancelled.

    Raises ``ServerCrashLoop`` when it needed more than ``max_restarts`` restarts within
    ``window_s`` seconds. A restart in progress when cancelled is finished first, so the caller
    can stop the server afterwards without racing the restart's thread.
    """
    restarts: deque[float] = deque()
    write_errors = WriteErrors(server.log_path)
    stuck: str | None = None  # the write error the running server has not been restarted for
    while True:
        await asyncio.sleep(poll_s)
        if server.running:
            stuck = stuck or write_errors.seen()
            if stuck is None or _free_bytes(server.store_dir) < min_free_bytes:
                continue
            log.error(
                "nats-server on %s (store %s) logged %r and answers nothing on that stream "
                "until it restarts; its store has room again: restarting it",
                server.url,
                server.store_dir,
                stuck,
            )
            await asyncio.to_thread(server.stop)
            write_errors.skip()
            stuck = None
            why = "was stuck after a critical write error"
        else:
            why = _describe(server.exit_code)
        now = time.monotonic()
        while restarts and now - restarts[0] > window_s:
            restarts.popleft()
        if len(restarts) >= max_restarts:
            raise ServerCrashLoop(
                f"nats-server on {server.url} (store {server.store_dir}) {why} "
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
            why,
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
    min_free_bytes: int = 64 * 1024 * 1024,
) -> AsyncIterator[None]:
    """Supervise ``server`` for the duration of the block (see the module docstring).

    On a crash loop ``stop`` is set, and ``ServerCrashLoop`` is raised when the block ends
    (unless the block raised an error of its own).
    """
    task = asyncio.create_task(
        supervise(
            server, max_restarts=max_restarts, window_s=window_s, min_free_bytes=min_free_bytes
        ),
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
