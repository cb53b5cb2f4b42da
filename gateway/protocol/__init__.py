"""Request and response models of every route, and the error body (the OpenAPI contract)."""

from gateway.protocol.anthropic import (
    MessagesRequest,
)
from gateway.protocol.anthropic_reply import (
    Message,
)
from gateway.protocol.chat import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatMessage,
    ChatTool,
    message_text,
)
from gateway.protocol.completions import Completion, CompletionRequest
from gateway.protocol.responses import (
    ResponsesRequest,
)
from gateway.protocol.responses_reply import (
    ResponseObject,
)
from gateway.protocol.session_api import (
    CloseSessionRequest,
    CreateSessionRequest,
    RewardReceipt,
    RewardRequest,
    SessionCreated,
    SessionInfo,
)
from gateway.protocol.wire import ErrorBody, ErrorResponse, ModelCard, ModelList, Usage

__all__ = [
    "ChatCompletion",
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "ChatMessage",
    "ChatTool",
    "CloseSessionRequest",
    "Completion",
    "CompletionRequest",
    "CreateSessionRequest",
    "ErrorBody",
    "ErrorResponse",
    "Message",
    "MessagesRequest",
    "ModelCard",
    "ModelList",
    "ResponseObject",
    "ResponsesRequest",
    "RewardReceipt",
    "RewardRequest",
    "SessionCreated",
    "SessionInfo",
    "Usage",
    "message_text",
]
