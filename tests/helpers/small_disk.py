"""A filesystem of its own for a nats-server store, that a test fills and empties at will.

A tmpfs mounted on the store's directory (root only; where ``mount`` is refused, ``mount()``
answers False and the caller falls back or skips). ``fill()`` shrinks it to what it holds, so
the next write fails with ENOSPC as on a full disk, at once and without writing a byte of
filler (a filler file on tmpfs would take that much memory); ``make_room()`` grows it back.
``unmount()`` (lazy: a process still holding a file there does not keep it mounted) is for a
``finally``: nothing outlives the run but an empty directory.

Why tmpfs and not JetStream's own limit: nats-server computes that limit once, at start, from
the disk's free space (75% of it), so a disk that other writers fill is met as a failing write,
not as JetStream's "insufficient resources": a different path (``docs/RELIABILITY.md``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

__all__ = ["SmallDisk"]


class SmallDisk:
    def __init__(self, path: Path, size_bytes: int) -> None:
        self.path = path
        self.size_bytes = size_bytes
        self.mounted = False
        self.why_not = ""  # mount's refusal, when it was refused

    def mount(self) -> bool:
        self.path.mkdir(parents=True, exist_ok=True)
        if os.geteuid() != 0:
            self.why_not = "not root: mount -t tmpfs needs root"
            return False
        done = self._mount("-t", "tmpfs", "-o", f"size={self.size_bytes}", "tmpfs")
        self.mounted = done.returncode == 0
        self.why_not = "" if self.mounted else done.stderr.strip()
        return self.mounted

    def used_bytes(self) -> int:
        stat = os.statvfs(self.path)
        return (stat.f_blocks - stat.f_bfree) * stat.f_frsize

    def fill(self) -> None:
        """No free byte left: the size shrinks to what the filesystem holds."""
        self._resize(max(self.used_bytes(), 4096))

    def make_room(self) -> None:
        self._resize(self.size_bytes)

    def keep(self) -> None:
        """What the filesystem holds, moved onto the disk beneath it (its directory stays, now
        a plain one); then unmounted. For a test's data dir that outlives the run. Also where
        this object did not mount it (cleanup after the process that did was killed)."""
        if not os.path.ismount(self.path):
            return
        kept = self.path.with_name(self.path.name + ".kept")
        shutil.copytree(self.path, kept, symlinks=True)
        self.mounted = True
        self.unmount()
        self.path.rmdir()
        kept.rename(self.path)

    def unmount(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True, check=False)
            self.mounted = False

    def _resize(self, size: int) -> None:
        done = self._mount("-o", f"remount,size={size}", "tmpfs")
        if done.returncode != 0:
            raise OSError(f"resizing the tmpfs on {self.path} to {size}: {done.stderr.strip()}")

    def _mount(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["mount", *args, str(self.path)], capture_output=True, text=True, check=False
        )
