"""Routes of the Anthropic Messages API: ``messages`` and ``messages/count_tokens`` at the three
scopes of a session (``scoped_routes``); at ``/v1/messages`` Claude Code's
``X-Claude-Code-Session-Id`` names the session too, and counting tokens needs none.

The ``anthropic`` SDK appends ``/v1/messages`` to its base URL: a session's Anthropic base URL
is ``<gateway>/sessions/<sid>`` (Claude Code: ``ANTHROPIC_BASE_URL``), or the gateway itself
with a session header. Errors on these routes leave in Anthropic's body (``gateway.http.app``).
"""

from __future__ import annotations

from typing import Any

from fastapi import Request, Response

from gateway.http.routes.scoped_routes import (
    ScopedRoutes,
    SessionRef,
    errors,
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
from gateway.serving.anthropic_service import AnthropicServing

__all__ = ["add_anthropic_routes"]


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


def add_anthropic_routes(
    routes: ScopedRoutes, sessions: SessionService, serving: AnthropicServing
) -> None:
    """Adds the Messages routes."""

    async def turn(where: SessionRef, body: MessagesRequest) -> Response:
        return await serve_turn(sessions, serving, where, body)

    async def count(where: SessionRef, body: CountTokensRequest) -> Response:
        serving.engine.check_model(body.model)
        async with sessions.use(where.run, where.session):  # the session must exist
            return json_response(await serving.count_tokens(body))

    async def count_any(request: Request, body: CountTokensRequest) -> Response:
        serving.engine.check_model(body.model)
        return json_response(await serving.count_tokens(body))

    routes.add(
        "/messages",
        turn,
        name="messages",
        body=MessagesRequest,
        responses=_MESSAGES,
        header_note="; Claude Code's X-Claude-Code-Session-Id is taken in its place",
    )
    routes.add(
        "/messages/count_tokens",
        count,
        name="count_tokens",
        body=CountTokensRequest,
        responses=_COUNT,
        header=count_any,
        header_name="count_tokens",
        header_note=None,
        header_doc="No session needed: the count is the prompt's, rendered from scratch.",
    )
