"""A round-robin TCP proxy in front of the soak's gateways: a load balancer without affinity.

    python -m tests.chaos.proxy --port P --backend 127.0.0.1:G0 --backend 127.0.0.1:G1 \
        --stats DATA/proxy-stats.json

Each accepted connection goes to the next backend in turn (HAProxy's ``mode tcp`` with
``balance roundrobin``). A backend that refuses the connection (a gateway SIGKILLed and not back
yet) is skipped for the next one, as HAProxy's ``option redispatch`` does; a client whose every
backend refuses has its connection closed. Bytes are relayed unchanged both ways, and when either
side closes or resets the other is closed too: a gateway killed mid-request is a cut connection
for its client, as behind a real load balancer.

Per connection is per request here: the soak's agents open a fresh connection for every request
(``Limits(max_keepalive_connections=0)``, ``tests.chaos.agents``), so the turns of one session
land on either gateway as the proxy's turn falls, and no HTTP parsing stands between what a
gateway answered and what its client saw. Why not HAProxy itself: it is a Debian package, and
``make test`` installs nothing with apt-get.

``--stats`` is rewritten once a second with the connections each backend took and the refused
connects, for the soak's summary.

With ``--delay-file`` (one backend: nats-server, issue 38) every chunk of bytes is held that
many seconds (the file's number, read once a second; 0 or no file: none) before it is passed
on, both ways: a server that answers slowly, its pings and acks late, while the bytes still flow
at full rate behind the delay (a latency, as a congested link or a stalling disk gives, not a
throttle).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import signal
from collections import Counter
from collections.abc import Callable
from pathlib import Path

CONNECT_TIMEOUT_S = 5.0
CHUNK = 64 * 1024


class RoundRobin:
    def __init__(self, backends: list[tuple[str, int]]) -> None:
        self.backends = backends
        self.delay_s = 0.0  # added to every chunk relayed (--delay-file)
        self.delayed_chunks = 0
        self.turn = itertools.count()
        self.connections: Counter[str] = Counter()  # per backend, "host:port"
        self.refused: Counter[str] = Counter()  # connects a backend refused (then the next)
        self.dropped = 0  # clients whose every backend refused

    async def serve(
        self, client_reader: asyncio.StreamReader, client: asyncio.StreamWriter
    ) -> None:
        first = next(self.turn)
        for i in range(len(self.backends)):
            host, port = self.backends[(first + i) % len(self.backends)]
            try:
                upstream_reader, upstream = await asyncio.wait_for(
                    asyncio.open_connection(host, port), CONNECT_TIMEOUT_S
                )
            except (OSError, TimeoutError):
                self.refused[f"{host}:{port}"] += 1
                continue
            self.connections[f"{host}:{port}"] += 1
            await _pipe_both(client_reader, client, upstream_reader, upstream, self._delay)
            return
        self.dropped += 1
        client.transport.abort()

    def _delay(self) -> float:
        if self.delay_s:
            self.delayed_chunks += 1
        return self.delay_s

    def stats(self) -> dict[str, object]:
        return {
            "connections": dict(sorted(self.connections.items())),
            "refused": dict(sorted(self.refused.items())),
            "dropped": self.dropped,
            "delayed_chunks": self.delayed_chunks,
        }


async def _pipe_both(
    a_reader: asyncio.StreamReader,
    a: asyncio.StreamWriter,
    b_reader: asyncio.StreamReader,
    b: asyncio.StreamWriter,
    delay: Callable[[], float],
) -> None:
    """Relay both ways until either side ends; then end both."""
    pumps = [
        asyncio.create_task(_pipe(a_reader, b, delay)),
        asyncio.create_task(_pipe(b_reader, a, delay)),
    ]
    try:
        await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pump in pumps:
            pump.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        for writer in (a, b):
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


async def _pipe(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: Callable[[], float]
) -> None:
    """Relay ``reader`` to ``writer``, each chunk ``delay()`` seconds after it was read: the
    reading goes on meanwhile, so a delay adds latency, not a cap on the rate. A chunk read
    under no delay still waits for those before it: the order of bytes is kept."""
    loop = asyncio.get_running_loop()
    held: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def read() -> None:
        try:
            while data := await reader.read(CHUNK):
                held.put_nowait((loop.time() + delay(), data))
        finally:
            held.put_nowait((0.0, b""))  # the end, or a reset

    reading = asyncio.create_task(read())
    try:
        with contextlib.suppress(OSError):  # a reset: the other side is closed by the caller
            while True:
                due, data = await held.get()
                if not data:
                    break
                if due > loop.time():
                    await asyncio.sleep(due - loop.time())
                writer.write(data)
                await writer.drain()
            await reading  # its error, if it ended by one
    finally:
        reading.cancel()
        with contextlib.suppress(asyncio.CancelledError, OSError):
            await reading


async def main_async(
    port: int, backends: list[tuple[str, int]], stats: Path | None, delay_file: Path | None = None
) -> None:
    balancer = RoundRobin(backends)
    server = await asyncio.start_server(balancer.serve, "127.0.0.1", port, backlog=1024)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopping.set)
    print(f"round robin on 127.0.0.1:{port} over {backends}", flush=True)
    async with server:
        while not stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), 1.0)
            if delay_file is not None:
                balancer.delay_s = _read_delay(delay_file, balancer.delay_s)
            if stats is not None:
                temporary = stats.with_suffix(".tmp")
                temporary.write_text(json.dumps(balancer.stats()))
                temporary.replace(stats)
    print(f"stopped: {balancer.stats()}", flush=True)


def _read_delay(path: Path, current: float) -> float:
    """The file's delay in seconds (none: 0); ``current`` while it is being replaced."""
    try:
        return float(path.read_text().strip() or 0)
    except FileNotFoundError:
        return 0.0
    except (OSError, ValueError):
        return current


def _backend(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host or "127.0.0.1", int(port)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos.proxy", description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--backend", type=_backend, action="append", required=True)
    parser.add_argument("--stats", type=Path, default=None)
    parser.add_argument("--delay-file", type=Path, default=None, help="seconds to add; 0: none")
    args = parser.parse_args(argv)
    asyncio.run(main_async(args.port, args.backend, args.stats, args.delay_file))


if __name__ == "__main__":
    main()
