"""The HTTP surface (DESIGN §4): the routers, the request guard, and one error mapping.

Every error leaves as an OpenAI error body with the status from ``gateway.errors.ERROR_TABLE``,
on every route, unknown ones and wrong methods included; anything unexpected is a 500 with a
logged traceback. The OpenAPI schema documents every status a route can answer, with the error
body model, and nothing else (FastAPI's own 422 is never sent: validation errors are 400s).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from gateway.errors import (
    InvalidRequest,
    MethodNotAllowed,
    RouteNotFound,
    anthropic_error_body,
    anthropic_status,
    error_body,
    error_spec,
)
from gateway.guard import BodyLimits, GuardedRoute, RequestGuard, parse_api_keys
from gateway.metrics import GatewayMetrics
from gateway.routers import openai_routes, responses_routes, session_routes
from gateway.routers.anthropic import anthropic_routes
from gateway.routers.common import errors
from gateway.serving import (
    ChatServing,
    CompletionServing,
    ResponsesServing,
    SessionService,
    TurnEngine,
    TurnServing,
)
from gateway.serving.anthropic import AnthropicServing
from schemas.errors import TurnstreamError

__all__ = ["Health", "create_app"]

log = logging.getLogger(__name__)
JSON = dict[str, Any]
# The Anthropic Messages routes answer errors in Anthropic's body, the others in OpenAI's.
_ANTHROPIC_ROUTE = re.compile(r"/v1/messages(/count_tokens)?$")


class Health(BaseModel):
    status: str
    backend: str
    sessions: int
    log: str | None = None
    weight_version: int | None = None


def create_app(
    *,
    engine: TurnEngine,
    sessions: SessionService,
    default_run: str,
    api_keys: Sequence[str] = (),
    metrics_auth: bool = False,
    limits: BodyLimits | None = None,
    health: Callable[[], Awaitable[JSON]] | None = None,
) -> FastAPI:
    """The gateway app; ``health`` adds checks (the log's state) to /health."""
    app = FastAPI(title="turnstream gateway", version="0.1.0")
    app.router.route_class = GuardedRoute
    metrics: GatewayMetrics = engine.metrics

    def error_response(exc: BaseException, path: str) -> JSONResponse:
        spec = error_spec(exc)
        metrics.errors.labels(str(spec.status)).inc()
        if spec.status >= 500:
            log.error("%s: %s", type(exc).__name__, exc, exc_info=spec.status == 500)
        if _ANTHROPIC_ROUTE.search(path):
            return JSONResponse(anthropic_error_body(exc), status_code=anthropic_status(exc))
        return JSONResponse({"error": error_body(exc)}, status_code=spec.status)

    @app.exception_handler(TurnstreamError)
    async def _turnstream_error(request: Request, exc: TurnstreamError) -> JSONResponse:
        return error_response(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_problem(exc), request.url.path)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        if exc.status_code == 404:
            problem: Exception = RouteNotFound(
                f"no route {request.method} {request.url.path}; the OpenAI API is under "
                "/sessions/{session_id}/v1/ or /v1/ with an X-Session-Id header (see /docs)"
            )
        elif exc.status_code == 405:
            problem = MethodNotAllowed(f"{request.method} is not allowed on {request.url.path}")
        else:
            problem = InvalidRequest(str(exc.detail))
        return error_response(problem, request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return error_response(exc, request.url.path)

    open_paths = frozenset({"/health"} if metrics_auth else {"/health", "/metrics"})
    app.add_middleware(
        RequestGuard,
        keys=parse_api_keys(api_keys),
        open_paths=open_paths,
        limits=limits or BodyLimits(),
        reject=error_response,
        metrics=metrics,
    )

    # Starlette matches routes in order: turns first, then the session API, then service routes.
    turns = TurnServing(engine, sessions.store)
    chat, completions = ChatServing(turns), CompletionServing(engine)
    openai_routes(app.router, sessions, chat, completions, default_run)
    responses_routes(app.router, sessions, ResponsesServing(turns), default_run)
    anthropic_routes(app.router, sessions, AnthropicServing(turns), default_run)
    session_routes(app.router, sessions, default_run)

    @app.api_route("/", methods=["GET", "HEAD"], response_model=None, include_in_schema=False)
    async def root() -> JSONResponse:
        # Claude Code probes its base URL with HEAD / at start-up.
        return JSONResponse({"service": "turnstream gateway", "docs": "/docs"})

    @app.get("/health", response_model=None, responses={200: {"model": Health}, **errors(503)})
    async def health_check() -> JSONResponse:
        body: JSON = {
            "status": "ok",
            "backend": engine.backend.id,
            "sessions": len(sessions.store),
        }
        if health is not None:
            body.update(await health())
        return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503)

    @app.get(
        "/metrics",
        response_model=None,
        responses={200: {"content": {"text/plain": {}}, "description": "Prometheus metrics"}},
    )
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.openapi = lambda: _openapi(app, engine.template.vocab_size)  # type: ignore[method-assign]
    return app


def validation_problem(exc: RequestValidationError) -> InvalidRequest:
    """A 400 naming each field at fault (FastAPI would answer 422 with its own body)."""
    problems = []
    for error in exc.errors():
        where = ".".join(str(p) for p in error["loc"] if p != "body") or "body"
        problems.append(f"{where}: {error['msg']}")
    first = exc.errors()[0]["loc"] if exc.errors() else ()
    param = ".".join(str(p) for p in first if p not in ("body", "header", "path", "query"))
    return InvalidRequest(f"invalid request: {'; '.join(problems)}", param=param or None)


def _openapi(app: FastAPI, vocab_size: int) -> JSON:
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        # Token-id prompts: ids of this model's vocabulary.
        prompt = components["CompletionRequest"]["properties"]["prompt"]
        for option in prompt["anyOf"]:
            if option.get("type") == "array":
                option["items"]["maximum"] = vocab_size - 1
        for path in schema["paths"].values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema
