"""``turnstream gateway``: the OpenAI-compatible gateway as a service.

Assembles the parts (the log, the publisher and its outbox, the tokenizer and chat template, the
backend, the session service) and serves them with uvicorn. ``build_gateway`` is also what the
embedded stack mounts in-process.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import importlib.util
import logging
import socket
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import httpx
import uvicorn
from fastapi import FastAPI
from pydantic import Field, field_validator
from pydantic_settings import SettingsConfigDict

from eventlog import JetStreamPublisher, Outbox, answered, read_session
from gateway.backends.base import Backend
from gateway.backends.policy_watch import PolicyTarget, PolicyVersion, watch_policy
from gateway.backends.transport import Target
from gateway.http.app import create_app
from gateway.http.guard import BodyLimits
from gateway.metrics import GatewayMetrics
from gateway.serving import SessionService, TurnEngine
from gateway.sessions import SessionStore
from gateway.templates import ChatTemplate, load_tokenizer
from gateway.tools import get_parser
from gateway.turns import Kept
from schemas.errors import TurnstreamError
from turnstream.settings import PublishingSettings
from turnstream.stack import (
    EventLog,
    open_log,
    run_service,
    settle_heap,
    stop_on_signals,
    without_progress_bars,
)

if TYPE_CHECKING:
    from gateway.backends.local import LocalBackend

__all__ = [
    "GatewayCommand",
    "GatewaySettings",
    "build_gateway",
    "http_server",
    "http_url",
    "listening_socket",
    "serve_until",
]

log = logging.getLogger(__name__)


class GatewaySettings(PublishingSettings):
    """Run the OpenAI-compatible gateway; every turn is published to the log before it answers."""

    model_config = SettingsConfigDict(cli_prog_name="turnstream gateway")

    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8000, ge=0, le=65535, description="port to listen on")
    backend: Literal["local", "vllm", "sglang"] = Field("local", description="inference backend")
    backend_urls: list[str] = Field(
        default_factory=list, description="vllm/sglang replica URLs (sticky, least-loaded)"
    )
    model: Path | None = Field(
        None,
        description="local HF model dir (tokenizer + chat template; weights for local); "
        "unset: the built-in tiny model, created on first use",
    )
    model_name: str | None = Field(
        None,
        description="model name reported to clients (and sent to vllm/sglang); unset: the one "
        "the backend's /v1/models lists, else the model dir's name",
    )
    tool_parser: str = Field("hermes", description="tool-call format the model writes")
    api_keys: list[str] = Field(
        default_factory=list,
        description="bearer keys: KEY (every run) or KEY=RUN1,RUN2 (only those runs); "
        "empty: no auth",
    )
    metrics_auth: bool = Field(False, description="/metrics needs a key too (with --api-keys)")
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024, description="request body limit")
    body_timeout_s: float = Field(30.0, gt=0, description="deadline to receive a request body")
    max_json_depth: int = Field(64, ge=4, le=512, description="deepest JSON nesting accepted")
    kept_body_bytes: int = Field(
        256 * 1024 * 1024,
        ge=0,
        description="bytes of request bodies kept, each client session's last of 64 KiB or more, "
        "so that its next request decodes only what it adds to the conversation; 0: off",
    )
    max_open_sessions: int = Field(
        10_000,
        ge=1,
        description="sessions held in memory; the least recently used beyond it are evicted "
        "(and recovered from the log on their next request)",
    )
    session_turns_kept: int = Field(
        64,
        ge=1,
        description="turns of a session kept continuable token for token (its conversations' "
        "tips and their history); the least recently used beyond it are forgotten",
    )
    session_tokens_kept: int = Field(
        1 << 20,
        ge=1,
        description="tokens a session's kept turns may hold together (a chain of turns holds "
        "one array: its tip's); the least recently used turns beyond it are forgotten",
    )
    closed_session_grace_s: float = Field(
        60.0, ge=0, description="how long a closed session stays in memory"
    )
    allow_raw_logprobs: bool = Field(
        False,
        description="serve a sampling other than temperature 1 / top_p 1 on a vLLM replica in its "
        "default (raw) --logprobs-mode, recording its turns as logprobs_kind 'raw' (the trainer "
        "refuses them for importance ratios); off: such a turn is a 400 naming "
        "--logprobs-mode processed_logprobs",
    )
    max_concurrency: int = Field(4, ge=1, description="local backend: concurrent generations")
    torch_threads: int | None = Field(
        None,
        ge=1,
        description="local backend: torch intra-op threads; unset: 1 for models "
        "under 100M parameters (thread hand-offs cost more than they save), else torch's default",
    )
    max_inflight_per_replica: int = Field(32, ge=1, description="remote: requests per replica")
    max_context: int | None = Field(
        None, description="remote: context length of the model; unset: its max_model_len"
    )
    backend_wait_s: float = Field(
        120.0, ge=0, description="remote: how long to wait for the backend's /v1/models at start"
    )
    workers: int = Field(
        1,
        ge=1,
        le=256,
        description="gateway processes on the one port, each session served by the one that "
        "holds it (connections move to it, no proxy hop); --max-open-sessions is their total",
    )

    @field_validator("backend_urls")
    @classmethod
    def _http_urls(cls, urls: list[str]) -> list[str]:
        for url in urls:
            try:
                Target(url)  # what the backends parse it with
            except (httpx.InvalidURL, httpx.UnsupportedProtocol) as exc:
                raise ValueError(
                    f"{url!r} is not an http:// or https:// URL of a vLLM or SGLang server "
                    f"(e.g. http://127.0.0.1:8001): {exc}"
                ) from None
        return urls

    async def served(self) -> GatewaySettings:
        """These settings with ``model_name`` and ``max_context`` asked of a remote backend
        when unset (``gateway.backends.served_model``)."""
        if self.backend == "local" or (self.model_name and self.max_context):
            return self
        if not self.backend_urls:
            raise TurnstreamError(f"--backend {self.backend} needs --backend-urls URL [URL ...]")
        from gateway.backends.served_model import served_model

        model = await served_model(self.backend_urls, wait_s=self.backend_wait_s)
        max_context = self.max_context or model.max_context
        if max_context is None:
            raise TurnstreamError(
                f"the backend at {self.backend_urls[0]} does not say its context length "
                f"(max_model_len): pass --max-context"
            )
        log.info("backend serves %r, context %d tokens", model.name, max_context)
        return self.model_copy(
            update={"model_name": self.model_name or model.name, "max_context": max_context}
        )

    @property
    def model_dir(self) -> Path:
        if self.model is not None:
            return self.model
        try:
            from gateway.model import ensure_tiny_model
        except ImportError as exc:
            raise TurnstreamError(
                f"no --model given, and the built-in tiny model needs torch to be made ({exc}): "
                f"pass --model DIR (the served model's tokenizer and chat template), or pip "
                f"install 'turnstream[local]'"
            ) from exc
        return ensure_tiny_model(self.data_dir / "models")


@dataclass
class Gateway:
    app: FastAPI
    engine: TurnEngine
    sessions: SessionService
    publisher: JetStreamPublisher
    backend: Backend


def local_backend_class() -> type[LocalBackend]:
    """The built-in local backend, or a TurnstreamError naming the extra it needs (torch is not
    in the base install: a gateway in front of vLLM never loads it)."""
    try:
        from gateway.backends.local import LocalBackend
    except ImportError as exc:
        raise _needs_torch(f" ({exc})") from exc
    return LocalBackend


def import_gateway_modules(settings: GatewaySettings) -> None:
    """Import what building a gateway needs (transformers; torch and the local backend for
    ``--backend local``) before connecting to the log: seconds of imports on the event loop
    just after connecting leave the new connection unserved, and a nats-server restart in that
    window timed out the gateway's first requests (restarted gateways of the chaos soak exited
    on it). Not in the ``--workers`` supervisor, which builds no gateway. Also turns
    transformers' progress bars off (``without_progress_bars``)."""
    from transformers import GenerationConfig, TokenizersBackend

    del GenerationConfig, TokenizersBackend  # imported now; build_gateway uses them
    without_progress_bars()
    if settings.backend == "local":
        local_backend_class()


def require_local_backend() -> None:
    """Before anything starts, a missing torch is an error naming the extra to install. Looked
    up, not imported: the ``--workers`` supervisor never loads it, and a second ``up`` on a
    locked store exits before it would."""
    if importlib.util.find_spec("torch") is None:
        raise _needs_torch()


def _needs_torch(detail: str = "") -> TurnstreamError:
    return TurnstreamError(
        f"the local backend needs torch{detail}: pip install 'turnstream[local]', or serve a "
        f"remote model with --backend vllm / sglang"
    )


def _backend(settings: GatewaySettings, model_dir: Path, name: str) -> Backend:
    if settings.backend == "local":
        import torch

        backend = local_backend_class().load(model_dir, max_concurrency=settings.max_concurrency)
        threads = settings.torch_threads
        if threads is None and backend.num_parameters < 100_000_000:
            threads = 1
        if threads is not None:
            torch.set_num_threads(threads)
        return backend
    if not settings.backend_urls:
        raise TurnstreamError(f"--backend {settings.backend} needs --backend-urls URL [URL ...]")
    if settings.max_context is None:  # settings.served() fills it in
        raise TurnstreamError(f"--backend {settings.backend} needs --max-context (the model's)")
    from gateway.backends.router import ReplicaRouter

    replicas: list[Backend]
    if settings.backend == "vllm":
        from gateway.backends.vllm import VLLMBackend

        replicas = [
            VLLMBackend(url, name, backend_id=f"vllm-{i}", max_context=settings.max_context)
            for i, url in enumerate(settings.backend_urls)
        ]
    else:
        from gateway.backends.sglang import SGLangBackend

        replicas = [
            SGLangBackend(url, backend_id=f"sglang-{i}", max_context=settings.max_context)
            for i, url in enumerate(settings.backend_urls)
        ]
    return ReplicaRouter(replicas, max_inflight_per_replica=settings.max_inflight_per_replica)


async def _probe_logprobs(backend: Backend) -> None:
    """Ask every vLLM/SGLang replica what its log-probs are before serving (issue 19: a turn
    they would record wrongly is refused); each replica's kind and probe time are logged."""
    from gateway.backends.probe import probe_replicas
    from gateway.backends.router import ReplicaRouter

    replicas = backend.backends if isinstance(backend, ReplicaRouter) else (backend,)
    await probe_replicas(replicas)


@contextlib.asynccontextmanager
async def build_gateway(settings: GatewaySettings, event_log: EventLog) -> AsyncIterator[Gateway]:
    """The gateway app on ``event_log``; publisher, backend and policy watch live as long as it."""
    # transformers only where a gateway is built: not in the supervisor of `--workers N`.
    from transformers import GenerationConfig

    settings = await settings.served()
    model_dir = settings.model_dir
    # The built-in tiny model is served as "tiny"; a model directory under its own name.
    name = settings.model_name or (model_dir.name if settings.model is not None else "tiny")
    tokenizer = load_tokenizer(model_dir)
    # Every end token the model may sample closes its turn, not only the tokenizer's eos.
    try:
        eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    except OSError:  # no generation_config.json: the tokenizer's eos is all there is
        eos = None
    stop_ids = [eos] if isinstance(eos, int) else list(eos or [])
    backend = _backend(settings, model_dir, name)
    await _probe_logprobs(backend)
    outbox = (
        Outbox(settings.publisher.outbox_path, settings.publisher.outbox_max_bytes)
        if settings.publisher.outbox_path is not None
        else None
    )
    publisher = await JetStreamPublisher(event_log.nc, settings.publisher, outbox=outbox).start()
    metrics = GatewayMetrics()
    bucket = settings.log.names.policy_bucket
    kv = await answered(lambda: event_log.js.key_value(bucket), f"opening bucket {bucket}")
    # The local backend loads each new checkpoint itself; remote ones are updated by the
    # trainer, and the gateway only follows the version to record it on every turn.
    policy: PolicyTarget = backend if isinstance(backend, PolicyTarget) else PolicyVersion()
    watcher = asyncio.create_task(watch_policy(kv, settings.run, policy), name="policy-watch")
    recover = functools.partial(read_session, event_log.js, stream=settings.log.names.events)
    engine = TurnEngine(
        template=ChatTemplate(tokenizer, stop_token_ids=stop_ids, max_context=backend.max_context),
        backend=backend,
        publisher=publisher,
        parser=get_parser(settings.tool_parser),
        model_name=name,
        metrics=metrics,
        weight_version=lambda: policy.weight_version,
        recover=recover,
        allow_raw_logprobs=settings.allow_raw_logprobs,
    )
    store = SessionStore(
        recover=recover,
        max_sessions=settings.max_open_sessions,
        closed_grace_s=settings.closed_session_grace_s,
        kept=Kept(settings.session_turns_kept, settings.session_tokens_kept),
    )
    sessions = SessionService(store=store, publisher=publisher, model_name=name, recover=recover)

    async def health() -> dict[str, Any]:
        if outbox is not None:
            metrics.outbox_depth.set(outbox.pending_bytes)
        connected = event_log.nc.is_connected
        return {
            "status": "ok" if connected or outbox is not None else "degraded",
            "log": "connected" if connected else "reconnecting",
            "weight_version": engine.weight_version(),
        }

    app = create_app(
        engine=engine,
        sessions=sessions,
        default_run=settings.run,
        api_keys=settings.api_keys,
        metrics_auth=settings.metrics_auth,
        limits=BodyLimits(
            settings.max_body_bytes,
            settings.body_timeout_s,
            settings.max_json_depth,
            settings.kept_body_bytes,
        ),
        health=health,
    )
    try:
        yield Gateway(app, engine, sessions, publisher, backend)
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        await publisher.close()
        await backend.close()
        if outbox is not None:
            outbox.close()


class _HttpServer(uvicorn.Server):
    """uvicorn without signal handlers of its own: SIGINT/SIGTERM belong to the command.

    uvicorn's handlers, once the server has stopped, restore the previous ones and raise the
    signal again. With Python's default SIGTERM handler that killed the process on the spot,
    skipping every ``finally``: the gateway's publisher was never closed and its embedded
    nats-server was left running. The command's ``stop_on_signals()`` event stops the server
    instead (``serve_until``), and the stack unwinds in order.
    """

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host``:``port`` (0: a free port), as uvicorn binds one
    (SO_REUSEADDR, IPv6 for an address with a colon, inheritable by worker processes), bound
    before anything slow starts; a TurnstreamError naming the address and what to pass instead
    when it cannot be (uvicorn logs the OSError and calls ``sys.exit`` from inside the event
    loop, which left ``turnstream up`` printing tracebacks)."""
    sock = socket.socket(family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            what = "pass another --port (0: a free one), or stop what listens there"
        elif exc.errno == errno.EACCES:
            what = "ports below 1024 need root or CAP_NET_BIND_SERVICE: pass --port 1024 or above"
        else:  # EADDRNOTAVAIL, a name that does not resolve (socket.gaierror)
            what = "pass --host with an address of this machine (127.0.0.1, 0.0.0.0)"
        reason = exc.strerror or str(exc)
        raise TurnstreamError(f"cannot listen on {host}:{port}: {reason}; {what}") from None
    sock.set_inheritable(True)
    return sock


def http_url(host: str, port: int) -> str:
    """The URL of an HTTP server on ``host``:``port`` (an IPv6 address in brackets).

    >>> http_url("127.0.0.1", 8000), http_url("::1", 8000)
    ('http://127.0.0.1:8000', 'http://[::1]:8000')
    """
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def http_server(app: FastAPI) -> uvicorn.Server:
    """A uvicorn server for ``app`` (on the sockets ``serve_until`` gives it) that leaves
    SIGINT/SIGTERM to its caller; its HTTP parser is httptools (C; h11 is pure Python: it was
    ~9% of the gateway's CPU per request at the benchmark's short shape), or h11 where
    httptools is not installed."""
    http = "httptools" if importlib.util.find_spec("httptools") is not None else "h11"
    config = uvicorn.Config(app, log_level="warning", lifespan="off", http=http)
    return _HttpServer(config)


async def serve_until(
    server: uvicorn.Server, stop: asyncio.Event, sockets: list[socket.socket]
) -> None:
    """Serve on ``sockets`` (``listening_socket``'s) until ``stop`` is set."""

    async def stop_serving() -> None:
        await stop.wait()
        server.should_exit = True

    stopper = asyncio.create_task(stop_serving(), name="stop-http")
    try:
        await server.serve(sockets)
    finally:
        stopper.cancel()


class GatewayCommand(GatewaySettings):
    __doc__ = GatewaySettings.__doc__

    def cli_cmd(self) -> None:
        if self.backend == "local":
            require_local_backend()
        if self.workers > 1:
            from turnstream.gateway_workers import serve_workers

            asyncio.run(serve_workers(self))  # the supervisor; each worker runs ``_serve``'s
            return
        run_service(self._serve())

    async def _serve(self) -> None:
        stop = stop_on_signals()
        # Bound first: a port in use is said before the model loads and the log starts.
        with listening_socket(self.host, self.port) as listener:
            import_gateway_modules(self)
            async with (
                open_log(self, name="turnstream-gateway", stop=stop) as event_log,
                build_gateway(self, event_log) as gateway,
            ):
                server = http_server(gateway.app)
                settle_heap()
                log.info(
                    "gateway on %s (backend %s, log %s, run %s)",
                    http_url(self.host, listener.getsockname()[1]),
                    gateway.backend.id,
                    event_log.url,
                    self.run,
                )
                await serve_until(server, stop, [listener])
