"""One nats-server per JetStream store: an exclusive ``flock`` on ``<store>/turnstream-nats.lock``.

Two servers on one store corrupt it (each restores and rewrites the same files), and JetStream
itself takes no lock. The lock is taken by the Python process that starts the server, and the
locked descriptor is handed to the server (``pass_fds``), so the store stays locked as long as
*either* lives: an orphaned server still holds it. The file names its holders as JSON::

    {"pid": 1234, "server_pid": 1240, "url": "nats://127.0.0.1:4222", "store": "/data/nats"}

``pid`` is the process that started the server, ``server_pid`` the nats-server (null until it
is spawned). The file is never deleted (unlinking a lock file races with the next taker); a
released lock leaves it empty.

A holder whose parent is gone is a server dying of its parent-death signal (see
``eventlog.server.process``): the next taker waits for it (``orphan_wait_s``) instead of failing, so
``turnstream up`` right after a kill -9 of the previous ``up`` starts cleanly. A ``fork()``
without ``exec`` (multiprocessing's fork start method) copies the descriptor, and with it the
lock, into the forked child: start servers before forking workers, or use ``spawn``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from pathlib import Path
from typing import Any

from eventlog.server.errors import StoreInUse

__all__ = ["LOCK_NAME", "StoreLock", "pid_alive", "read_holder"]

LOCK_NAME = "turnstream-nats.lock"


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie, killed but not yet reaped, is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:  # no procfs (macOS): ask the kernel, which counts zombies as alive
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    # Field 3, after the parenthesised command name (which may itself hold spaces or parens).
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def read_holder(store_dir: Path) -> dict[str, Any]:
    """What the lock file of ``store_dir`` says about its holder ({} when unknown)."""
    try:
        text = (Path(store_dir) / LOCK_NAME).read_text()
        holder = json.loads(text) if text.strip() else {}
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


class StoreLock:
    """The held lock of one store; ``release()`` (or the holders' deaths) frees it."""

    def __init__(self, store_dir: Path, fd: int) -> None:
        self.store_dir = store_dir
        self.fd = fd  # pass to the server process so the lock outlives this one if need be

    @classmethod
    def acquire(cls, store_dir: Path, *, orphan_wait_s: float = 30.0) -> StoreLock:
        """Lock ``store_dir`` or raise ``StoreInUse`` naming the holder.

        A live holder fails at once; an orphaned server (its parent gone) is waited for up to
        ``orphan_wait_s``, since its parent-death signal is shutting it down.
        """
        store_dir = Path(store_dir)
        store_dir.mkdir(parents=True, exist_ok=True)
        path = store_dir / LOCK_NAME
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited, but by pass_fds
        deadline: float | None = None
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    pass
                holder = read_holder(store_dir)
                parent, server = holder.get("pid"), holder.get("server_pid")
                orphan = isinstance(parent, int) and not pid_alive(parent)
                # An empty file: the holder has the lock but has not written its PIDs yet.
                settling = parent is None
                if not (orphan or settling):
                    raise StoreInUse(_in_use(store_dir, parent, server, orphaned=False))
                now = time.monotonic()
                if deadline is None:
                    deadline = now + (orphan_wait_s if orphan else 2.0)
                if now > deadline:
                    raise StoreInUse(_in_use(store_dir, parent, server, orphaned=orphan))
                time.sleep(0.05)
        except BaseException:
            os.close(fd)
            raise
        lock = cls(store_dir, fd)
        lock.record(server_pid=None, url=None)
        return lock

    def record(self, *, server_pid: int | None, url: str | None) -> None:
        """Write who holds the store: this process, and the server once it is spawned."""
        holder = {
            "pid": os.getpid(),
            "server_pid": server_pid,
            "url": url,
            "store": str(self.store_dir.resolve()),
        }
        data = (json.dumps(holder) + "\n").encode()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, data, 0)

    def release(self) -> None:
        """Empty the file and unlock (call once the server process has exited)."""
        if self.fd < 0:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(self.fd, 0)
        os.close(self.fd)  # closing the last descriptor of the open file drops the flock
        self.fd = -1


def _in_use(store_dir: Path, parent: object, server: object, *, orphaned: bool) -> str:
    lock = store_dir / LOCK_NAME
    if parent is None:
        return (
            f"the JetStream store {store_dir} is locked by another nats-server (see {lock}; "
            f"its holder did not write its PID): stop that server before starting one on this "
            f"store, or use another --data-dir / --log.store-dir"
        )
    if orphaned:
        server_said = f"pid {server}" if server is not None else "(its PID was not recorded)"
        return (
            f"the JetStream store {store_dir} is held by nats-server {server_said}, orphaned "
            f"(its parent pid {parent} is gone) and still running: stop it and start again"
        )
    holder = (
        f"nats-server pid {server} started by pid {parent}"
        if server is not None
        else f"pid {parent} (starting its nats-server)"
    )
    return (
        f"the JetStream store {store_dir} is in use by {holder} (lock file {lock}): stop "
        f"that process before starting another server on this store, or use another "
        f"--data-dir / --log.store-dir"
    )
