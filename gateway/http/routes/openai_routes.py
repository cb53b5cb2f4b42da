"""Routes of the OpenAI API: per session (``/sessions/{sid}/v1``, ``/runs/{run}/sessions/{sid}/v1``)
and with the session in a header (``/v1`` + ``X-Session-Id``, opened on first use)."""

from __future__ import annotations

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
from gateway.protocol.chat import ChatCompletion, ChatCompletionRequest
from gateway.protocol.completions import Completion, CompletionRequest
from gateway.protocol.wire import ModelCard, ModelList
from gateway.serving import ChatServing, CompletionServing, SessionService

__all__ = ["openai_routes"]

_HEADERS = header_parameters()
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


def openai_routes(
    router: APIRouter,
    sessions: SessionService,
    chat: ChatServing,
    completions: CompletionServing,
    default_run: str,
) -> None:
    """Adds the routes to ``router`` (the app's own: FastAPI's ``include_router`` matches an
    included router's routes through one more layer per request). Routes are matched in
    order: the turn routes come first, the most used first."""
    models = ModelList.build(data=[ModelCard.build(id=chat.engine.model_name)])

    async def chat_turn(run: str, sid: str, body: ChatCompletionRequest, header: bool) -> Response:
        return await serve_turn(sessions, chat, run, sid, body, open_missing=header)

    async def completion_turn(
        run: str, sid: str, body: CompletionRequest, header: bool
    ) -> Response:
        chat.engine.check_model(body.model)
        async with sessions.use(run, sid, open_missing=header) as session:
            return json_response(await completions.complete(session, body))

    async def session_models(run: str, sid: str) -> Response:
        async with sessions.use(run, sid):
            return json_response(models)

    # -- /sessions/{sid}/v1: the gateway's run (or the key's only run) ------------------------

    @router.post("/sessions/{session_id}/v1/chat/completions", response_model=None, responses=_CHAT)
    async def session_chat(
        session_id: SessionId, body: ChatCompletionRequest, request: Request
    ) -> Response:
        run = checked_run(request, None, default_run)
        return await chat_turn(run, session_id, body, header=False)

    @router.post(
        "/sessions/{session_id}/v1/completions", response_model=None, responses=_COMPLETION
    )
    async def session_complete(
        session_id: SessionId, body: CompletionRequest, request: Request
    ) -> Response:
        run = checked_run(request, None, default_run)
        return await completion_turn(run, session_id, body, header=False)

    @router.get("/sessions/{session_id}/v1/models", response_model=None, responses=_MODELS)
    async def session_model_list(session_id: SessionId, request: Request) -> Response:
        return await session_models(checked_run(request, None, default_run), session_id)

    # -- /v1 with X-Session-Id ---------------------------------------------------------------

    @router.post(
        "/v1/chat/completions", response_model=None, responses=_CHAT, openapi_extra=_HEADERS
    )
    async def header_chat(body: ChatCompletionRequest, request: Request) -> Response:
        run, session = header_session(request, default_run)
        return await chat_turn(run, session, body, header=True)

    @router.post(
        "/v1/completions", response_model=None, responses=_COMPLETION, openapi_extra=_HEADERS
    )
    async def header_complete(body: CompletionRequest, request: Request) -> Response:
        run, session = header_session(request, default_run)
        return await completion_turn(run, session, body, header=True)

    @router.get(
        "/v1/models", response_model=None, responses={200: {"model": ModelList}, **errors()}
    )
    async def list_models() -> Response:
        return json_response(models)

    # -- /runs/{run}/sessions/{sid}/v1: any run --------------------------------------------

    @router.post(
        "/runs/{run}/sessions/{session_id}/v1/chat/completions",
        response_model=None,
        responses=_CHAT,
    )
    async def run_session_chat(
        run: RunId, session_id: SessionId, body: ChatCompletionRequest, request: Request
    ) -> Response:
        run = checked_run(request, run, default_run)
        return await chat_turn(run, session_id, body, header=False)

    @router.post(
        "/runs/{run}/sessions/{session_id}/v1/completions",
        response_model=None,
        responses=_COMPLETION,
    )
    async def run_session_complete(
        run: RunId, session_id: SessionId, body: CompletionRequest, request: Request
    ) -> Response:
        run = checked_run(request, run, default_run)
        return await completion_turn(run, session_id, body, header=False)

    @router.get(
        "/runs/{run}/sessions/{session_id}/v1/models", response_model=None, responses=_MODELS
    )
    async def run_session_model_list(
        run: RunId, session_id: SessionId, request: Request
    ) -> Response:
        return await session_models(checked_run(request, run, default_run), session_id)
