"""What every request and response model shares: bounded numbers, free-form JSON checks, the
error body, usage, the model list.

Input is checked where it enters: the body guard (``gateway.http``) decodes strictly (UTF-8,
finite numbers, integers within int64, bounded nesting); these types bound each field.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

__all__ = [
    "INT64_MAX",
    "INT64_MIN",
    "ErrorBody",
    "ErrorResponse",
    "FiniteFloat",
    "Int64",
    "ModelCard",
    "ModelList",
    "TokenCount",
    "Usage",
    "Wire",
]

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
TokenCount = Annotated[int, Field(ge=1, le=2**31 - 1)]


def _not_a_bool(value: object) -> object:
    # pydantic's lax mode reads true/false as 1.0/0.0: a reward of `false` is a client bug.
    if isinstance(value, bool):
        raise ValueError("must be a number, not a boolean")
    return value


FiniteFloat = Annotated[float, BeforeValidator(_not_a_bool), Field(allow_inf_nan=False)]


class Wire(BaseModel):
    """A response model: built by the gateway with ``model_construct`` (what it builds needs
    no validation), serialized by pydantic's Rust serializer, documented in the OpenAPI schema."""

    model_config = ConfigDict(extra="forbid")

    def json_bytes(self) -> bytes:
        return self.__pydantic_serializer__.to_json(self)


class ErrorBody(BaseModel):
    message: str = Field(description="what was wrong and what to do")
    type: str = Field(description="e.g. invalid_request_error, authentication_error")
    param: str | None = Field(None, description="the request field at fault, if any")
    code: str = Field(description="e.g. invalid_request, session_not_found, log_unavailable")


class ErrorResponse(BaseModel):
    """Every error, on every route: OpenAI's error body."""

    error: ErrorBody


class Usage(Wire):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ModelCard(Wire):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "turnstream"


class ModelList(Wire):
    object: Literal["list"] = "list"
    data: list[ModelCard]
