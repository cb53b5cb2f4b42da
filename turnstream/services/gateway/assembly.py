"""The gateway assembled: the log's publisher and its outbox, the tokenizer and chat template,
the backend, the policy watch, the session service and the app (``build_gateway``).

What ``turnstream gateway`` serves in its process, each of its ``--workers`` in theirs, and what
the embedded stack (``up``, the demo) mounts in-process.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.util
import logging
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI

from eventlog import Bucket, DirectReader, JetStreamImageStore, JetStreamPublisher, Outbox
from gateway.backends.interface import Backend
from gateway.backends.policy_watch import PolicyTarget, PolicyVersion, watch_policy
from gateway.core.aggregate import Kept
from gateway.core.session_store import SessionLog, SessionStore
from gateway.core.versions import VersionTimeline
from gateway.http.app import create_app
from gateway.http.guard import BodyLimits
from gateway.images import ImageUploads, VisionSpec
from gateway.loop_lag import LoopLagProbe
from gateway.metrics import GatewayMetrics
from gateway.serving import SessionService, TurnEngine
from gateway.serving.model_names import ModelNames, parse_model_aliases
from gateway.templates import ChatTemplate, load_tokenizer
from gateway.tools import get_parser
from schemas.errors import TurnstreamError
from schemas.policy import parse_policy_update
from turnstream.services.gateway.settings import GatewaySettings
from turnstream.stack.event_log import EventLog
from turnstream.stack.process import without_progress_bars

if TYPE_CHECKING:
    from gateway.backends.local import LocalBackend

__all__ = [
    "Gateway",
    "build_backend",
    "build_gateway",
    "import_gateway_modules",
    "local_backend_class",
    "model_name",
    "require_local_backend",
    "stop_token_ids",
]

log = logging.getLogger(__name__)


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


def model_name(settings: GatewaySettings, model_dir: Path) -> str:
    """The name the gateway serves its model under: ``--model-name``; else the built-in tiny
    model's "tiny", a model directory's own name."""
    return settings.model_name or (model_dir.name if settings.model is not None else "tiny")


def stop_token_ids(model_dir: Path) -> list[int]:
    """Every end token the model may sample (its generation config's ``eos_token_id``): each
    closes a turn, not only the tokenizer's eos. Imports transformers."""
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    except OSError:  # no generation_config.json: the tokenizer's eos is all there is
        eos = None
    return [eos] if isinstance(eos, int) else list(eos or [])


def build_backend(settings: GatewaySettings, model_dir: Path, name: str) -> Backend:
    """The backend ``settings`` name, serving ``model_dir`` as ``name``: the local one (its
    torch threads set), or a router over the vLLM / SGLang replicas."""
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
    settings = await settings.served()
    model_dir = settings.model_dir
    name = model_name(settings, model_dir)
    try:  # before anything starts: an alias to a model other than the one served
        names = ModelNames.of(name, parse_model_aliases(settings.model_aliases))
    except ValueError as exc:
        raise TurnstreamError(f"--model-aliases: {exc}") from None
    tokenizer = load_tokenizer(model_dir)
    stop_ids = stop_token_ids(model_dir)
    try:  # a model that takes images: its placeholder and its processor's sizing rule
        vision = VisionSpec.load(model_dir)
    except ValueError as exc:
        raise TurnstreamError(f"--model {model_dir}: {exc}") from None
    backend = build_backend(settings, model_dir, name)
    await _probe_logprobs(backend)
    outbox = (
        Outbox(settings.publisher.outbox_path, settings.publisher.outbox_max_bytes)
        if settings.publisher.outbox_path is not None
        else None
    )
    publisher = await JetStreamPublisher(event_log.nc, settings.publisher, outbox=outbox).start()
    metrics = GatewayMetrics()
    bucket = settings.log.names.policy_bucket
    events_stream = settings.log.names.events
    kv = await Bucket.open(event_log.js, bucket)
    # The local backend loads each new checkpoint itself; remote ones are updated by the
    # trainer, and the gateway only follows the version to record it on every turn.
    policy: PolicyTarget = backend if isinstance(backend, PolicyTarget) else PolicyVersion()
    timeline = VersionTimeline()  # each version learned, with the log's time stamp of it
    watcher = asyncio.create_task(
        watch_policy(kv, settings.run, policy, timeline=timeline), name="policy-watch"
    )

    async def policy_version() -> int:
        """The run's version as the bucket holds it now (a continued turn's tokens were
        sampled by it: gateway.core.versions); the watched one where the entry is unreadable."""
        entry = await kv.get(settings.run)
        try:
            return (
                policy.weight_version if entry is None else parse_policy_update(entry.value).version
            )
        except ValueError:
            return policy.weight_version

    # The log decides (DESIGN §4): sessions are loaded and caught up by reading what follows a
    # sequence, and every append states the last one this gateway knows. One held reader: a
    # catch-up that finds nothing then costs about a publish (benchmarks/catch_up_read.py).
    reader = await DirectReader(event_log.nc, publisher.codec).start()
    read_after = functools.partial(reader.read_session_after, stream=events_stream)
    store = SessionStore(
        log=SessionLog(
            read_after,
            stream=events_stream,
            metrics=metrics,
            idle_sync_s=settings.session_idle_sync_s,
        ),
        max_sessions=settings.max_open_sessions,
        closed_grace_s=settings.closed_session_grace_s,
        kept=Kept(settings.session_turns_kept, settings.session_tokens_kept),
    )
    # A vision model's turns put their images in the log's store before their events name them.
    images = None
    if vision is not None:
        images = ImageUploads(await JetStreamImageStore.open(event_log.nc, settings.log))
    engine = TurnEngine(
        template=ChatTemplate(
            tokenizer, stop_token_ids=stop_ids, max_context=backend.max_context, vision=vision
        ),
        backend=backend,
        publisher=publisher,
        parser=get_parser(settings.tool_parser),
        model_name=name,
        metrics=metrics,
        weight_version=lambda: policy.weight_version,
        store=store,
        allow_raw_logprobs=settings.allow_raw_logprobs,
        continue_wait_s=settings.continue_wait_s,
        max_versions_per_turn=settings.max_versions_per_turn,
        timeline=timeline,
        policy_version=policy_version,
        instance=settings.instance_id or f"{socket.gethostname()}:{settings.port}",
        model_aliases=names.aliases,
        images=images,
    )
    sessions = SessionService(store=store, publisher=publisher, model_name=name, metrics=metrics)

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
        image_limits=settings.image_limits,
        health=health,
    )
    # How late the event loop runs what is due, as metrics (gateway.loop_lag).
    lag_probe = asyncio.create_task(LoopLagProbe(metrics).run(), name="loop-lag")
    try:
        yield Gateway(app, engine, sessions, publisher, backend)
    finally:
        for task in (watcher, lag_probe):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await engine.close()  # streamed turns whose clients left: never a hang at shutdown
        await publisher.close()
        await reader.close()
        await backend.close()
        if outbox is not None:
            outbox.close()
