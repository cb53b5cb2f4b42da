"""What the routers share: the run of a request, id patterns, the documented error statuses."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Annotated, Any, Protocol, TypeVar

from fastapi import Header, Path, Request, Response
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from gateway.errors import InvalidRequest, RunNotAllowed
from gateway.http.guard import SESSION_HEADERS, allowed_runs
from gateway.protocol.wire import ErrorResponse, Wire
from schemas.ids import ID_PATTERN

if TYPE_CHECKING:
    from gateway.serving import SessionService, TurnEngine, TurnStream
    from gateway.sessions import Session

__all__ = [
    "ID",
    "SESSION_HEADERS",
    "RunHeader",
    "RunId",
    "SessionId",
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

    async def complete(self, session: Session, req: Body) -> Wire: ...

    async def stream(self, session: Session, req: Body) -> TurnStream: ...


async def serve_turn(
    sessions: SessionService,
    api: TurnAPI[Body],
    run: str,
    sid: str,
    body: Body,
    *,
    open_missing: bool,
) -> Response:
    """A turn of any API: the model checked before a session is opened for it, the session held
    for the turn, the reply whole or as the API's SSE stream (which holds it until it ends)."""
    api.engine.check_model(body.model)
    async with sessions.use(run, sid, open_missing=open_missing) as session:
        if body.stream:
            stream = await api.stream(session, body)
            return StreamingResponse(
                stream,
                media_type="text/event-stream",
                background=BackgroundTask(stream.release_if_unstarted),
            )
        return json_response(await api.complete(session, body))
