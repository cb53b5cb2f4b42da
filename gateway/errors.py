"""Errors of the gateway, and the one table that maps them to OpenAI error bodies.

    GatewayError                         (TurnstreamError)
    ├── InvalidRequest           400     malformed JSON, bad fields, unsupported parameters
    ├── Unauthorized             401     missing or wrong bearer key
    ├── RunNotAllowed            403     a per-run key used on another run
    ├── SessionNotFound          404     no such session in this run
    ├── ModelNotFound            404     a model this gateway does not serve
    ├── RouteNotFound            404     no such route
    ├── MethodNotAllowed         405     a known route, another method
    ├── RequestTimeout           408     the body did not arrive within the deadline
    ├── SessionClosed            409     a turn or reward on a closed session
    ├── SessionExists            409     creating a session that exists with another group/metadata
    ├── RequestTooLarge          413     a body over the size limit
    ├── ContextLengthExceeded    413     prompt (+ max_tokens) over the model's context length
    ├── BackendError             502     the inference backend failed or returned garbage
    │   └── BackendUnavailable   503     no replica could take the request
    │       └── GenerationInterrupted 503  an aborted generation could not continue in time
    └── (schemas) EventLogUnavailable / OutboxFull -> 503: the turn could not be made durable
        (eventlog's LogStoreFull, JetStream's store without room, among them), with Retry-After

Every error reaches the client as ``{"error": {"message", "type", "param", "code"}}`` with the
status from ``ERROR_TABLE``; nothing else decides a status code. The Anthropic Messages routes
answer the same errors in Anthropic's body (``anthropic_error_body``): ``{"type": "error",
"error": {"type", "message"}}``, with the same status except a prompt over the context: 400
"prompt is too long", as Anthropic's API answers it.
"""

from __future__ import annotations

from dataclasses import dataclass

from eventlog.errors import LogStoreFull
from schemas.errors import EventLogUnavailable, OutboxFull, SchemaError, TurnstreamError

__all__ = [
    "ERROR_TABLE",
    "BackendError",
    "BackendUnavailable",
    "ContextLengthExceeded",
    "ErrorSpec",
    "GatewayError",
    "GenerationInterrupted",
    "InvalidRequest",
    "MethodNotAllowed",
    "ModelNotFound",
    "RequestTimeout",
    "RequestTooLarge",
    "RouteNotFound",
    "RunNotAllowed",
    "SessionClosed",
    "SessionExists",
    "SessionNotFound",
    "Unauthorized",
    "anthropic_error_body",
    "anthropic_status",
    "error_body",
    "error_spec",
    "retry_after_s",
]


class GatewayError(TurnstreamError):
    """Root of the gateway's errors. ``param`` names the offending request field, if any."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class InvalidRequest(GatewayError):
    """Malformed JSON, bad fields, unsupported parameters (400)."""


class Unauthorized(GatewayError):
    """A missing or wrong bearer key (401)."""


class RunNotAllowed(GatewayError):
    """A valid key that is not allowed for the request's run (403)."""


class SessionNotFound(GatewayError):
    """No such session in this run, here or in the log (404)."""


class ModelNotFound(GatewayError):
    """A ``model`` this gateway does not serve (404)."""


class RouteNotFound(GatewayError):
    """No route at this path (404)."""


class MethodNotAllowed(GatewayError):
    """The route exists, not with this method (405)."""


class RequestTimeout(GatewayError):
    """The request body did not arrive within the deadline (408)."""


class SessionClosed(GatewayError):
    """A turn, reward or close on a closed session (409)."""


class SessionExists(GatewayError):
    """Creating a session that exists with another group or metadata (409)."""


class RequestTooLarge(GatewayError):
    """A request body over the size limit (413)."""


class ContextLengthExceeded(GatewayError):
    """Prompt (+ max_tokens) over the model's context length (413)."""


class BackendError(GatewayError):
    """The inference backend failed or returned garbage (502)."""


class BackendUnavailable(BackendError):
    """No replica could take the request (503)."""


class GenerationInterrupted(BackendUnavailable):
    """The backend aborted the turn's generation (a weight update) and did not take its
    continuation within ``--continue-wait-s``: nothing was recorded (503, with Retry-After)."""

    def __init__(self, message: str, *, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class ErrorSpec:
    status: int
    type: str
    code: str


# Most specific first: the first matching class decides.
ERROR_TABLE: tuple[tuple[type[BaseException], ErrorSpec], ...] = (
    (InvalidRequest, ErrorSpec(400, "invalid_request_error", "invalid_request")),
    (SchemaError, ErrorSpec(400, "invalid_request_error", "invalid_request")),
    (Unauthorized, ErrorSpec(401, "authentication_error", "invalid_api_key")),
    (RunNotAllowed, ErrorSpec(403, "permission_error", "run_not_allowed")),
    (SessionNotFound, ErrorSpec(404, "invalid_request_error", "session_not_found")),
    (ModelNotFound, ErrorSpec(404, "invalid_request_error", "model_not_found")),
    (RouteNotFound, ErrorSpec(404, "invalid_request_error", "not_found")),
    (MethodNotAllowed, ErrorSpec(405, "invalid_request_error", "method_not_allowed")),
    (RequestTimeout, ErrorSpec(408, "invalid_request_error", "request_timeout")),
    (SessionClosed, ErrorSpec(409, "invalid_request_error", "session_closed")),
    (SessionExists, ErrorSpec(409, "invalid_request_error", "session_exists")),
    (RequestTooLarge, ErrorSpec(413, "invalid_request_error", "request_too_large")),
    (ContextLengthExceeded, ErrorSpec(413, "invalid_request_error", "context_length_exceeded")),
    (BackendUnavailable, ErrorSpec(503, "server_error", "backend_unavailable")),
    (BackendError, ErrorSpec(502, "server_error", "backend_error")),
    (OutboxFull, ErrorSpec(503, "server_error", "log_unavailable")),
    (EventLogUnavailable, ErrorSpec(503, "server_error", "log_unavailable")),
)
_INTERNAL = ErrorSpec(500, "server_error", "internal_error")


# Retry-After of a 503 whose turn could not be made durable: an outage of the log is seconds
# (a restart, a leader election); a full store waits for an operator or a retention limit.
LOG_RETRY_AFTER_S = 1.0
STORE_FULL_RETRY_AFTER_S = 5.0


def retry_after_s(exc: BaseException) -> float | None:
    """The seconds a client should wait before retrying, for a Retry-After header; None: no
    header (retrying the same request cannot help, or the error does not say)."""
    explicit: float | None = getattr(exc, "retry_after_s", None)
    if explicit is not None:
        return explicit
    if isinstance(exc, LogStoreFull):
        return STORE_FULL_RETRY_AFTER_S
    if isinstance(exc, EventLogUnavailable | OutboxFull):
        return LOG_RETRY_AFTER_S
    return None


def error_spec(exc: BaseException) -> ErrorSpec:
    for cls, spec in ERROR_TABLE:
        if isinstance(exc, cls):
            return spec
    return _INTERNAL


def error_body(exc: BaseException) -> dict[str, object]:
    """The OpenAI error body for ``exc``; unexpected errors do not leak their details."""
    spec = error_spec(exc)
    if isinstance(exc, TurnstreamError):
        message = str(exc)
    else:
        message = f"internal error ({type(exc).__name__}); the gateway log has the details"
    return {
        "message": message,
        "type": spec.type,
        "param": getattr(exc, "param", None),
        "code": spec.code,
    }


# Anthropic's error types by status (its API documents these; 409 and 405 have none of their own).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    502: "api_error",
    503: "overloaded_error",
}


def anthropic_error_body(exc: BaseException) -> dict[str, object]:
    """The Anthropic error body for ``exc`` (its status: ``anthropic_status(exc)``)."""
    status = anthropic_status(exc)
    kind = _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    message = str(error_body(exc)["message"])
    if isinstance(exc, ContextLengthExceeded):
        # Anthropic's words for it: Claude Code compacts its history when it reads them.
        message = f"prompt is too long: {message}"
    return {"type": "error", "error": {"type": kind, "message": message}}


def anthropic_status(exc: BaseException) -> int:
    """The status of ``exc`` on the Anthropic routes: ``ERROR_TABLE``'s, except a prompt over
    the context, which Anthropic answers 400 (not 413: that is its body-size error)."""
    if isinstance(exc, ContextLengthExceeded):
        return 400
    return error_spec(exc).status
