"""Routes of the OpenAI API: ``chat/completions``, ``completions`` and ``models``, each at the
three scopes of a session (``scoped_routes``)."""

from __future__ import annotations

from fastapi import Request, Response

from gateway.http.routes.scoped_routes import (
    ScopedRoutes,
    SessionRef,
    errors,
    json_response,
    serve_turn,
)
from gateway.protocol.chat import ChatCompletion, ChatCompletionRequest
from gateway.protocol.completions import Completion, CompletionRequest
from gateway.protocol.wire import ModelCard, ModelList
from gateway.serving import ChatServing, CompletionServing, SessionService

__all__ = ["add_openai_routes"]

_CHAT = {
    200: {
        "content": {"text/event-stream": {}},
        "model": ChatCompletion,
        "description": "the completion; with stream=true, chat.completion.chunk events",
    },
    **errors(404, 409, 502, 503),
}
_COMPLETION = {200: {"model": Completion}, **errors(404, 409, 502, 503)}
_MODELS = {200: {"model": ModelList}, **errors(404, 503)}


def add_openai_routes(
    routes: ScopedRoutes,
    sessions: SessionService,
    chat: ChatServing,
    completions: CompletionServing,
) -> None:
    """Adds the routes, the most used first (Starlette matches routes in order)."""
    models = ModelList.build(data=[ModelCard.build(id=chat.engine.model_name)])

    async def chat_turn(where: SessionRef, body: ChatCompletionRequest) -> Response:
        return await serve_turn(sessions, chat, where, body)

    async def completion_turn(where: SessionRef, body: CompletionRequest) -> Response:
        chat.engine.check_model(body.model)
        async with sessions.use(where.run, where.session, open_missing=where.open_missing) as s:
            return json_response(await completions.complete(s, body, where.agent))

    async def session_models(where: SessionRef, _: None) -> Response:
        async with sessions.use(where.run, where.session):  # the session must exist
            return json_response(models)

    async def any_models(request: Request, _: None) -> Response:
        return json_response(models)

    routes.add(
        "/chat/completions", chat_turn, name="chat", body=ChatCompletionRequest, responses=_CHAT
    )
    routes.add(
        "/completions",
        completion_turn,
        name="complete",
        body=CompletionRequest,
        responses=_COMPLETION,
    )
    routes.add(
        "/models",
        session_models,
        name="model_list",
        body=None,
        method="GET",
        responses=_MODELS,
        header=any_models,  # no session needed
        header_name="list_models",
        header_responses={200: {"model": ModelList}, **errors()},
        header_note=None,
    )
