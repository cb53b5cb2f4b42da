"""Routes of the OpenAI Responses API: ``responses`` at the three scopes of a session
(``scoped_routes``); at ``/v1/responses`` the session is the one a header names (``X-Session-Id``
or Codex's ``session-id``, opened on first use), else the one ``previous_response_id`` names."""

from __future__ import annotations

from fastapi import Request, Response

from gateway.errors import InvalidRequest, SessionNotFound
from gateway.http.agent_headers import agent_identity
from gateway.http.routes.scoped_routes import (
    SESSION_HEADERS,
    ScopedRoutes,
    SessionRef,
    errors,
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
from gateway.serving.responses_input import parse_response_id
from gateway.serving.responses_service import ResponsesServing

__all__ = ["add_responses_routes"]

_RESPONSES = {
    200: {
        "content": {"text/event-stream": {}},
        "model": ResponseObject,
        "description": "the response; with stream=true, typed response.* events",
    },
    **errors(404, 409, 502, 503),
}


def add_responses_routes(
    routes: ScopedRoutes, sessions: SessionService, serving: ResponsesServing
) -> None:
    """Adds the routes."""

    async def turn(where: SessionRef, body: ResponsesRequest) -> Response:
        return await serve_turn(sessions, serving, where, body)

    async def headed(request: Request, body: ResponsesRequest) -> Response:
        named = None
        if body.previous_response_id is not None:
            named, _ = parse_response_id(body.previous_response_id)
        headers = any(request.headers.get(h) for h in SESSION_HEADERS)
        run, sid = header_session(request, routes.default_run, fallback=named)
        agent = agent_identity(request.headers)
        if headers:
            return await turn(SessionRef(run, sid, open_missing=True, agent=agent), body)
        try:  # the session of previous_response_id: it must exist
            return await turn(SessionRef(run, sid, agent=agent), body)
        except SessionNotFound as exc:
            raise InvalidRequest(
                f"previous_response_id {body.previous_response_id!r}: no session {sid!r} in "
                f"run {run!r}",
                param="previous_response_id",
            ) from exc

    routes.add(
        "/responses",
        turn,
        name="responses",
        body=ResponsesRequest,
        responses=_RESPONSES,
        header=headed,
        header_note=(
            "; also read from Codex's session-id; without one, the session that "
            "previous_response_id names"
        ),
    )
