"""How a command's process runs: its event loop, its signals, its heap, its log lines.

The services (the gateway and its ``--workers``, ``up``, the fold worker, the shard writer, the
trainer) run on these, so they behave alike: SIGINT / SIGTERM stop them gracefully, the heap is
settled once start-up is over; every command's log lines go to stderr (``configure_logging``).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from rich.console import Console
from rich.logging import RichHandler

__all__ = [
    "YOUNG_GC_THRESHOLD",
    "configure_logging",
    "console",
    "run_service",
    "settle_heap",
    "stop_on_signals",
    "without_progress_bars",
]

T = TypeVar("T")

console = Console(stderr=True)
"""The process's stderr console: its log lines and the CLI's error lines."""


def _event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop where uvloop is installed (libuv: fewer Python frames per socket
    event than asyncio's selector loop), else None: asyncio's own."""
    try:
        import uvloop
    except ImportError:
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def run_service(main: Coroutine[Any, Any, T]) -> T:
    """Run a long-lived service's ``main`` to its end on ``_event_loop_factory``'s loop: the
    gateway, its ``--workers``, ``up``, the fold worker and the shard writer all run on it."""
    with asyncio.Runner(loop_factory=_event_loop_factory()) as runner:
        return runner.run(main)


# CPython's default is 700. A gateway under load holds many requests' objects at any moment, and
# each young collection promoted whatever they held then into the old generation, where it
# counted towards the next full collection: at c=64, 7-10 full collections a minute walked every
# session the gateway keeps (~7,500 in the benchmark: 150-220 ms each, the event loop stopped).
# At 50,000 a request's temporaries are mostly gone by the time a young collection runs.
YOUNG_GC_THRESHOLD = 50_000


def settle_heap() -> None:
    """Once a service has started, before it serves: collect, freeze what start-up left (torch,
    transformers and the tokenizer leave ~400k long-lived objects, which every full collection
    walked: 120-290 ms pauses under load) and raise the young generation's threshold to
    ``YOUNG_GC_THRESHOLD`` (the older generations' thresholds stay CPython's)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_GC_THRESHOLD, *gc.get_threshold()[1:])


def without_progress_bars() -> None:
    """transformers' progress bars off: a service's log is lines, and each model load (a
    gateway's at start and per policy version its local backend loads, a trainer's at start
    and from a checkpoint) drew a "Loading weights" bar. Imports transformers."""
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # untyped


def stop_on_signals() -> asyncio.Event:
    """An event set by SIGINT or SIGTERM: a service stops taking work, finishes, exits 0."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


def _quiet_tls_close(record: logging.LogRecord) -> bool:
    # asyncio warns each time a TLS peer closes a nats-py connection (its stream protocol asks
    # to stay half-open, which TLS cannot): one harmless line per connection on a secure log.
    return "eof_received() has no effect when using ssl" not in record.getMessage()


def configure_logging(fmt: str = "%(message)s") -> None:
    """The commands' logging: rich lines on stderr at ``TURNSTREAM_LOG_LEVEL`` (INFO), in
    ``fmt`` (a gateway worker process names itself in it)."""
    logging.basicConfig(
        level=os.environ.get("TURNSTREAM_LOG_LEVEL", "INFO"),
        format=fmt,
        handlers=[RichHandler(console=console, show_path=False)],
    )
    # Per-request INFO lines from client libraries cost ~0.6 ms a turn in the gateway.
    for noisy in ("nats", "httpx", "httpcore", "httpx2", "httpcore2"):  # httpx2: the openai SDK
        logging.getLogger(noisy).setLevel(logging.WARNING)
    logging.getLogger("asyncio").addFilter(_quiet_tls_close)
