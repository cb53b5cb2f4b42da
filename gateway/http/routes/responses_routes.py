"""Routes of the OpenAI Responses API: per session (``/sessions/{sid}/v1/responses``,
``/runs/{run}/sessions/{sid}/v1/responses``) and with the session in a header (``/v1/responses``
+ ``X-Session-Id`` or Codex's ``session-id``, opened on first use; without a header, the session
``previous_response_id`` names)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from gateway.errors import InvalidRequest, SessionNotFound
from gateway.http.routes.scoped_routes import (
    SESSION_HEADERS,
    RunId,
    SessionId,
    checked_run,
    errors,
    header_parameters,
    header_session,
    serve_turn,
)
from gateway.protocol.responses import (
    ResponsesRequest,
)
from gateway.protocol.responses_reply import (
    ResponseObject,
)
from gateway.serving import SessionService
from gateway.serving.responses import ResponsesServing, parse_response_id

__all__ = ["responses_routes"]

_HEADERS = header_parameters(
    "; also read from Codex's session-id; without one, the session that previous_response_id names"
)
_RESPONSES = {
    200: {
        "content": {"text/event-stream": {}},
        "model": ResponseObject,
        "description": "the response; with stream=true, typed response.* events",
    },
    **errors(404, 409, 502, 503),
}


def responses_routes(
    router: APIRouter, sessions: SessionService, serving: ResponsesServing, default_run: str
) -> None:
    """Adds the routes to ``router`` (the app's own)."""

    async def turn(run: str, sid: str, body: ResponsesRequest, header: bool) -> Response:
        return await serve_turn(sessions, serving, run, sid, body, open_missing=header)

    @router.post("/sessions/{session_id}/v1/responses", response_model=None, responses=_RESPONSES)
    async def session_responses(
        session_id: SessionId, body: ResponsesRequest, request: Request
    ) -> Response:
        run = checked_run(request, None, default_run)
        return await turn(run, session_id, body, header=False)

    @router.post("/v1/responses", response_model=None, responses=_RESPONSES, openapi_extra=_HEADERS)
    async def header_responses(body: ResponsesRequest, request: Request) -> Response:
        named = None
        if body.previous_response_id is not None:
            named, _ = parse_response_id(body.previous_response_id)
        headed = any(request.headers.get(h) for h in SESSION_HEADERS)
        run, sid = header_session(request, default_run, fallback=named)
        if headed:
            return await turn(run, sid, body, header=True)
        try:  # the session of previous_response_id: it must exist
            return await turn(run, sid, body, header=False)
        except SessionNotFound as exc:
            raise InvalidRequest(
                f"previous_response_id {body.previous_response_id!r}: no session {sid!r} in "
                f"run {run!r}",
                param="previous_response_id",
            ) from exc

    @router.post(
        "/runs/{run}/sessions/{session_id}/v1/responses",
        response_model=None,
        responses=_RESPONSES,
    )
    async def run_session_responses(
        run: RunId, session_id: SessionId, body: ResponsesRequest, request: Request
    ) -> Response:
        run = checked_run(request, run, default_run)
        return await turn(run, session_id, body, header=False)
