"""The flags of the gateway benchmarks: ``gateway_overhead.py``'s, which also selects its modes
(``--api-surfaces``, ``--per-token``, ...); the scripts of those modes parse the same flags, so
that a mode runs the same whether reached through ``gateway_overhead.py`` or its own script."""

from __future__ import annotations

import argparse
import asyncio
import logging
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

from harness.phases import Plan
from harness.processes import REPO
from harness.reporting import arguments


def gateway_arguments(doc: str | None) -> argparse.ArgumentParser:
    """``--quick``, ``--store-dir`` and every gateway benchmark's own flags."""
    parser = arguments(doc, "shorter phases (< 60 s)", store_dir=True)
    parser.add_argument(
        "--concurrency",
        default=None,
        help="comma-separated levels (default 1,16,64; with --compare-with: one level, 16)",
    )
    parser.add_argument(
        "--backend-kind",
        choices=("fixed-latency", "vllm-cpu"),
        default="fixed-latency",
        help="the stand-in (default) or a real vLLM CPU server on the head_dim-64 tiny model",
    )
    parser.add_argument("--ttft-ms", type=float, default=20.0, help="backend's fixed latency")
    parser.add_argument(
        "--itl-ms", type=float, default=0.0, help="backend's delay between token events"
    )
    parser.add_argument("--turns-per-session", type=int, default=4)
    parser.add_argument(
        "--workers-per-client", type=int, default=8, help="load workers sharing one httpx pool"
    )
    parser.add_argument("--max-inflight-per-replica", type=int, default=None)
    parser.add_argument(
        "--gateway-log-level", default=None, help="TURNSTREAM_LOG_LEVEL (default: as shipped)"
    )
    parser.add_argument("--rounds", type=int, default=None, help="override the plan's rounds")
    parser.add_argument("--measure-s", type=float, default=None, help="override measured seconds")
    parser.add_argument(
        "--model-cache",
        default=str(Path(tempfile.gettempdir()) / "turnstream-bench-models"),
        help="where the tiny model is created once and reused",
    )
    parser.add_argument(
        "--gateway-gc-freeze",
        action="store_true",
        help="experiment: gc.freeze() in the gateway process after its imports",
    )
    parser.add_argument("--profile-gateway", type=Path, default=None, help="cProfile output file")
    parser.add_argument("--profile-top", type=int, default=30)
    parser.add_argument(
        "--tracemalloc-gateway",
        type=Path,
        default=None,
        help="with --fleet: the gateway under tracemalloc; its live allocations by line at the "
        "end of the first fleet's window, into this file (slows the gateway: not for figures)",
    )
    parser.add_argument(
        "--compare-with",
        metavar="REV",
        default=None,
        help="paired before/after mode: the gateway at git revision REV vs --after-tree",
    )
    parser.add_argument(
        "--after-tree",
        type=lambda path: Path(path).resolve(),
        default=REPO,
        help="with --compare-with: the checkout the 'after' gateway runs (default: this one)",
    )
    parser.add_argument(
        "--api-surfaces",
        nargs="?",
        const="chat,messages,responses",
        default=None,
        metavar="APIS",
        help="per-API CPU mode (issue 17): Claude-Code-shaped sessions on each API surface "
        "(default: chat,messages,responses)",
    )
    parser.add_argument(
        "--interleaved",
        action="store_true",
        help="issue 18: CPU per turn with 1, 4 and 16 interleaved ~32k-token conversations per "
        "session",
    )
    parser.add_argument(
        "--per-token",
        action="store_true",
        help="issue 16: CPU per generated token, 460 vs 16 output tokens, streamed and not",
    )
    parser.add_argument(
        "--per-token-profile",
        choices=("whole", "streamed"),
        default="whole",
        help="with --per-token --profile-gateway: which 460-token phases to profile",
    )
    parser.add_argument(
        "--agent-shape",
        action="store_true",
        help="issue 16: CPU per later turn at 1k, 32k and 100k tokens of context, 460 output "
        "tokens a turn, with the tiny and a BPE tokenizer (also part of the default run)",
    )
    parser.add_argument(
        "--scaleout",
        action="store_true",
        help="issue 16: throughput and CPU at c=64 through 1 vs 2 gateway processes "
        "(turnstream gateway --workers N; also part of the default run)",
    )
    parser.add_argument(
        "--scaleout-workers",
        default="1,2",
        metavar="N,N",
        help="with --scaleout: the gateways' --workers counts (16 cores: 1,4,8 with "
        "--concurrency 256)",
    )
    parser.add_argument(
        "--load-processes",
        type=int,
        default=1,
        help="with --scaleout: spread the load generator over this many processes",
    )
    parser.add_argument(
        "--backend-processes",
        type=int,
        default=1,
        help="with --scaleout: fixed-latency backend processes sharing one port (SO_REUSEPORT)",
    )
    parser.add_argument(
        "--fleet",
        action="store_true",
        help="issue 40: a fleet's sessions on one gateway (256 at ~100k tokens, 1,000 at ~30k): "
        "event-loop lag, added latency, timeouts, RSS per held session",
    )
    parser.add_argument(
        "--litellm",
        action="store_true",
        help="issue 16: gateway vs LiteLLM proxy 1.106.2 CPU per request at c=16, phases "
        "alternating (installs LiteLLM once in its own venv; also part of the default run)",
    )
    return parser


def run_gateway_mode(
    doc: str | None,
    mode_main: Callable[[argparse.ArgumentParser, argparse.Namespace], Awaitable[None]],
    **defaults: object,
) -> None:
    """A mode of ``gateway_overhead.py`` run as its own script: the same flags (``defaults``
    set, e.g. the APIs of ``--api-surfaces``), the same run, the same JSON line."""
    logging.basicConfig(level=logging.ERROR)
    parser = gateway_arguments(doc)
    parser.set_defaults(**defaults)
    asyncio.run(mode_main(parser, parser.parse_args()))


def plan_of(args: argparse.Namespace, plan: Plan) -> Plan:
    """``plan`` with ``--rounds`` and ``--measure-s`` applied."""
    if args.rounds is None and args.measure_s is None:
        return plan
    return Plan(plan.warmup_s, args.measure_s or plan.measure_s, args.rounds or plan.rounds)
