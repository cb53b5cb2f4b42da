"""What every benchmark script shares: progress lines, machine facts, the closing JSON line."""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import importlib.util
import json
import os
import platform
import subprocess
import sys
from typing import Any

from eventlog.server import find_nats_server


def say(line: str = "") -> None:
    print(line, flush=True)


def arguments(
    doc: str | None, quick: str, *, seed: str | None = None, store_dir: bool = False
) -> argparse.ArgumentParser:
    """The options every benchmark has: ``--quick`` (and ``--seed``, ``--store-dir``)."""
    parser = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=quick)
    if seed is not None:
        parser.add_argument("--seed", type=int, default=0, help=seed)
    if store_dir:
        parser.add_argument(
            "--store-dir",
            default=None,
            help="parent of the temporary JetStream store (default: the system temp dir)",
        )
    return parser


def banner(name: str, quick: bool, info: dict[str, Any], versions: str | None = None) -> None:
    """The first line: which benchmark, which mode, on what (``versions``: default nats-server)."""
    say(
        f"turnstream {name} benchmark ({'quick' if quick else 'full'}) on {info['platform']}, "
        f"{info['cpu_count']} CPUs, Python {info['python']}, {versions or info['nats_server']}"
    )


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


def gateway_machine_info() -> dict[str, Any]:
    return {
        **machine_info(
            "fastapi", "starlette", "uvicorn", "h11", "httpx", "nats-py", "transformers"
        ),
        "uvloop": importlib.util.find_spec("uvloop") is not None,
        "httptools": importlib.util.find_spec("httptools") is not None,
    }
