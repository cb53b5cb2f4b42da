"""The embedded nats-server's own guarantees (DESIGN §8), on ``NatsServer`` directly.

It never outlives the process that started it (parent-death signal, whatever thread started
it), two servers never share a store (lock file naming the holder), and ``supervise`` restarts
a server that died, within a bound.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from eventlog import connect
from eventlog.server import (
    LOCK_NAME,
    NatsServer,
    ServerCrashLoop,
    StoreInUse,
    pid_alive,
    read_holder,
    supervised,
)
from eventlog.server.process import _PDEATHSIG_SHIM
from tests.conftest import FAST_LOG
from tests.helpers.waiting import eventually, wait_for

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's"),
]


def test_a_second_server_on_a_locked_store_is_refused_naming_the_holder(tmp_path: Path) -> None:
    first = NatsServer(tmp_path).start()
    second = NatsServer(tmp_path)
    try:
        assert read_holder(tmp_path) == {
            "pid": os.getpid(),
            "server_pid": first.pid,
            "url": first.url,
            "store": str(tmp_path.resolve()),
        }
        assert _opened(tmp_path / LOCK_NAME, pid=first.pid)  # an orphan would still hold it

        with pytest.raises(StoreInUse) as refused:
            second.start()

        assert f"in use by nats-server pid {first.pid} started by pid {os.getpid()}" in str(
            refused.value
        )
        assert str(tmp_path / LOCK_NAME) in str(refused.value)
        assert not second.running and first.running

        first.kill()  # releases the lock: the next server may take the store
        second.start()
        assert read_holder(tmp_path)["server_pid"] == second.pid

        second.stop()
        first.restart()  # the same object takes the lock again
        assert read_holder(tmp_path)["server_pid"] == first.pid
    finally:
        first.kill()
        second.kill()
    assert read_holder(tmp_path) == {}


async def test_a_server_started_from_a_short_lived_thread_outlives_the_thread(
    tmp_path: Path,
) -> None:
    server = NatsServer(tmp_path)
    thread_ids: list[int] = []

    def start() -> None:
        thread_ids.append(threading.get_native_id())
        server.start()

    thread = threading.Thread(target=start)  # as asyncio.to_thread(server.start) would
    thread.start()
    thread.join()
    try:
        # Gone from /proc: the thread has exited, and the kernel has sent any death signal.
        await eventually(
            lambda: not Path(f"/proc/self/task/{thread_ids[0]}").exists(), 30, "thread exits"
        )
        nc = await connect(server.url, FAST_LOG, name="after-the-thread")
        await nc.jetstream().account_info()  # a round trip after any signal would have landed
        await nc.close()

        assert server.running
        assert "Trapped" not in server.log_path.read_text()  # no SIGTERM reached it
    finally:
        server.kill()


PARENT = """
import sys, threading, time
from pathlib import Path
from eventlog.server import NatsServer
server = NatsServer(Path(sys.argv[1]))
thread = threading.Thread(target=server.start)  # the forking thread ends; the process lives
thread.start()
thread.join()
print(server.pid, flush=True)
time.sleep(600)
"""


def test_a_server_dies_with_its_parent_and_the_store_can_be_taken_again(tmp_path: Path) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    server_pid: int | None = None
    try:
        assert parent.stdout is not None
        server_pid = int(parent.stdout.readline())
        assert read_holder(tmp_path)["pid"] == parent.pid

        parent.kill()  # SIGKILL: the parent runs no code at all
        parent.wait()

        wait_for(lambda: not pid_alive(server_pid), 30, f"nats-server pid {server_pid} exits")
        assert 'Trapped "terminated" signal' in (tmp_path / "nats-server.log").read_text()
        again = NatsServer(tmp_path).start()
        again.stop()
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if server_pid is not None and pid_alive(server_pid):
            os.kill(server_pid, signal.SIGKILL)


@pytest.mark.parametrize(("parent", "runs"), [("self", True), ("other", False)])
def test_the_shim_execs_the_server_only_while_its_parent_lives(parent: str, runs: bool) -> None:
    expected = os.getpid() if parent == "self" else 1  # 1: a parent that is already gone
    shim = [sys.executable, "-I", "-S", "-c", _PDEATHSIG_SHIM, str(expected)]

    result = subprocess.run([*shim, "/bin/echo", "exec'd"], capture_output=True, text=True)

    assert (result.stdout == "exec'd\n") is runs
    assert (result.returncode == 0) is runs
    if not runs:
        assert "died before nats-server started" in result.stderr


async def test_supervised_restarts_a_killed_server_then_gives_up_past_the_bound(
    tmp_path: Path,
) -> None:
    server = NatsServer(tmp_path).start()
    stop = asyncio.Event()
    nc = await connect(server.url, FAST_LOG, name="supervised")
    try:
        with pytest.raises(ServerCrashLoop) as gave_up:
            async with supervised(server, stop=stop, max_restarts=1, window_s=600):
                first = server.pid
                assert first is not None
                os.kill(first, signal.SIGKILL)
                await eventually(lambda: server.running and server.pid != first, 30, "restart")
                await nc.jetstream().account_info()  # the client reconnected by itself

                second = server.pid
                assert second is not None
                os.kill(second, signal.SIGKILL)
                async with asyncio.timeout(30):  # past the bound it stops the service
                    await stop.wait()

        assert "was killed by SIGKILL after 1 restarts within 600s" in str(gave_up.value)
        assert str(server.log_path) in str(gave_up.value)
        assert not server.running
    finally:
        await nc.close()
        server.kill()


HOLDER = """
import fcntl, json, os, sys
fd = os.open(os.path.join(sys.argv[1], "turnstream-nats.lock"), os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.ftruncate(fd, 0)  # as StoreLock.record does: a shorter record must not leave a longer one's tail
os.write(fd, json.dumps({"pid": int(sys.argv[2]), "server_pid": os.getpid()}).encode())
print("locked", flush=True)
sys.stdin.read()  # holds the lock until the test closes stdin
"""


def _holder(store: Path, parent: int) -> subprocess.Popen[str]:
    """A process holding ``store``'s lock in the name of ``parent``, as a server would."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(store), str(parent)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline() == "locked\n"
    return proc


def _opened(path: Path, pid: int | None = None) -> bool:
    """Whether process ``pid`` (this one by default) has ``path`` open."""
    for fd in Path(f"/proc/{pid or 'self'}/fd").iterdir():
        try:
            if os.readlink(fd) == str(path):
                return True
        except OSError:  # closed meanwhile (the listing's own descriptor, for one)
            pass
    return False


def _dead_pid() -> int:
    gone = subprocess.Popen(["true"])
    gone.wait()
    return gone.pid


async def test_the_lock_waits_for_an_orphan_but_not_for_a_live_holder(tmp_path: Path) -> None:
    from eventlog.server import StoreLock

    live = _holder(tmp_path, os.getpid())
    try:
        with pytest.raises(StoreInUse, match=f"in use by nats-server pid {live.pid} started by"):
            StoreLock.acquire(tmp_path, orphan_wait_s=600)  # a live parent: no waiting
    finally:
        live.communicate("")

    parent = _dead_pid()
    orphan = _holder(tmp_path, parent)
    try:
        with pytest.raises(StoreInUse, match=f"pid {orphan.pid}, orphaned .*pid {parent} is gone"):
            StoreLock.acquire(tmp_path, orphan_wait_s=0.2)

        taking = asyncio.create_task(asyncio.to_thread(StoreLock.acquire, tmp_path))
        await eventually(
            lambda: _opened(tmp_path / LOCK_NAME),
            30,
            "acquire() opened the lock file and is waiting on it",
        )
        assert orphan.stdin is not None
        orphan.stdin.close()  # the orphan exits, as its parent-death signal makes it
        lock = await taking
        assert read_holder(tmp_path)["pid"] == os.getpid()
        lock.release()
    finally:
        if orphan.poll() is None:
            orphan.kill()
            orphan.wait()
