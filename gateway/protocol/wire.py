"""What every request and response model shares: bounded numbers, free-form JSON checks, the
error body, usage, the model list.

Input is checked where it enters: the body guard (``gateway.http``) decodes strictly (UTF-8,
finite numbers, integers within int64, bounded nesting); these types bound each field.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Annotated, Any, Literal, Self

import msgspec
from jsonschema import exceptions as jsonschema_errors
from jsonschema import validators
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema

__all__ = [
    "INT64_MAX",
    "INT64_MIN",
    "JSON_VALUE_SCHEMA",
    "ErrorBody",
    "ErrorResponse",
    "FiniteFloat",
    "Int64",
    "JSONObject",
    "ModelCard",
    "ModelList",
    "Temperature",
    "TokenCount",
    "TopP",
    "Usage",
    "Wire",
    "free_form_extras",
    "schema_problem",
]

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# The schema states a range 1024 inside int64, exact as a float: JSON-schema tools compute
# bounds in floating point (schemathesis generated -2**63 - 191 for a minimum of -2**63).
_SAFE_INT64 = 2**63 - 1024
Int64 = Annotated[
    int,
    Field(ge=INT64_MIN, le=INT64_MAX),
    WithJsonSchema({"type": "integer", "minimum": -_SAFE_INT64, "maximum": _SAFE_INT64}),
]
TokenCount = Annotated[int, Field(ge=1, le=2**31 - 1)]


def _not_a_bool(value: object) -> object:
    # pydantic's lax mode reads true/false as 1.0/0.0: a reward of `false` is a client bug.
    if isinstance(value, bool):
        raise ValueError("must be a number, not a boolean")
    return value


FiniteFloat = Annotated[float, Field(allow_inf_nan=False), BeforeValidator(_not_a_bool)]
# Constraints inside the Annotated: on an Optional they would not reach the JSON schema.
Temperature = Annotated[float, Field(ge=0, le=2)]
TopP = Annotated[float, Field(gt=0, le=1)]


# Free-form JSON (metadata, extra message fields, tool schemas) as the OpenAPI schema documents
# it: JSON whose integers fit int64, nested (in the schema) three levels deep. The schema states
# less than the gateway accepts (deeper nesting, up to --max-json-depth, is fine), so every
# document it allows is accepted; it is inline, not a recursive $ref, so each model's own
# ``model_json_schema()`` stands alone. Validation is the body guard's, once per request.
def _json_value(depth: int) -> dict[str, Any]:
    options: list[dict[str, Any]] = [
        {"type": "string"},
        {"type": "boolean"},
        {"type": "null"},
        {"type": "number", "minimum": -_SAFE_INT64, "maximum": _SAFE_INT64},
    ]
    if depth > 0:
        inner = _json_value(depth - 1)
        options += [
            {"type": "array", "items": inner},
            {"type": "object", "additionalProperties": inner},
        ]
    return {"anyOf": options}


JSON_VALUE_SCHEMA = _json_value(2)
JSONObject = Annotated[
    dict[str, Any], WithJsonSchema({"type": "object", "additionalProperties": JSON_VALUE_SCHEMA})
]


def free_form_extras(schema: dict[str, Any]) -> None:
    """``json_schema_extra`` of models that keep the fields a client adds: JSON values."""
    schema["additionalProperties"] = JSON_VALUE_SCHEMA


class Wire(BaseModel):
    """A response model: built by the gateway with ``build`` (what it builds needs no
    validation), serialized by pydantic's Rust serializer, documented in the OpenAPI schema."""

    model_config = ConfigDict(extra="forbid")

    @classmethod
    def build(cls, **fields: Any) -> Self:
        """The model of ``fields`` (the rest at their defaults) without validation: what
        ``model_construct`` does, in half its time (it runs several times per request)."""
        model = cls.__new__(cls)
        values = {**cls._defaults(), **fields}
        object.__setattr__(model, "__dict__", values)
        object.__setattr__(model, "__pydantic_fields_set__", set(fields))
        object.__setattr__(model, "__pydantic_extra__", None)
        object.__setattr__(model, "__pydantic_private__", None)
        return model

    @classmethod
    def _defaults(cls) -> dict[str, Any]:
        defaults: dict[str, Any] | None = cls.__dict__.get("_wire_defaults")
        if defaults is None:
            defaults = {}
            for name, field in cls.model_fields.items():
                if field.default_factory is not None:
                    raise TypeError(f"{cls.__name__}.{name}: wire models take plain defaults")
                if not field.is_required():
                    defaults[name] = field.default
            cls._wire_defaults = defaults  # type: ignore[attr-defined]
        return defaults

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


# Agents send the same tool schemas every turn: each distinct schema is checked once.
_SCHEMA_VERDICTS: OrderedDict[bytes, str | None] = OrderedDict()
_SCHEMA_CACHE_SIZE = 1024


def schema_problem(schema: dict[str, Any]) -> str | None:
    """What makes ``schema`` an invalid JSON schema (None: it is valid)."""
    key = msgspec.json.encode(schema)
    if key in _SCHEMA_VERDICTS:
        _SCHEMA_VERDICTS.move_to_end(key)
        return _SCHEMA_VERDICTS[key]
    try:
        validators.validator_for(schema).check_schema(schema)
        problem = None
    except jsonschema_errors.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "(top level)"
        problem = f"{exc.message} at {where}"
    _SCHEMA_VERDICTS[key] = problem
    if len(_SCHEMA_VERDICTS) > _SCHEMA_CACHE_SIZE:
        _SCHEMA_VERDICTS.popitem(last=False)
    return problem
