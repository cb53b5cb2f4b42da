"""What the routers share: the run of a request, id patterns, the documented error statuses."""

from __future__ import annotations

import re
from typing import Annotated, Any

from fastapi import Header, Request, Response

from gateway.errors import InvalidRequest, RunNotAllowed
from gateway.guard import allowed_runs
from gateway.protocol.common import ErrorResponse, Wire
from schemas.ids import ID_PATTERN

__all__ = [
    "ID",
    "SESSION_HEADERS",
    "RunHeader",
    "checked_run",
    "errors",
    "header_session",
    "json_response",
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


# Where a /v1 turn route finds its session: ours, then the session headers of the clients that
# send their own (Claude Code, Codex CLI); the first present wins. Same rules for all.
SESSION_HEADERS = ("X-Session-Id", "X-Claude-Code-Session-Id", "session-id")


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
