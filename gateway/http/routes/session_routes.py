"""Routes of the session API (thin: parse, call ``SessionService``, shape the reply)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response

from gateway.http.routes.scoped_routes import (
    RunHeader,
    SessionId,
    checked_run,
    errors,
    json_response,
)
from gateway.protocol.session_api import (
    CloseSessionRequest,
    CreateSessionRequest,
    RewardReceipt,
    SessionCreated,
    SessionInfo,
)
from gateway.protocol.session_api import RewardRequest as RewardBody
from gateway.serving import SessionService, session_info

__all__ = ["add_session_routes"]


def add_session_routes(router: APIRouter, sessions: SessionService, default_run: str) -> None:
    """Adds the session API's routes to ``router`` (the app's own: FastAPI's ``include_router``
    matches an included router's routes through one more layer per request). Each is at one
    path: the session's id in it, its run in ``X-Run-Id`` (or the body, on creation)."""

    def run_of(request: Request, x_run_id: RunHeader = None) -> str:
        return checked_run(request, x_run_id, default_run)

    run_dependency = Depends(run_of)

    @router.post(
        "/v1/sessions",
        response_model=None,
        responses={200: {"model": SessionCreated}, **errors(409, 503)},
    )
    async def create_session(
        body: CreateSessionRequest, request: Request, x_run_id: RunHeader = None
    ) -> Response:
        run = checked_run(request, body.run or x_run_id, default_run)
        session = await sessions.create(run, body)
        state = session.state
        scope = "" if run == default_run else f"runs/{run}/"
        created = SessionCreated.build(
            **state.describe(), base_url=f"{request.base_url}{scope}sessions/{state.id}/v1"
        )
        return json_response(created)

    @router.get(
        "/v1/sessions/{session_id}",
        response_model=None,
        responses={200: {"model": SessionInfo}, **errors(404, 503)},
    )
    async def get_session(session_id: SessionId, run: str = run_dependency) -> Response:
        async with sessions.use(run, session_id) as session:
            return json_response(session_info(session.state))

    @router.post(
        "/v1/sessions/{session_id}/reward",
        response_model=None,
        responses={200: {"model": RewardReceipt}, **errors(404, 409, 503)},
    )
    async def reward(
        session_id: SessionId, body: RewardBody, run: str = run_dependency
    ) -> Response:
        async with sessions.use(run, session_id) as session:
            return json_response(await sessions.reward(session, body))

    @router.post(
        "/v1/sessions/{session_id}/close",
        response_model=None,
        responses={200: {"model": SessionInfo}, **errors(404, 409, 503)},
    )
    async def close(
        session_id: SessionId,
        body: CloseSessionRequest | None = None,
        run: str = run_dependency,
    ) -> Response:
        async with sessions.use(run, session_id) as session:
            return json_response(await sessions.close(session, body or CloseSessionRequest()))
