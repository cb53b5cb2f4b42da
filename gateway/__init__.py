"""The OpenAI-compatible gateway: sessions, tokens in / tokens out, tool calls, backends.

Every completion turn is published to the event log (and acknowledged) before it is answered.
"""

from gateway.app import create_app
from gateway.backends import Backend, GenerationChunk, ReplicaRouter, SamplingParams
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
from gateway.metrics import GatewayMetrics
from gateway.serving import ChatService
from gateway.sessions import Session, SessionStore
from gateway.templates import ChatTemplate
from gateway.tools import ToolCallParser, get_parser

__all__ = [
    "Backend",
    "BackendError",
    "BackendUnavailable",
    "ChatService",
    "ChatTemplate",
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
    "SessionStore",
    "ToolCallParser",
    "Unauthorized",
    "create_app",
    "get_parser",
]
