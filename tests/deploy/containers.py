"""NATS servers in containers, started through ``testcontainers`` on the local engine.

The engine here has no bridge network: every container shares the host's network, so a
container's ports are host ports (``HostNetworkContainer`` says so to testcontainers, whose
waits would otherwise look for port mappings). ``NatsContainer`` has what the cluster test's
``ClusterMember`` asks for: ``name``, ``url``, ``monitor_url``, ``start()``, ``kill()`` (SIGKILL),
and ``restart()`` brings the same container (same store) back.
"""

from __future__ import annotations

import os
import time
import urllib.error
import urllib.request
from pathlib import Path

# No registry is reachable: testcontainers' reaper (ryuk) image cannot be pulled. Fixtures stop
# what they start; `docker ps --filter label=org.testcontainers` shows anything left behind.
os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")

from testcontainers.core.container import DockerContainer

CONFIG_IN_CONTAINER = "/etc/nats/turnstream.conf"
HEALTH = "/healthz?js-enabled-only=true"


class HostNetworkContainer(DockerContainer):
    """A container on the host's network: a port inside is the same port on 127.0.0.1."""

    def __init__(self, image: str) -> None:
        super().__init__(image)
        self.with_kwargs(network_mode="host")

    def get_container_host_ip(self) -> str:
        return "127.0.0.1"

    def get_exposed_port(self, port: int) -> int:
        return port


class NatsContainer:
    """One nats-server container with JetStream, from a config file (flags set its ports)."""

    def __init__(
        self,
        image: str,
        config_path: Path,
        *,
        client_port: int,
        monitor_port: int,
        name: str,
        store_dir: Path | None = None,
    ) -> None:
        self.name = name
        self.url = f"nats://127.0.0.1:{client_port}"
        self.monitor_url = f"http://127.0.0.1:{monitor_port}"
        self.container = HostNetworkContainer(image).with_command(
            [
                "--config",
                CONFIG_IN_CONTAINER,
                "--port",
                str(client_port),
                "--http_port",
                str(monitor_port),
                "--server_name",
                name,
            ]
        )
        self.container.with_volume_mapping(str(config_path.resolve()), CONFIG_IN_CONTAINER, "ro")
        if store_dir is not None:  # at the same path inside, so a rendered config's store_dir holds
            store_dir.mkdir(parents=True, exist_ok=True)
            self.container.with_volume_mapping(str(store_dir), str(store_dir), "rw")
        self._created = False

    def start(self, within: float = 60.0) -> NatsContainer:
        """Create and start it (first call) or start it again (after ``kill``); wait healthy."""
        if self._created:
            self.container.get_wrapped_container().start()
        else:
            self.container.start()
            self._created = True
        self.wait_healthy(within)
        return self

    def restart(self, within: float = 60.0) -> NatsContainer:
        return self.start(within)

    def kill(self) -> None:
        """SIGKILL the server (``docker kill``): what JetStream acknowledged must survive."""
        wrapped = self.container.get_wrapped_container()
        wrapped.kill()
        deadline = time.monotonic() + 30
        while self.status() == "running":
            if time.monotonic() > deadline:
                raise AssertionError(f"container {self.name} still running 30s after SIGKILL")
            time.sleep(0.1)

    def stop(self) -> None:
        """Remove the container and its anonymous volumes."""
        if self._created:
            self.container.stop()
            self._created = False

    def status(self) -> str:
        """The engine's word for the container now: running, exited, ..."""
        self.container.reload()
        return self.container.status

    def logs(self) -> str:
        stdout, stderr = self.container.get_logs()
        return (stdout + stderr).decode(errors="replace")[-4000:]

    def wait_healthy(self, within: float) -> None:
        """``/healthz?js-enabled-only=true`` answers 200 once JetStream is ready; a cluster node
        answers before the cluster has formed (plain ``/healthz`` waits for a meta leader, which
        needs the other nodes started too)."""
        deadline = time.monotonic() + within
        while True:
            try:
                with urllib.request.urlopen(f"{self.monitor_url}{HEALTH}", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if self.status() not in ("running", "created"):
                raise AssertionError(f"NATS container {self.name} exited:\n{self.logs()}")
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"NATS container {self.name}: {self.monitor_url}{HEALTH} not 200 in "
                    f"{within:.0f}s:\n{self.logs()}"
                )
            time.sleep(0.2)


def start_nats_container(
    image: str,
    config_path: Path,
    *,
    client_port: int,
    monitor_port: int,
    name: str = "nats",
    store_dir: Path | None = None,
) -> NatsContainer:
    """A started NATS container (healthy); the caller ``stop()``s it."""
    return NatsContainer(
        image,
        config_path,
        client_port=client_port,
        monitor_port=monitor_port,
        name=name,
        store_dir=store_dir,
    ).start()
