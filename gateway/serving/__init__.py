"""The logic behind the routes (vLLM's ``serving_*`` modules): one turn core (``engine``) and
one module per API surface, plus the session API."""

from gateway.serving.chat import ChatServing, ChatStream
from gateway.serving.completion import CompletionServing
from gateway.serving.engine import Turn, TurnEngine, TurnResult
from gateway.serving.sessions import SessionService, session_info

__all__ = [
    "ChatServing",
    "ChatStream",
    "CompletionServing",
    "SessionService",
    "Turn",
    "TurnEngine",
    "TurnResult",
    "session_info",
]
