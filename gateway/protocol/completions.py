"""OpenAI (legacy) Completions: text or token-id prompts, not streamed."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from gateway.protocol.chat import OpenAIRequest, StreamOptions
from gateway.protocol.wire import Int64, Temperature, TokenCount, TopP, Usage, Wire

__all__ = ["Completion", "CompletionChoice", "CompletionLogprobs", "CompletionRequest"]

TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]


class CompletionRequest(OpenAIRequest):
    model: str | None = Field(None, description="the served model (GET /v1/models); omitted: it")
    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[TokenId], Field(min_length=1)] = (
        Field(description="text, or token ids (tokens in, tokens out)")
    )
    stream: Literal[False] = Field(False, description="streaming: use chat/completions")
    stream_options: StreamOptions | None = None
    logprobs: int | None = Field(None, ge=0, le=20)
    max_tokens: TokenCount | None = 16
    temperature: Temperature | None = None
    top_p: TopP | None = None
    seed: Int64 | None = None
    n: int = Field(1, ge=1, le=1)


class CompletionLogprobs(Wire):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(Wire):
    index: int = 0
    text: str
    finish_reason: str
    logprobs: CompletionLogprobs | None = None


class Completion(Wire):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
