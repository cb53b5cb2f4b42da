"""The floor of a Claude-Code-shaped later turn (issue 40, point 2): what any gateway that reads
the client's request and sends the backend its prompt must spend, measured in this process on
the very bytes of a session the gateway served.

Per later turn (every turn but a session's first), the CPU (``time.thread_time``: this thread's
user + system time, so the kernel's loopback copies count) of:

* parsing the request's bytes: ``msgspec.json.decode`` of the body as sent, to Python objects;
* encoding the new messages: the tokenizer's encode (the Rust tokenizer, as the gateway calls
  it) of the text the turn's new prompt tokens stand for (from EVENTS: ``prompt_ids`` past
  ``prefix_len``, decoded);
* writing the prompt to the backend: ``sendall`` of the ``/v1/completions`` request the gateway
  sends (``gateway.backends.vllm.completion_request`` of the turn's whole prompt, its JSON
  encoded beforehand, untimed) over a loopback TCP connection that a thread here drains.

Each is timed ``REPEATS`` times and its minimum kept (a floor: the machine's load only adds);
the turn's floor is their sum, the session's the mean over its later turns."""

from __future__ import annotations

import socket
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

REPEATS = 5


def cpu_ms(action: Callable[[], object], repeats: int = REPEATS) -> float:
    """The least CPU (this thread's, ms) of ``repeats`` runs of ``action``."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.thread_time()
        action()
        best = min(best, time.thread_time() - t0)
    return 1000 * best


class LoopbackSink:
    """A loopback TCP connection whose far end a thread reads and drops (the backend's part)."""

    def __init__(self) -> None:
        with socket.create_server(("127.0.0.1", 0)) as server:
            self.writer = socket.create_connection(server.getsockname())
            self.reader, _ = server.accept()
        self.writer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._drain = threading.Thread(target=self._drop, daemon=True)
        self._drain.start()

    def _drop(self) -> None:
        while self.reader.recv(1 << 20):
            pass

    def close(self) -> None:
        self.writer.close()
        self._drain.join(5)
        self.reader.close()


def backend_request(model: str, ids: np.ndarray, max_tokens: int) -> bytes:
    """The bytes of the ``/v1/completions`` request the gateway sends for this prompt."""
    from gateway.backends.interface import Prompt, SamplingParams
    from gateway.backends.vllm import completion_request

    body = msgspec.json.encode(
        completion_request(model, Prompt(ids), SamplingParams(max_tokens=max_tokens))
    )
    head = (
        f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode()
    return head + body


def session_floor(
    bodies: list[bytes], turns: list[Any], model_dir: Path, max_tokens: int
) -> dict[str, float]:
    """Mean floor (ms) of the session's later turns: ``bodies[k]`` is turn k's request as sent,
    ``turns[k]`` its TurnCompleted (a linear session: turn k's context is every earlier turn's
    prompt and completion)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    sink = LoopbackSink()
    parts: dict[str, list[float]] = {"decode": [], "encode": [], "write": []}
    try:
        context = np.empty(0, dtype=np.int32)
        for k, (body, turn) in enumerate(zip(bodies, turns, strict=True)):
            prompt = np.concatenate((context[: turn.prefix_len], turn.prompt_ids))
            context = np.concatenate((prompt, turn.completion_ids))
            if k == 0:
                continue  # the first turn tokenizes its whole prompt: not a later turn
            new_text = tokenizer.decode(turn.prompt_ids.tolist(), skip_special_tokens=False)
            request = backend_request(model_dir.name, prompt, max_tokens)
            parts["decode"].append(cpu_ms(lambda b=body: msgspec.json.decode(b)))
            parts["encode"].append(
                cpu_ms(lambda t=new_text: tokenizer.encode(t, add_special_tokens=False))
            )
            parts["write"].append(cpu_ms(lambda r=request: sink.writer.sendall(r)))
    finally:
        sink.close()
    means = {f"{name}_ms": statistics.fmean(values) for name, values in parts.items()}
    return {
        "floor_ms": sum(means.values()),
        **means,
        "later_turns": len(parts["decode"]),
        "mean_body_bytes": statistics.fmean(len(b) for b in bodies[1:]),
    }


async def api_floors(
    js: Any, sessions: dict[str, tuple[str, list[bytes]]], model_dir: Path, max_tokens: int
) -> dict[str, dict[str, float]]:
    """Per API, ``session_floor`` of one whole session it sent (its id and request bodies),
    its turns read back from EVENTS."""
    from eventlog import read_session
    from harness.processes import RUN, STREAM
    from schemas.events import TurnCompleted

    floors = {}
    for api, (sid, bodies) in sessions.items():
        events = await read_session(js, RUN, sid, stream=STREAM)
        turns = sorted((e for e in events if isinstance(e, TurnCompleted)), key=lambda e: e.turn)
        floors[api] = session_floor(bodies, turns, model_dir, max_tokens)
    return floors


def later_turn_figures(
    later_turn_ms: dict[str, list[float]], floors: dict[str, dict[str, float]]
) -> dict[str, Any]:
    """The keys: per API the gateway's mean CPU per later turn beside its floor; the headline
    is the worst API's, with that API's floor and the ratio of the two."""
    per_api: dict[str, dict[str, float]] = {}
    for api, floor in floors.items():
        cpu = statistics.fmean(later_turn_ms[api])
        per_api[api] = {
            "cpu_ms": round(cpu, 3),
            "measured_turns": len(later_turn_ms[api]),
            **{k: round(v, 3) for k, v in floor.items()},
            "ratio_to_floor": round(cpu / floor["floor_ms"], 2),
        }
    worst = max(per_api, key=lambda api: per_api[api]["cpu_ms"])
    return {
        "claude_code_turn_cpu_ms": per_api[worst]["cpu_ms"],
        "claude_code_turn_floor_cpu_ms": per_api[worst]["floor_ms"],
        "claude_code_turn_ratio_to_floor": per_api[worst]["ratio_to_floor"],
        "claude_code_turn_worst_api": worst,
        "claude_code_turn": per_api,
    }
