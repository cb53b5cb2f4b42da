"""The gateway's cProfile output read by component (``--profile-gateway``)."""

from __future__ import annotations

import json
import pstats
from pathlib import Path
from typing import Any

from harness.reporting import say

# Where a function's own time goes: the first rule that matches its file (or, for C functions,
# its name). Functions no rule claims (the standard library, builtins, h11, anyio, json,
# transformers, numpy, ...) pass their time on to their callers, in proportion to the time each
# caller spent in them, so that e.g. json.loads counts for whoever parsed what.
PROFILE_CATEGORIES: list[tuple[str, tuple[str, ...]]] = [
    ("idle (waiting in epoll)", ("select.epoll",)),
    ("HTTP server (uvicorn)", ("/uvicorn/",)),
    ("framework (starlette, fastapi)", ("/starlette/", "/fastapi/")),
    ("request validation (pydantic)", ("/pydantic/", "/pydantic_core/")),
    ("detokenizer", ("/gateway/decoding.py", "/gateway/templates.py:decode")),
    ("prompt: chat template + tokenizer", ("/gateway/templates.py",)),
    (
        "backend stream parsing (sse, vllm)",
        (
            "/gateway/backends/remote.py",
            "/gateway/backends/vllm.py",
            "/gateway/backends/vllm_reader.py",
        ),
    ),
    ("backend stream parsing (sse, vllm)", ("/gateway/backends/payload.py",)),
    ("replica router", ("/gateway/backends/router.py",)),
    (
        "backend HTTP client (httpx, transport)",
        ("/httpx/", "/httpcore/", "/gateway/backends/transport.py"),
    ),
    ("publish (schemas, codec, nats-py)", ("/schemas/", "/nats/")),
    ("logging (logging, rich)", ("/logging/", "/rich/")),
    ("metrics (prometheus_client)", ("/prometheus_client/",)),
    ("gateway: app, serving, sessions, protocol", ("/gateway/",)),
    ("event loop (asyncio)", ("asyncio/base_events.py", "asyncio/events.py", "/selectors.py")),
]


def _category(func: tuple[str, int, str]) -> str | None:
    file, _, name = func
    where = f"{file}:{name}"
    for category, needles in PROFILE_CATEGORIES:
        if any(needle in where for needle in needles):
            return category
    return None


def profile_breakdown(stats: pstats.Stats) -> dict[str, float]:
    """Seconds of own time per category, shared functions attributed to their callers."""
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]  # pstats keeps it untyped
    memo: dict[Any, dict[str, float]] = {}

    def share(func: Any, visiting: frozenset[Any]) -> dict[str, float]:
        if func in memo:
            return memo[func]
        category = _category(func)
        if category is not None:
            memo[func] = {category: 1.0}
            return memo[func]
        callers = {c: e for c, e in raw[func][4].items() if c not in visiting and c in raw}
        if not callers:
            return {f"unattributed: {Path(func[0]).name}:{func[2]}"[:70]: 1.0}
        weights = {c: e[2] for c, e in callers.items()}
        if sum(weights.values()) <= 0:
            weights = {c: float(e[0]) for c, e in callers.items()}
        total = sum(weights.values()) or 1.0
        out: dict[str, float] = {}
        for caller, weight in weights.items():
            for category, fraction in share(caller, visiting | {func}).items():
                out[category] = out.get(category, 0.0) + fraction * weight / total
        if len(visiting) == 0:
            memo[func] = out
        return out

    seconds: dict[str, float] = {}
    for func, (_, _, tottime, _, _) in raw.items():
        for category, fraction in share(func, frozenset()).items():
            seconds[category] = seconds.get(category, 0.0) + tottime * fraction
    return dict(sorted(seconds.items(), key=lambda kv: -kv[1]))


def print_profile(path: Path, top: int, requests: int, cpu_ms: float) -> dict[str, Any]:
    """The profiled windows' time by category and the top functions by own time."""
    stats = pstats.Stats(str(path))
    breakdown = profile_breakdown(stats)
    idle = breakdown.pop("idle (waiting in epoll)", 0.0)
    gc_file = path.with_suffix(".gc.json")
    if gc_file.exists():  # full collections were kept out of the profile: see the launcher
        breakdown["full garbage collections (gen 2)"] = json.loads(gc_file.read_text())["full_gc_s"]
        breakdown = dict(sorted(breakdown.items(), key=lambda kv: -kv[1]))
    busy = sum(breakdown.values())
    say(
        f"\ngateway profile ({path}): measured windows only, {requests:,} requests, "
        f"{busy:.2f} s busy + {idle:.2f} s idle under cProfile (which slows Python calls: use the "
        f"shares; 'est. ms' = share x {cpu_ms:.2f} ms, the gateway's CPU per request in this "
        f"run's unprofiled (even) rounds)"
    )
    say(f"  {'where':<46}{'share':>8}{'ms/req (profiled)':>19}{'est. ms':>9}")
    categories = []
    for category, secs in breakdown.items():
        share = secs / busy
        categories.append(
            {
                "category": category,
                "share": round(share, 4),
                "profiled_ms_per_request": round(1000 * secs / max(requests, 1), 3),
                "estimated_ms_per_request": round(share * cpu_ms, 3),
            }
        )
        if share >= 0.002:
            say(
                f"  {category:<46}{share:>8.1%}{1000 * secs / max(requests, 1):>19.3f}"
                f"{share * cpu_ms:>9.3f}"
            )
    say(f"\ntop {top} functions by own time (profiled windows)")
    stats.sort_stats("tottime").print_stats(top)
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    rows = [
        {
            "function": f"{Path(file).name}:{line}:{fn}",
            "calls": calls,
            "tottime_s": round(tottime, 3),
            "cumtime_s": round(cumtime, 3),
        }
        for (file, line, fn), (_, calls, tottime, cumtime, _) in sorted(
            raw.items(), key=lambda kv: -kv[1][2]
        )[:top]
    ]
    return {"categories": categories, "top_functions": rows, "busy_s": busy, "idle_s": idle}
