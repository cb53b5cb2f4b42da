"""Routes registered once for the three scopes of a session, and what every route shares: the
run of a request, id patterns, the documented error statuses, the shape of a turn route.

A route of the OpenAI, Anthropic and Responses APIs answers at three paths, one per way a client
names its session (``ScopedRoutes.add`` registers all three from one endpoint):

- ``/sessions/{session_id}/v1{tail}``: the session's base URL, in the key's only run, else the
  gateway's (``POST /v1/sessions`` hands it out);
- ``/v1{tail}``: the session in a header (``X-Session-Id``, or a client's own), opened on its
  first request, so an unmodified agent only sets its base URL;
- ``/runs/{run}/sessions/{session_id}/v1{tail}``: any run.

The endpoint takes a ``SessionRef`` (run, session, whether a missing one is opened) and the body;
FastAPI reads the path parameters, the body model and the request from each variant's signature,
so the OpenAPI schema documents every path as if written out. The ``/v1`` variant of a POST route
has a static path and no parameter but its body: ``ScopedRoutes.direct`` lists it for the app's
short path (``GatewayApp``), which validates the body with its model and calls the variant's
endpoint itself.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, NamedTuple, Protocol, TypeVar

from fastapi import APIRouter, Header, Path, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.background import BackgroundTask

from gateway.core.agents import AgentIdentity
from gateway.errors import InvalidRequest, RunNotAllowed
from gateway.http.agent_headers import agent_identity
from gateway.http.guard import SESSION_HEADERS, allowed_runs
from gateway.protocol.wire import ErrorResponse, Wire
from schemas.ids import ID_PATTERN

if TYPE_CHECKING:
    from gateway.core.session_store import Session
    from gateway.serving import SessionService, TurnEngine, TurnStream

__all__ = [
    "ID",
    "SESSION_HEADERS",
    "DirectRoute",
    "RunHeader",
    "RunId",
    "ScopedRoutes",
    "SessionId",
    "SessionRef",
    "TurnAPI",
    "checked_run",
    "errors",
    "header_parameters",
    "header_session",
    "json_response",
    "serve_turn",
]

ID = f"^{ID_PATTERN}$"
_ID = re.compile(ID)
_DESCRIPTIONS = {
    400: "invalid request: the message names the field and what to do",
    401: "missing or invalid API key",
    403: "the API key is not allowed for this run",
    404: "no such session in this run, or model not served",
    405: "method not allowed",
    408: "the request body did not arrive in time",
    409: "the session is closed, or exists with another group/metadata",
    413: "the body is over the size limit, or the prompt over the context length",
    502: "the inference backend failed",
    503: "the log or the backend is unavailable; retry",
}
# Every route can answer these: input and keys are checked before any route runs.
_ALWAYS = (400, 401, 403, 405, 408, 413)

SessionId = Annotated[str, Path(pattern=ID, description="the session id")]
RunId = Annotated[str, Path(pattern=ID, description="the run id")]
RunHeader = Annotated[
    str | None,
    Header(
        alias="X-Run-Id",
        pattern=ID,
        description="the run of the session (default: the key's only run, else the gateway's)",
    ),
]


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI ``responses`` entry for a route's error statuses (all one body model)."""
    return {
        status: {"model": ErrorResponse, "description": _DESCRIPTIONS[status]}
        for status in sorted({*_ALWAYS, *statuses})
    }


def json_response(model: Wire, status_code: int = 200) -> Response:
    return Response(model.json_bytes(), status_code=status_code, media_type="application/json")


def checked_run(request: Request, run: str | None, default_run: str) -> str:
    allowed = allowed_runs(request)
    if run is None:
        run = next(iter(allowed)) if allowed is not None and len(allowed) == 1 else default_run
    if allowed is not None and run not in allowed:
        raise RunNotAllowed(
            f"this API key may not use run {run!r} (its runs: {', '.join(sorted(allowed))})",
            param="X-Run-Id",
        )
    return run


def header_session(
    request: Request, default_run: str, fallback: str | None = None
) -> tuple[str, str]:
    """The run and session of a /v1 turn route, from X-Run-Id and a session header (or
    ``fallback``: a session the request names otherwise, as a previous response's id)."""
    headers = request.headers
    name, session = next(
        ((h, headers[h]) for h in SESSION_HEADERS if headers.get(h)), ("", fallback)
    )
    if not session:
        raise InvalidRequest(
            "a session header is required on /v1/... (X-Session-Id, or a client's own: "
            "X-Claude-Code-Session-Id, session-id); or create a session with "
            "POST /v1/sessions and use its base_url",
            param="X-Session-Id",
        )
    run = headers.get("x-run-id")
    for header, value in ((name or "session", session), ("X-Run-Id", run)):
        if value is not None and not _ID.match(value):
            raise InvalidRequest(
                f"{header} {value[:80]!r} must match {ID} (letters, digits, _ and -)",
                param=header,
            )
    return checked_run(request, run, default_run), session


def header_parameters(session_note: str = "") -> dict[str, Any]:
    """``openapi_extra`` of a /v1 turn route: the headers it reads itself (FastAPI's header
    parameters cost ~10% of the routing per request), documented all the same."""
    return {
        "parameters": [
            {
                "name": "X-Session-Id",
                "in": "header",
                "required": True,
                "schema": {"type": "string", "pattern": ID},
                "description": "the session (in the request's run), opened on its first request"
                + session_note,
            },
            {
                "name": "X-Run-Id",
                "in": "header",
                "required": False,
                "schema": {"type": "string", "pattern": ID},
                "description": "the run (default: the key's only run, else the gateway's)",
            },
        ]
    }


@dataclass(frozen=True, slots=True)
class SessionRef:
    """The session a request is for: its run, its id, and whether a missing one is opened (only
    when a header names it: a session's URL is handed out by ``POST /v1/sessions``)."""

    run: str
    session: str
    open_missing: bool = False
    agent: AgentIdentity | None = None  # who in the session's tree of agents asks (its headers)


B = TypeVar("B")
Responses = dict[int | str, dict[str, Any]]
Scoped = Callable[[SessionRef, B], Awaitable[Response]]
"""A route's endpoint: the session it is for, the validated body (None for a GET)."""
Headed = Callable[[Request, B], Awaitable[Response]]
"""A route's endpoint at ``/v1``, where the request's headers (or its body) name the session."""


class DirectRoute(NamedTuple):
    """A POST route the app serves without FastAPI's routing: a static path, its body model,
    its endpoint (the request, the validated body)."""

    path: str
    body: type[BaseModel]
    serve: Headed[Any]


class ScopedRoutes:
    """Adds each route to ``router`` at its three paths, in that order (Starlette matches routes
    in order: add the most used first), and keeps the /v1 POST routes in ``direct``."""

    def __init__(self, router: APIRouter, default_run: str) -> None:
        self.router = router
        self.default_run = default_run
        self.direct: dict[str, DirectRoute] = {}

    def in_headers(self, serve: Scoped[B]) -> Headed[B]:
        """The /v1 variant of ``serve`` (the default): the session from the headers, opened on
        its first request."""

        async def headed(request: Request, body: B) -> Response:
            run, session = header_session(request, self.default_run)
            agent = agent_identity(request.headers)
            return await serve(SessionRef(run, session, open_missing=True, agent=agent), body)

        return headed

    def add(
        self,
        tail: str,
        serve: Scoped[B],
        *,
        name: str,
        body: type[B] | None,
        responses: Responses,
        method: str = "POST",
        header: Headed[B] | None = None,
        header_name: str | None = None,
        header_responses: Responses | None = None,
        header_note: str | None = "",
        header_doc: str | None = None,
    ) -> None:
        """The route ``tail`` (after ``/v1``) at its three paths, named (FastAPI's operation
        ids) ``session_NAME``, ``header_NAME`` (or ``header_name``) and ``run_session_NAME``.

        The /v1 variant is ``header`` where given (a route that needs no session there, or
        finds it elsewhere too), else ``in_headers(serve)``; it documents ``header_responses``
        (default: ``responses``), the session headers (``header_parameters(header_note)``;
        None: it reads none) and ``header_doc``."""
        default_run = self.default_run
        headed = header or self.in_headers(serve)

        async def at_session(*, session_id: str, request: Request, body: Any = None) -> Response:
            run = checked_run(request, None, default_run)
            return await serve(
                SessionRef(run, session_id, agent=agent_identity(request.headers)), body
            )

        async def in_header(*, request: Request, body: Any = None) -> Response:
            return await headed(request, body)

        async def at_run(
            *, run: str, session_id: str, request: Request, body: Any = None
        ) -> Response:
            run = checked_run(request, run, default_run)
            return await serve(
                SessionRef(run, session_id, agent=agent_identity(request.headers)), body
            )

        inputs = [("body", body)] if body is not None else []
        headers = header_parameters(header_note) if header_note is not None else None
        self._route(
            f"/sessions/{{session_id}}/v1{tail}",
            _reads(at_session, ("session_id", SessionId), *inputs),
            method,
            name=f"session_{name}",
            responses=responses,
        )
        self._route(
            f"/v1{tail}",
            _reads(in_header, *inputs),
            method,
            name=header_name or f"header_{name}",
            responses=header_responses or responses,
            openapi_extra=headers,
            description=header_doc,
        )
        self._route(
            f"/runs/{{run}}/sessions/{{session_id}}/v1{tail}",
            _reads(at_run, ("run", RunId), ("session_id", SessionId), *inputs),
            method,
            name=f"run_session_{name}",
            responses=responses,
        )
        if method == "POST" and isinstance(body, type) and issubclass(body, BaseModel):
            path = f"/v1{tail}"
            assert path not in self.direct, f"{path} added twice"
            self.direct[path] = DirectRoute(path, body, headed)

    def _route(
        self, path: str, endpoint: Callable[..., Awaitable[Response]], method: str, **doc: Any
    ) -> None:
        self.router.add_api_route(path, endpoint, methods=[method], response_model=None, **doc)


def _reads(
    endpoint: Callable[..., Awaitable[Response]], *inputs: tuple[str, Any]
) -> Callable[..., Awaitable[Response]]:
    """``endpoint`` as FastAPI reads it: these keyword parameters (name, annotation: a path
    parameter, the body model) and the request. ``endpoint`` is made for one route only."""
    parameters = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation)
        for name, annotation in (*inputs, ("request", Request))
    ]
    endpoint.__signature__ = inspect.Signature(parameters, return_annotation=Response)  # type: ignore[attr-defined]
    return endpoint


class _TurnBody(Protocol):
    @property
    def model(self) -> str | None: ...

    @property
    def stream(self) -> bool: ...


Body = TypeVar("Body", bound=_TurnBody, contravariant=True)


class TurnAPI(Protocol[Body]):
    """What a turn route needs of an API's serving: whole or streamed."""

    @property
    def engine(self) -> TurnEngine: ...

    async def complete(
        self, session: Session, req: Body, agent: AgentIdentity | None = None
    ) -> Wire: ...

    async def stream(
        self, session: Session, req: Body, agent: AgentIdentity | None = None
    ) -> TurnStream: ...


async def serve_turn(
    sessions: SessionService, api: TurnAPI[Body], where: SessionRef, body: Body
) -> Response:
    """A turn of any API, for the agent its headers name: the model checked before a session is
    opened for it, the session held for the turn, the reply whole or as the API's SSE stream
    (its turn holds the session until it has appended; ``TurnStream.ended`` runs once the
    response is done, however it ended)."""
    api.engine.check_model(body.model)
    async with sessions.use(where.run, where.session, open_missing=where.open_missing) as session:
        if body.stream:
            stream = await api.stream(session, body, where.agent)
            return StreamingResponse(
                stream, media_type="text/event-stream", background=BackgroundTask(stream.ended)
            )
        return json_response(await api.complete(session, body, where.agent))
