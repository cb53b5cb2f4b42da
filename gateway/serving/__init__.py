"""The logic behind the routes (vLLM's ``serving_*`` modules): one turn core (``turn_data``: a
turn's request, generation and result; ``engine`` makes a turn, ``turn_service`` serves it whole
or streamed) and one module per API surface, plus the session API."""

from gateway.serving.anthropic_service import AnthropicServing
from gateway.serving.chat_service import ChatServing
from gateway.serving.completion_service import CompletionServing
from gateway.serving.engine import TurnEngine
from gateway.serving.responses_service import ResponsesServing
from gateway.serving.session_service import SessionService, session_info
from gateway.serving.turn_data import Generation, Turn, TurnResult
from gateway.serving.turn_service import StreamEncoder, TurnServing, TurnStream

__all__ = [
    "AnthropicServing",
    "ChatServing",
    "CompletionServing",
    "Generation",
    "ResponsesServing",
    "SessionService",
    "StreamEncoder",
    "Turn",
    "TurnEngine",
    "TurnResult",
    "TurnServing",
    "TurnStream",
    "session_info",
]
