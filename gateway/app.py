"""The HTTP surface (DESIGN §4): thin routes that parse, call ``ChatService``, shape the reply.

Every error leaves as an OpenAI error body with the status from ``gateway.errors.ERROR_TABLE``;
no request can crash the server (anything unexpected is a 500 with a logged traceback).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from fastapi import FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.background import BackgroundTask
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import InvalidRequest, Unauthorized, error_body, error_spec
from gateway.metrics import GatewayMetrics
from gateway.protocol import (
    ChatCompletionRequest,
    CloseSessionRequest,
    CompletionRequest,
    CreateSessionRequest,
    RewardRequest,
)
from gateway.serving import ChatService
from schemas.errors import TurnstreamError

__all__ = ["create_app"]

log = logging.getLogger(__name__)
JSON = dict[str, Any]
_OPEN_PATHS = {"/health", "/metrics"}


def create_app(
    service: ChatService,
    *,
    api_keys: Sequence[str] = (),
    health: Callable[[], Awaitable[JSON]] | None = None,
) -> FastAPI:
    """The gateway app around ``service``; ``health`` adds checks (the log's state) to /health."""
    app = FastAPI(title="turnstream gateway", version="0.1.0")
    metrics = service.metrics

    def error_response(exc: BaseException) -> JSONResponse:
        spec = error_spec(exc)
        metrics.errors.labels(str(spec.status)).inc()
        if spec.status >= 500:
            log.error("%s: %s", type(exc).__name__, exc, exc_info=spec.status == 500)
        return JSONResponse({"error": error_body(exc)}, status_code=spec.status)

    @app.exception_handler(TurnstreamError)
    async def _turnstream_error(request: Request, exc: TurnstreamError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'] if p != 'body') or 'body'}: {e['msg']}"
            for e in exc.errors()
        )
        first = exc.errors()[0]["loc"] if exc.errors() else ()
        param = ".".join(str(p) for p in first if p != "body") or None
        return error_response(InvalidRequest(f"invalid request: {problems}", param=param))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return error_response(exc)

    app.add_middleware(
        _AuthAndTiming, keys=frozenset(api_keys), reject=error_response, metrics=metrics
    )

    # -- service endpoints ------------------------------------------------------------------

    @app.get("/health")
    async def health_check() -> JSONResponse:
        body: JSON = {
            "status": "ok",
            "backend": service.backend.id,
            "sessions": len(service.sessions),
        }
        if health is not None:
            body.update(await health())
        return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # -- session API ------------------------------------------------------------------------

    @app.post("/v1/sessions")
    async def create_session(body: CreateSessionRequest, request: Request) -> JSON:
        session = await service.open_session(body)
        return {**session.describe(), "base_url": f"{request.base_url}sessions/{session.id}/v1"}

    @app.get("/v1/sessions/{session_id}")
    async def get_session(session_id: str) -> JSON:
        return (await service.session(session_id)).describe()

    @app.post("/v1/sessions/{session_id}/reward")
    async def reward(session_id: str, body: RewardRequest) -> JSON:
        return await service.reward(await service.session(session_id), body)

    @app.post("/v1/sessions/{session_id}/close")
    async def close(session_id: str, body: CloseSessionRequest | None = None) -> JSON:
        return await service.close(await service.session(session_id), body or CloseSessionRequest())

    # -- OpenAI API, per session and with X-Session-Id ---------------------------------------

    async def chat(session_id: str, body: ChatCompletionRequest) -> Response:
        session = await service.session(session_id)
        if body.stream:
            stream = await service.chat_stream(session, body)
            return StreamingResponse(
                stream,
                media_type="text/event-stream",
                background=BackgroundTask(stream.release_if_unstarted),
            )
        return JSONResponse(await service.chat(session, body))

    async def complete(session_id: str, body: CompletionRequest) -> JSON:
        if body.stream:
            raise InvalidRequest(
                "stream=true is supported on chat/completions only", param="stream"
            )
        return await service.complete(await service.session(session_id), body)

    def models() -> JSON:
        return {
            "object": "list",
            "data": [
                {
                    "id": service.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "turnstream",
                }
            ],
        }

    @app.post("/sessions/{session_id}/v1/chat/completions")
    async def session_chat(session_id: str, body: ChatCompletionRequest) -> Response:
        return await chat(session_id, body)

    @app.post("/sessions/{session_id}/v1/completions")
    async def session_complete(session_id: str, body: CompletionRequest) -> JSON:
        return await complete(session_id, body)

    @app.get("/sessions/{session_id}/v1/models")
    async def session_models(session_id: str) -> JSON:
        await service.session(session_id)
        return models()

    @app.post("/v1/chat/completions")
    async def header_chat(
        body: ChatCompletionRequest, x_session_id: str | None = Header(None)
    ) -> Response:
        return await chat((await service.session_from_header(x_session_id)).id, body)

    @app.post("/v1/completions")
    async def header_complete(
        body: CompletionRequest, x_session_id: str | None = Header(None)
    ) -> JSON:
        return await complete((await service.session_from_header(x_session_id)).id, body)

    @app.get("/v1/models")
    async def list_models() -> JSON:
        return models()

    return app


class _AuthAndTiming:
    """Bearer-key check and request timing as plain ASGI middleware (starlette's
    BaseHTTPMiddleware costs a task and a memory stream per request; it was ~16% of the
    gateway's CPU per request)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        keys: frozenset[str],
        reject: Callable[[BaseException], JSONResponse],
        metrics: GatewayMetrics,
    ) -> None:
        self.app = app
        self.keys = keys
        self.reject = reject
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        if self.keys and scope["path"] not in _OPEN_PATHS:
            header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            if not header.startswith("Bearer ") or header[7:] not in self.keys:
                problem = Unauthorized("missing or invalid API key (Authorization: Bearer ...)")
                await self.reject(problem)(scope, receive, send)
                return
        await self.app(scope, receive, send)
        route = getattr(scope.get("route"), "path", "unmatched")
        self.metrics.request_latency.labels(route).observe(time.perf_counter() - started)
