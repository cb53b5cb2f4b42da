"""Routes of the Anthropic Messages API: per session (``/sessions/{sid}/v1/messages``,
``/runs/{run}/sessions/{sid}/v1/messages``) and with the session in a header (``/v1/messages``
+ ``X-Session-Id`` or Claude Code's ``X-Claude-Code-Session-Id``, opened on first use).

The ``anthropic`` SDK appends ``/v1/messages`` to its base URL: a session's Anthropic base URL
is ``<gateway>/sessions/<sid>`` (Claude Code: ``ANTHROPIC_BASE_URL``), or the gateway itself
with a session header. Errors on these routes leave in Anthropic's body (``gateway.http.app``).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response

from gateway.http.routes.scoped_routes import (
    RunId,
    SessionId,
    checked_run,
    errors,
    header_parameters,
    header_session,
    json_response,
    serve_turn,
)
from gateway.protocol.anthropic import (
    CountTokensRequest,
    MessagesRequest,
)
from gateway.protocol.anthropic_reply import (
    AnthropicErrorResponse,
    Message,
    TokenCountResult,
)
from gateway.serving import SessionService
from gateway.serving.anthropic import AnthropicServing

__all__ = ["anthropic_routes"]

_HEADERS = header_parameters("; Claude Code's X-Claude-Code-Session-Id is taken in its place")


def anthropic_errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The routes' error statuses, each with Anthropic's error body."""
    return {
        status: {**entry, "model": AnthropicErrorResponse}
        for status, entry in errors(*statuses).items()
    }


_MESSAGES = {
    200: {
        "content": {"text/event-stream": {}},
        "model": Message,
        "description": "the message; with stream=true, Anthropic's stream events",
    },
    **anthropic_errors(404, 409, 502, 503),
}
_COUNT = {200: {"model": TokenCountResult}, **anthropic_errors(404)}


def anthropic_routes(
    router: APIRouter, sessions: SessionService, serving: AnthropicServing, default_run: str
) -> None:
    """Adds the Messages routes to ``router`` (the app's own)."""

    async def turn(run: str, sid: str, body: MessagesRequest, header: bool) -> Response:
        return await serve_turn(sessions, serving, run, sid, body, open_missing=header)

    async def count(run: str | None, sid: str | None, body: CountTokensRequest) -> Response:
        serving.engine.check_model(body.model)
        if run is None or sid is None:
            return json_response(await serving.count_tokens(body))
        async with sessions.use(run, sid):  # the session must exist
            return json_response(await serving.count_tokens(body))

    @router.post("/sessions/{session_id}/v1/messages", response_model=None, responses=_MESSAGES)
    async def session_messages(
        session_id: SessionId, body: MessagesRequest, request: Request
    ) -> Response:
        run = checked_run(request, None, default_run)
        return await turn(run, session_id, body, header=False)

    @router.post("/v1/messages", response_model=None, responses=_MESSAGES, openapi_extra=_HEADERS)
    async def header_messages(body: MessagesRequest, request: Request) -> Response:
        run, session = header_session(request, default_run)
        return await turn(run, session, body, header=True)

    @router.post(
        "/runs/{run}/sessions/{session_id}/v1/messages", response_model=None, responses=_MESSAGES
    )
    async def run_session_messages(
        run: RunId, session_id: SessionId, body: MessagesRequest, request: Request
    ) -> Response:
        run = checked_run(request, run, default_run)
        return await turn(run, session_id, body, header=False)

    @router.post(
        "/sessions/{session_id}/v1/messages/count_tokens", response_model=None, responses=_COUNT
    )
    async def session_count_tokens(
        session_id: SessionId, body: CountTokensRequest, request: Request
    ) -> Response:
        return await count(checked_run(request, None, default_run), session_id, body)

    @router.post("/v1/messages/count_tokens", response_model=None, responses=_COUNT)
    async def count_tokens(body: CountTokensRequest) -> Response:
        """No session needed: the count is the prompt's, rendered from scratch."""
        return await count(None, None, body)

    @router.post(
        "/runs/{run}/sessions/{session_id}/v1/messages/count_tokens",
        response_model=None,
        responses=_COUNT,
    )
    async def run_session_count_tokens(
        run: RunId, session_id: SessionId, body: CountTokensRequest, request: Request
    ) -> Response:
        return await count(checked_run(request, run, default_run), session_id, body)
