"""What every benchmark script shares: progress lines, machine facts, the closing JSON line."""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from typing import Any

from schemas.log.server import find_nats_server


def say(line: str = "") -> None:
    print(line, flush=True)


def machine_info(*dists: str) -> dict[str, Any]:
    """The machine, Python, nats-server and the versions of ``dists``."""
    try:
        nats_server = subprocess.run(
            [find_nats_server(), "--version"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except Exception as exc:  # report, don't fail the benchmark over a version string
        nats_server = f"unknown ({exc})"
    versions = {}
    for dist in dists:
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = "unknown"
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0],
        "nats_server": nats_server,
        **versions,
    }


def finish(
    figures: dict[str, Any], *, quick: bool, duration_s: float, info: dict[str, Any]
) -> None:
    """Print the closing lines; the last one is the JSON object of all figures."""
    figures = {
        **figures,
        "mode": "quick" if quick else "full",
        "duration_s": round(duration_s, 1),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        **info,
    }
    say(f"\ndone in {duration_s:.1f} s")
    say(json.dumps(figures))
