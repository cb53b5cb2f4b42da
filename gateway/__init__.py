"""The OpenAI-compatible gateway: sessions, tokens in / tokens out, tool calls, backends.

Every completion turn is published to the event log (and acknowledged) before it is answered.
"""

from gateway.backends import Backend, GenerationChunk, ReplicaRouter, SamplingParams
from gateway.core.aggregate import SessionState, apply, fold
from gateway.core.session_store import Session, SessionStore
from gateway.errors import (
    BackendError,
    BackendUnavailable,
    ContextLengthExceeded,
    GatewayError,
    InvalidRequest,
    SessionClosed,
    SessionNotFound,
    Unauthorized,
)
from gateway.http.app import create_app
from gateway.http.guard import BodyLimits
from gateway.metrics import GatewayMetrics
from gateway.serving import ChatServing, CompletionServing, SessionService, TurnEngine
from gateway.templates import ChatTemplate
from gateway.tools import ToolCallParser, get_parser

__all__ = [
    "Backend",
    "BackendError",
    "BackendUnavailable",
    "BodyLimits",
    "ChatServing",
    "ChatTemplate",
    "CompletionServing",
    "ContextLengthExceeded",
    "GatewayError",
    "GatewayMetrics",
    "GenerationChunk",
    "InvalidRequest",
    "ReplicaRouter",
    "SamplingParams",
    "Session",
    "SessionClosed",
    "SessionNotFound",
    "SessionService",
    "SessionState",
    "SessionStore",
    "ToolCallParser",
    "TurnEngine",
    "Unauthorized",
    "apply",
    "create_app",
    "fold",
    "get_parser",
]
