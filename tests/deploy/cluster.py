"""The shipped 3-node NATS cluster (``infra/nats/cluster-node-*.conf``) run on localhost.

Each node runs the config we ship, rendered for one machine: its client, monitoring and route
ports become free ports, the routes point at the other nodes' route ports on 127.0.0.1, and its
store is a directory of the test's. Rendering fails, naming the line, when the shipped file no
longer has the shape it expects, so the test never quietly runs a config of its own.

A node is anything with ``name``, ``url``, ``monitor_url``, ``start()`` and ``kill()`` (SIGKILL)
(``ClusterMember``): here a container of the locally built NATS image started through
testcontainers (``tests/deploy/containers.py``), and ``LocalCluster`` needs nothing more of it.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import nats.errors
from nats.js import JetStreamContext

from eventlog.server import free_ports
from tests.chaos.audit import log_sessions
from tests.deploy.containers import NatsContainer
from tests.helpers.services import LAUNCHER, Service

INFRA_NATS = Path(__file__).parents[2] / "infra" / "nats"
SIZE = 3
REPLICAS = ("--log.replicas", "3")  # every stream and bucket on all three nodes


class ClusterMember(Protocol):
    """What the cluster test needs of a node, whatever runs it."""

    @property
    def name(self) -> str: ...  # its server_name: what stream_info(...).cluster.leader names

    @property
    def url(self) -> str: ...

    @property
    def monitor_url(self) -> str: ...  # http://host:port of /healthz, /jsz

    def start(self) -> object: ...

    def kill(self) -> None: ...

    def stop(self) -> None: ...  # gone for good, its resources released


def shipped_config(number: int) -> Path:
    return INFRA_NATS / f"cluster-node-{number}.conf"


def _replace(text: str, pattern: str, new: str, *, expected: int, where: Path) -> str:
    rendered, found = re.subn(pattern, new, text, flags=re.MULTILINE)
    if found != expected:
        raise ValueError(
            f"{where}: expected {expected} line(s) matching {pattern!r}, found {found}; the "
            f"cluster test renders the shipped config for localhost: update "
            f"tests/deploy/cluster.py to the config's new shape"
        )
    return rendered


def render_node_config(
    shipped: Path,
    *,
    port: int,
    http_port: int,
    route_port: int,
    route_ports: Mapping[str, int],
    store_dir: Path,
) -> str:
    """``shipped`` with localhost ports and ``store_dir``; ``route_ports``: server name (the
    route's host in the shipped file, nats-1...) -> the route port that node listens on."""
    text = shipped.read_text()
    text = _replace(text, r"^port: \d+", f"port: {port}", expected=1, where=shipped)
    text = _replace(text, r"^http_port: \d+", f"http_port: {http_port}", expected=1, where=shipped)
    text = _replace(
        text,
        r"^(\s+)listen: [\w.]+:\d+",
        rf"\g<1>listen: 127.0.0.1:{route_port}",
        expected=1,
        where=shipped,
    )
    text = _replace(
        text,
        r'^(\s+)store_dir: ".*"',
        rf"\g<1>store_dir: {json.dumps(str(store_dir.resolve()))}",
        expected=1,
        where=shipped,
    )
    for name, node_port in route_ports.items():
        text = _replace(
            text,
            rf"nats-route://{re.escape(name)}:\d+",
            f"nats-route://127.0.0.1:{node_port}",
            expected=1,
            where=shipped,
        )
    return text


def _server_name(shipped: Path) -> str:
    found = re.search(r"^server_name: ([\w-]+)", shipped.read_text(), flags=re.MULTILINE)
    if found is None:
        raise ValueError(f"{shipped}: no `server_name:` line; every cluster node needs one")
    return found[1]


def container_nodes(image: str, root: Path, size: int = SIZE) -> list[NatsContainer]:
    """The shipped nodes 1..size as containers of ``image`` (testcontainers, host network):
    each runs its config rendered for this machine, its store a directory under ``root`` (at
    the same path inside, where the rendered config puts it). Created, not started."""
    shipped = [shipped_config(n) for n in range(1, size + 1)]
    ports = iter(free_ports(3 * len(shipped)))  # routes, clients, monitors: all distinct
    route_ports = {_server_name(path): next(ports) for path in shipped}
    nodes = []
    for path, name in zip(shipped, route_ports, strict=True):
        port, http_port, store = next(ports), next(ports), root / name
        store.mkdir(parents=True, exist_ok=True)
        config = root / f"{name}.conf"
        config.write_text(
            render_node_config(
                path,
                port=port,
                http_port=http_port,
                route_port=route_ports[name],
                route_ports=route_ports,
                store_dir=store,
            )
        )
        nodes.append(
            NatsContainer(
                image,
                config,
                client_port=port,
                monitor_port=http_port,
                name=name,
                store_dir=store,
            )
        )
    return nodes


def jsz(member: ClusterMember, timeout: float = 2.0) -> dict[str, Any]:
    """The node's /jsz (JetStream state; ``meta_cluster``: the meta leader and its peers)."""
    with urllib.request.urlopen(f"{member.monitor_url}/jsz", timeout=timeout) as resp:
        body: dict[str, Any] = json.load(resp)
        return body


class LocalCluster:
    """Three nodes clustered on this machine; services join with ``urls``."""

    def __init__(self, nodes: Sequence[ClusterMember]) -> None:
        self.nodes = list(nodes)

    @property
    def urls(self) -> str:
        """Every node's URL, comma separated: what ``--log.url`` takes."""
        return ",".join(node.url for node in self.nodes)

    def node(self, name: str) -> ClusterMember:
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(f"no node named {name!r}: the cluster has {[n.name for n in self.nodes]}")

    def start(self) -> LocalCluster:
        for node in self.nodes:
            node.start()
        return self

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def meta_leader(self, members: Sequence[ClusterMember] | None = None) -> str | None:
        """The meta leader every one of ``members`` (default: all) agrees on, one of them, all
        of them seeing the whole cluster; None while they do not (yet). Survivors of a kill go
        on naming the dead leader until they notice: that is no leader."""
        members = list(members if members is not None else self.nodes)
        leaders = set()
        for member in members:
            try:
                meta = jsz(member).get("meta_cluster") or {}
            except OSError:
                return None
            if meta.get("cluster_size") != len(self.nodes):
                return None
            leaders.add(meta.get("leader"))
        if len(leaders) != 1:
            return None
        leader = leaders.pop()
        return str(leader) if leader in {m.name for m in members} else None

    def wait_meta_leader(
        self, within: float, members: Sequence[ClusterMember] | None = None
    ) -> tuple[str, float]:
        """(the meta leader's name, seconds it took), or AssertionError saying what each node
        reports."""
        started = time.monotonic()
        while (leader := self.meta_leader(members)) is None:
            if time.monotonic() - started > within:
                raise AssertionError(
                    f"the NATS cluster had no meta leader agreed on by all nodes within "
                    f"{within:g}s: {self.describe()}"
                )
            time.sleep(0.1)
        return leader, time.monotonic() - started

    def describe(self) -> str:
        """What each node says of the cluster, for failure messages."""
        said = []
        for node in self.nodes:
            try:
                meta = jsz(node).get("meta_cluster") or {}
                said.append(
                    f"{node.name}: leader {meta.get('leader')!r}, "
                    f"size {meta.get('cluster_size')}, peers "
                    f"{[r.get('name') for r in meta.get('replicas') or []]}"
                )
            except OSError as exc:
                said.append(f"{node.name}: /jsz unreachable ({exc})")
        return "; ".join(said)


def provision(urls: str, data_dir: Path) -> None:
    """``turnstream provision --log.replicas 3``: every stream and bucket R3 on the cluster."""
    result = subprocess.run(
        [*LAUNCHER, "provision", "--log.url", urls, *REPLICAS, "--data-dir", str(data_dir)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, (
        f"turnstream provision --log.replicas 3 failed on the cluster:\n"
        f"{result.stdout[-3000:]}{result.stderr[-3000:]}"
    )


async def wait_pipeline_idle(
    js: JetStreamContext, run: str, services: Sequence[Service], within: float
) -> None:
    """Every session in EVENTS closed (by its agent or the reaper) and folded, every trajectory
    written: the fold and shard-writer consumers have nothing pending or unacked."""
    deadline = time.monotonic() + within
    while True:
        why = await _busy(js, run)
        if why is None:
            return
        for service in services:
            assert service.running, f"{service.command} exited:\n{service.output()}"
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {s.command}\n{s.output()}" for s in services)
            raise AssertionError(f"the pipeline was not idle within {within:g}s: {why}\n{logs}")
        await asyncio.sleep(0.5)


async def _busy(js: JetStreamContext, run: str) -> str | None:
    try:
        sessions, closed = await log_sessions(js, run)
        if sessions - closed:
            return f"{len(sessions - closed)} session(s) not closed yet"
        for stream, durable in (("EVENTS", "fold"), ("TRAJ", "shard-writer")):
            info = await js.consumer_info(stream, durable)
            if info.num_pending or info.num_ack_pending:
                pending, unacked = info.num_pending, info.num_ack_pending
                return f"{stream}/{durable}: {pending} pending, {unacked} unacked"
    except (nats.errors.Error, TimeoutError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None
