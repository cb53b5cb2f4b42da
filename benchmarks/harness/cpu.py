"""CPU meters: a process's CPU seconds from /proc (alone or with its children; its threads' in
ns), and this one's.

A phase reads every meter before and after its load and keeps the growth (``CpuMeter``)."""

from __future__ import annotations

import contextlib
import os
from typing import Protocol

CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int, *, user_only: bool = False) -> float:
    """utime + stime (or utime alone) of a process from /proc (children not included)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + (0 if user_only else int(fields[12]))) / CLK_TCK


def thread_cpu_ns(pid: int) -> int:
    """On-CPU time of all of a process's threads in ns (``/proc/PID/task/*/schedstat``): the
    10 ms ticks of ``/proc/PID/stat`` are too coarse to split one request's CPU from the next.
    (A thread that ended takes its time with it; the gateway's worker threads stay.)"""
    total = 0
    for task in os.scandir(f"/proc/{pid}/task"):
        # A thread that ended just now is skipped.
        with contextlib.suppress(OSError), open(f"{task.path}/schedstat") as f:
            total += int(f.read().split()[0])
    return total


def tree_cpu_seconds(pid: int) -> float:
    """``cpu_seconds`` of ``pid`` and its live descendants: vLLM generates in a child process
    (its engine core), the API server only parses and streams."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # exited meanwhile
        children.setdefault(parent, []).append(int(entry))
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        with contextlib.suppress(OSError):
            total += cpu_seconds(current)
        todo += children.get(current, [])
    return total


def own_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


class CpuMeter(Protocol):
    def cpu(self) -> dict[str, float]:
        """CPU seconds so far per process name (what a phase's ``cpu_s`` holds the growth of)."""
        ...
