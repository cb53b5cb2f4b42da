"""``infra/docker-compose.yml`` run by docker-compose on the test engine, as shipped but for the
network: the engine here has no bridge network, so every service shares the host's.

``host_network_variant`` writes that variant: the same file with every service on the host's
network and no published ports (docker-compose 1.29 refuses both at once, and an override file
cannot remove a list), every other line as shipped. ``fleet_ports`` are the variables that
give each of the three gateways a host port of its own and tell the load balancer where they
are (on a bridge network each has its own address and all listen on 8000).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

from eventlog.server import free_ports
from tests.deploy.engine import REPO, DeployError, run

COMPOSE_FILE = REPO / "infra" / "docker-compose.yml"
IMAGE_UID = 10001  # infra/Dockerfile's user: it writes the shards
GATEWAYS = ("gateway-1", "gateway-2", "gateway-3")


def host_network_variant(shipped: Path, out: Path) -> Path:
    """``shipped`` with every service on the host's network (and so no ``ports:``)."""
    spec = yaml.safe_load(shipped.read_text())
    for service in spec["services"].values():
        service.pop("ports", None)
        service["network_mode"] = "host"
    out.write_text(yaml.safe_dump(spec, sort_keys=False))
    return out


@dataclass(frozen=True)
class FleetPorts:
    """The load balancer's port (what agents use) and each gateway's, on the host."""

    lb: int
    gateways: tuple[int, ...]

    def env(self) -> dict[str, str]:
        """The compose file's variables for these ports."""
        env = {"TURNSTREAM_PORT": str(self.lb)}
        for number, port in enumerate(self.gateways, start=1):
            env[f"GATEWAY_{number}_PORT"] = str(port)
            env[f"GATEWAY_{number}_ADDR"] = f"127.0.0.1:{port}"
        return env

    def gateway_url(self, service: str) -> str:
        return f"http://127.0.0.1:{self.gateways[GATEWAYS.index(service)]}"

    @property
    def lb_url(self) -> str:
        return f"http://127.0.0.1:{self.lb}"


def fleet_ports() -> FleetPorts:
    lb, *gateways = free_ports(1 + len(GATEWAYS))
    return FleetPorts(lb, tuple(gateways))


@dataclass
class Compose:
    """docker-compose on one project (its own containers and volumes) with a fixed environment."""

    project: str
    file: Path
    env: dict[str, str]

    def __call__(self, *args: str, timeout: float = 600) -> str:
        # --project-directory: relative paths (./nats/...) resolve as in the shipped file.
        command = ["docker-compose", "-p", self.project, "-f", str(self.file)]
        command += ["--project-directory", str(COMPOSE_FILE.parent), *args]
        return run(command, timeout=timeout, env=self.env)

    def logs(self, *services: str) -> str:
        try:
            return self("logs", "--no-color", "--tail", "40", *services, timeout=60)[-12000:]
        except DeployError as exc:
            return str(exc)

    def down(self) -> None:
        """``down -v``; a second try when the engine is slow to let go of a volume."""
        for attempt in (1, 2):
            try:
                self("down", "-v", "--remove-orphans", "--timeout", "10")
                return
            except DeployError:
                if attempt == 2:
                    raise
                time.sleep(5)


def wait_fleet(ports: FleetPorts, compose: Compose, within: float = 240) -> None:
    """Every gateway healthy, then the load balancer passing requests on (a 200 on /health)."""
    started = time.monotonic()
    for service in GATEWAYS:
        url = f"{ports.gateway_url(service)}/health"
        while not answers(url):
            if time.monotonic() - started > within:
                raise AssertionError(
                    f"{service} not healthy at {url} within {within:g}s:\n{compose.logs()}"
                )
            time.sleep(0.2)
    while not answers(f"{ports.lb_url}/health"):
        if time.monotonic() - started > within:
            raise AssertionError(f"the load balancer at {ports.lb_url} passes nothing on")
        time.sleep(0.2)


def answers(url: str) -> bool:
    """``url`` answers 200 now."""
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
