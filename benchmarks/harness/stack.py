"""A whole gateway stack for one benchmark: nats-server, the fixed-latency backend and a
gateway, up and healthy, stopped after (the logs' tails printed when the benchmark fails)."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eventlog import connect
from eventlog.server import NatsServer, free_port
from harness.load import Conversation
from harness.processes import (
    Procs,
    backend_command,
    gateway_command,
    gateway_env,
    spawn,
    stop_process,
    wait_http,
)
from harness.reporting import say
from harness.surfaces import REPLY_TEXT


def reply_ids(model_dir: Path) -> list[int]:
    """The tool call's tokens and the end of turn, as the tiny model's tokenizer makes them."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [*tokenizer.encode(REPLY_TEXT, add_special_tokens=False), int(tokenizer.eos_token_id)]


@dataclass
class BenchStack:
    """The processes a gateway benchmark runs against, up and healthy."""

    model_dir: Path
    gateway_url: str
    procs: Procs
    js: Any  # a JetStream context on the stack's nats-server
    backend_url: str = ""  # the fixed-latency backend (a benchmark's direct path)


@contextlib.asynccontextmanager
async def fixed_latency_stack(
    args: argparse.Namespace,
    tmp: Path,
    max_context: int,
    name: str,
    *,
    model_dir: Path | None = None,
    completion: list[int] | None = None,
    source_tree: Path | None = None,
    gateway_flags: list[str] | None = None,
) -> AsyncIterator[BenchStack]:
    """nats-server, the fixed-latency backend (its reply: ``completion``, by default the Bash
    tool call) and a gateway serving ``model_dir`` (default: the tiny model), all with
    ``max_context``; the logs' tails are printed when the body fails. ``source_tree``: the
    checkout whose code the gateway runs (``harness/gateway_launcher.py --source-tree``);
    ``gateway_flags``: more of ``turnstream gateway``'s flags."""
    from gateway.model import ensure_tiny_model

    t0 = time.perf_counter()
    model_dir = model_dir or ensure_tiny_model(Path(args.model_cache))
    completion = completion or reply_ids(model_dir)
    conv = Conversation([], [], (completion[-1],), completion, len(completion))
    say(f"tiny model ready in {time.perf_counter() - t0:.1f} s; reply: {len(completion)} tokens")
    log_dir = tmp / "logs"
    log_dir.mkdir()
    nats = NatsServer(tmp / "nats").start()
    backend_port, gateway_port = free_port(), free_port()
    backend_url = f"http://127.0.0.1:{backend_port}"
    gateway_url = f"http://127.0.0.1:{gateway_port}"
    backend_cmd = backend_command(args, backend_port, conv, model_dir.name)
    if (model_dir / "preprocessor_config.json").is_file():  # a vision model: images too
        backend_cmd += ["--vision-model-dir", str(model_dir)]
    backend = spawn(
        [*backend_cmd, "--max-model-len", str(max_context)], log_dir / "backend.log", os.environ
    )
    gateway_cmd = gateway_command(
        args,
        model_dir,
        nats.url,
        backend_url,
        gateway_port,
        tmp / "data",
        tmp / "gc.json",
        source_tree,
    )
    gateway_cmd[gateway_cmd.index("--max-context") + 1] = str(max_context)
    gateway_cmd += gateway_flags or []
    gateway: Any = None
    nc = None
    try:
        await wait_http(f"{backend_url}/health", backend, "fixed-latency backend", 30)
        gateway = spawn(gateway_cmd, log_dir / "gateway.log", gateway_env(args))
        procs = Procs(backend, gateway, nats)
        await wait_http(f"{gateway_url}/health", gateway, "gateway", 120)
        say(
            f"backend (pid {backend.pid}), gateway (pid {gateway.pid}), nats-server "
            f"(pid {nats.pid}) up in {time.perf_counter() - t0:.1f} s"
        )
        nc = await connect(nats.url, name=name)
        yield BenchStack(model_dir, gateway_url, procs, nc.jetstream(), backend_url)
    except BaseException:
        for log_file in sorted(log_dir.iterdir()):
            say(f"--- {log_file.name} (tail) ---\n{log_file.read_text(errors='replace')[-4000:]}")
        raise
    finally:
        if nc is not None:
            await nc.close()
        if gateway is not None:
            stop_process(gateway, signal.SIGINT, 60 if args.profile_gateway else 20)
        stop_process(backend, signal.SIGTERM)
        nats.stop()
