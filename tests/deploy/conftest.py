"""Fixtures of the deploy tests: the Docker engine, the locally built images, NATS containers.

``docker_engine`` installs and starts the engine when none answers (tests/deploy/engine.py) and
points this process, docker-compose and testcontainers at it (``DOCKER_HOST``); at the end of
the session it stops the engine the tests started, unless another session still uses it or
``TURNSTREAM_KEEP_DOCKER=1`` keeps it for the next run (tests/deploy/engine_use.py). A step that
cannot be done fails the test with the reason: these tests never skip.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from eventlog.server import free_ports
from tests.deploy.cluster import LocalCluster, container_nodes
from tests.deploy.containers import NatsContainer, start_nats_container
from tests.deploy.engine import (
    REPO,
    DeployError,
    Images,
    ensure_base_image,
    ensure_images,
    ensure_nats_image,
    progress,
)
from tests.deploy.engine_use import end_use, keep_requested, use_engine
from tests.deploy.vllm_server import prepare_in_background

SINGLE_NODE_CONFIG = REPO / "infra" / "nats" / "single-node.conf"


@pytest.fixture(scope="session")
def docker_engine() -> Iterator[str]:
    """DOCKER_HOST of a Docker engine that answers (started if needed); at the session's end
    the tests' engine is stopped unless kept (``end_use``)."""
    try:
        use = use_engine()
    except DeployError as exc:
        pytest.fail(f"the Docker engine cannot start: {exc}", pytrace=False)
    os.environ["DOCKER_HOST"] = use.host
    yield use.host
    progress(end_use(use, keep=keep_requested()))


@pytest.fixture(scope="session")
def images(docker_engine: str) -> Images:
    """The base, NATS and turnstream images, built on this engine if their inputs changed."""
    try:
        return ensure_images()
    except DeployError as exc:
        pytest.fail(f"the deploy images cannot be built: {exc}", pytrace=False)


@pytest.fixture(scope="session")
def nats_image(docker_engine: str) -> str:
    """The locally built NATS image alone (no turnstream image build for NATS-only tests)."""
    try:
        return ensure_nats_image(ensure_base_image())
    except DeployError as exc:
        pytest.fail(f"the NATS image cannot be built: {exc}", pytrace=False)


@pytest.fixture
def nats_container(nats_image: str) -> Iterator[NatsContainer]:
    """The shipped single-node config in the locally built NATS image, on free ports."""
    client_port, monitor_port = free_ports(2)
    container = start_nats_container(
        nats_image,
        SINGLE_NODE_CONFIG,
        client_port=client_port,
        monitor_port=monitor_port,
        name=f"nats-{os.getpid()}",
    )
    yield container
    container.stop()


@pytest.fixture
def cluster(nats_image: str, tmp_path: Path) -> Iterator[LocalCluster]:
    """The shipped 3-node cluster in containers of the locally built NATS image."""
    started = LocalCluster(container_nodes(nats_image, tmp_path / "nats"))
    try:
        started.start()
    except AssertionError as exc:
        started.stop()
        pytest.fail(
            f"the 3-node NATS cluster (infra/nats/cluster-node-*.conf) did not start: {exc}"
        )
    yield started
    started.stop()


@pytest.fixture
def world_readable_model(tiny_model_dir: Path, tmp_path: Path) -> Path:
    """The tiny model, readable by the image's non-root user when bind-mounted."""
    target = tmp_path / "model"
    shutil.copytree(tiny_model_dir, target)
    for path in [target, *target.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return target


def pytest_collection_finish(session: pytest.Session) -> None:
    """vLLM's venv and model are made in the background while the Docker tests run first."""
    if any(item.path.name == "test_vllm.py" for item in session.items):
        prepare_in_background()
