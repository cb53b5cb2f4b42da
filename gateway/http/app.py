"""The HTTP surface (DESIGN §4): the routes, the request guard, and one error mapping.

Every error leaves as an OpenAI error body with the status from ``gateway.errors.ERROR_TABLE``,
on every route, unknown ones and wrong methods included; anything unexpected is a 500 with a
logged traceback. The OpenAPI schema documents every status a route can answer, with the error
body model, and nothing else (FastAPI's own 422 is never sent: validation errors are 400s).
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.types import Receive, Scope, Send

from gateway.errors import (
    InvalidRequest,
    MethodNotAllowed,
    RouteNotFound,
    anthropic_error_body,
    anthropic_status,
    error_body,
    error_spec,
    retry_after_s,
)
from gateway.http.guard import (
    BodyLimits,
    GuardedRoute,
    RequestGuard,
    decoded_json,
    parse_api_keys,
    validation_context,
)
from gateway.http.kept_bodies import KeptBodies
from gateway.http.routes import (
    DirectRoute,
    ScopedRoutes,
    add_anthropic_routes,
    add_openai_routes,
    add_responses_routes,
    add_session_routes,
    errors,
)
from gateway.images.limits import ImageLimits
from gateway.metrics import GatewayMetrics
from gateway.serving import (
    ChatServing,
    CompletionServing,
    ResponsesServing,
    SessionService,
    TurnEngine,
    TurnServing,
)
from gateway.serving.anthropic_service import AnthropicServing
from gateway.serving.image_input import ImageEdge
from schemas.errors import TurnstreamError

__all__ = ["GatewayApp", "Health", "create_app"]

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
    image_limits: ImageLimits | None = None,
    health: Callable[[], Awaitable[JSON]] | None = None,
) -> FastAPI:
    """The gateway app; ``image_limits``: what the APIs take of a request's images;
    ``health`` adds checks (the log's state) to /health."""
    app = GatewayApp(title="turnstream gateway", version="0.1.0")
    app.router.route_class = GuardedRoute
    metrics: GatewayMetrics = engine.metrics

    def error_response(exc: BaseException, path: str) -> JSONResponse:
        spec = error_spec(exc)
        metrics.errors.labels(str(spec.status)).inc()
        if spec.status >= 500:
            log.error("%s: %s", type(exc).__name__, exc, exc_info=spec.status == 500)
        retry_after = retry_after_s(exc)
        headers = None if retry_after is None else {"Retry-After": str(math.ceil(retry_after))}
        if _ANTHROPIC_ROUTE.search(path):
            return JSONResponse(
                anthropic_error_body(exc), status_code=anthropic_status(exc), headers=headers
            )
        return JSONResponse({"error": error_body(exc)}, status_code=spec.status, headers=headers)

    def error_for(exc: BaseException, method: str, path: str) -> JSONResponse:
        """The one error mapping of the app's routes: FastAPI's own errors (validation, no
        route, wrong method) as ours, then ``error_response``."""
        problem: BaseException = exc
        if isinstance(exc, RequestValidationError):
            problem = validation_problem(exc)
        elif isinstance(exc, HTTPException) and exc.status_code == 404:
            problem = RouteNotFound(
                f"no route {method} {path}; the OpenAI API is under "
                "/sessions/{session_id}/v1/ or /v1/ with an X-Session-Id header (see /docs)"
            )
        elif isinstance(exc, HTTPException) and exc.status_code == 405:
            problem = MethodNotAllowed(f"{method} is not allowed on {path}")
        elif isinstance(exc, HTTPException):
            problem = InvalidRequest(str(exc.detail))
        return error_response(problem, path)

    async def handle(request: Request, exc: Exception) -> JSONResponse:
        return error_for(exc, request.method, request.url.path)

    for kind in (TurnstreamError, RequestValidationError, HTTPException, Exception):
        app.add_exception_handler(kind, handle)

    open_paths = frozenset({"/health"} if metrics_auth else {"/health", "/metrics"})
    limits = limits or BodyLimits()
    kept = KeptBodies(limits.kept_bytes, metrics.kept_bodies, metrics.kept_body_bytes)
    guard_settings: JSON = {
        "keys": parse_api_keys(api_keys),
        "open_paths": open_paths,
        "limits": limits,
        "reject": error_response,
        "metrics": metrics,
        "kept": kept,  # one for both guards
    }
    app.add_middleware(RequestGuard, **guard_settings)

    # Starlette matches routes in order: turns first, then the session API, then service routes.
    turns = TurnServing(engine, sessions.store)
    images = ImageEdge(image_limits or ImageLimits())  # one for the three APIs
    chat, completions = ChatServing(turns, images), CompletionServing(engine)
    routes = ScopedRoutes(app.router, default_run)
    add_openai_routes(routes, sessions, chat, completions)
    add_responses_routes(routes, sessions, ResponsesServing(turns, images))
    add_anthropic_routes(routes, sessions, AnthropicServing(turns, images))
    add_session_routes(app.router, sessions, default_run)

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
        # On a worker thread: writing every series took ~6-18 ms, a stall of the event loop
        # at every scrape (the fleet benchmark's, issue 40); the registry takes its own locks.
        text = await asyncio.to_thread(generate_latest, metrics.registry)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    app.openapi = lambda: _openapi(app, engine.template.vocab_size)  # type: ignore[method-assign]
    app.serve_directly(routes.direct, RequestGuard(app.router, **guard_settings), error_for)
    return app


ErrorMapping = Callable[[BaseException, str, str], JSONResponse]  # (error, method, path)


class GatewayApp(FastAPI):
    """FastAPI with a short path for the POST routes whose only inputs are a JSON body model
    and the request (the /v1 variants of the turn routes, count_tokens: ``ScopedRoutes.direct``):
    the guard's checks, the body validated by its model, the route's own endpoint, errors
    through the app's one error mapping. It skips the ~10 layers of middleware, routing and
    dependency solving that FastAPI 0.165 puts around an endpoint (gateway CPU per request x0.92
    at the benchmark's short shape, paired).

    Anything else takes the whole FastAPI path, which stays the reference: other methods and
    routes, a body that is not ``application/json`` or does not validate (FastAPI answers it
    the same 400 as before, from the body read once already). The OpenAPI schema is FastAPI's,
    from the same routes."""

    _direct: Mapping[str, DirectRoute] | None = None
    _guard: RequestGuard | None = None
    _error_for: ErrorMapping | None = None

    def serve_directly(
        self, routes: Mapping[str, DirectRoute], guard: RequestGuard, error_for: ErrorMapping
    ) -> None:
        """Serve ``routes`` (by path; each also registered with FastAPI) directly; ``guard`` is
        configured as the app's RequestGuard middleware, ``error_for`` is the app's error
        mapping."""
        self._direct, self._guard, self._error_for = dict(routes), guard, error_for

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        direct = self._direct
        if direct and scope["type"] == "http" and scope["method"] == "POST":
            route = direct.get(scope["path"])
            if route is not None and not scope.get("root_path"):
                await self._serve(route, scope, receive, send)
                return
        await super().__call__(scope, receive, send)

    async def _serve(self, route: DirectRoute, scope: Scope, receive: Receive, send: Send) -> None:
        guard, error_for = self._guard, self._error_for
        assert guard is not None and error_for is not None
        started = time.perf_counter()
        admitted = await guard.admitted(scope, receive, send)
        if admitted is None:
            return
        receive = admitted
        decoded, body = decoded_json(scope)
        if decoded and _plain_json(scope):
            try:
                value = route.body.model_validate(body, context=validation_context(scope))
            except ValidationError:
                pass  # FastAPI's path answers it below, naming each field at fault
            else:
                scope["app"] = self
                try:
                    response = await route.serve(Request(scope, receive), value)
                except Exception as exc:
                    response = error_for(exc, "POST", scope["path"])
                await response(scope, receive, send)
                guard.observe(route.path, started)
                return
        # FastAPI's own path (and its 400), reading the body the guard kept.
        await super().__call__(scope, receive, send)


def _plain_json(scope: Scope) -> bool:
    """Whether the request says its body is ``application/json`` (FastAPI reads a body as JSON
    only when it says so; other content types take FastAPI's own path)."""
    for key, value in scope["headers"]:
        if key == b"content-type":
            kind = value.split(b";", 1)[0].strip().lower()
            return bool(kind == b"application/json")
    return False


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
