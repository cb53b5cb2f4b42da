"""OpenAI Responses tools (part of ``gateway.protocol.responses``): function tools are offered to
the model, a namespace's function tools are offered flattened, every other tool is recorded
and not offered.

A ``namespace`` tool groups function tools the model calls as a ``function_call`` item with
``"namespace": NS, "name": name``: Codex's multi-agent tools (``multi_agent_v1``:
``spawn_agent``, ``wait_agent``, ``send_input``, ``resume_agent``, ``close_agent``; v2's
``collaboration``: ``spawn_agent``, ``wait_agent``, ``send_message``, ``followup_task``,
``interrupt_agent``, ``list_agents``). Chat templates and tool-call formats know flat function
names only, so each of its functions is offered as the function ``NS__name`` (``flat_name``),
with its own description and parameters; a call of it comes back as a ``function_call`` item
with the namespace and the bare name again (``responses_service``), and that item sent back as
input is flattened again (``responses_input``), so the conversation a next turn continues is
the one this turn recorded.

Namespace names and the names inside them are function names by the OpenAI API's own rule
(letters, digits, ``_`` and ``-``, 64 at most): the flattened name is then a function name too,
one any template renders and any tool-call parser reads back as the model wrote it. A
flattened name equal to another function's (a plain tool ``multi_agent_v1__spawn_agent``, a
namespace sent twice) would make a call ambiguous: the request is refused, naming both.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    WithJsonSchema,
)

from gateway.protocol.chat import FunctionDefinition
from gateway.protocol.wire import free_form_extras

__all__ = [
    "MAX_FUNCTIONS",
    "NAMESPACE_SEPARATOR",
    "FunctionChoice",
    "FunctionTool",
    "HostedTool",
    "NamespaceName",
    "NamespaceTool",
    "NamespacedFunction",
    "flat_name",
    "function_name_problem",
]

NAMESPACE_SEPARATOR = "__"
MAX_FUNCTIONS = 1024  # function tools offered, namespaces' included (the tools list's bound)
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_NAME_SCHEMA = {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}


def flat_name(namespace: str, name: str) -> str:
    """The function a namespace's function is offered to the model as.

    >>> flat_name("multi_agent_v1", "spawn_agent")
    'multi_agent_v1__spawn_agent'
    """
    return f"{namespace}{NAMESPACE_SEPARATOR}{name}"


def function_name_problem(name: str) -> str | None:
    """Why ``name`` cannot be part of a flattened function name (None: it can).

    >>> function_name_problem("spawn_agent") is None, function_name_problem("spawn agent")
    (True, 'has characters a function name cannot hold')
    """
    if _FUNCTION_NAME.fullmatch(name):
        return None
    if not name or len(name) > 64:
        return "is not 1 to 64 characters long"
    return "has characters a function name cannot hold"


def _part_name(what: str) -> Callable[[str], str]:
    """The check of a part of a flattened name, whose message says what to send (the schema
    states the pattern it checks)."""

    def check(name: str) -> str:
        problem = function_name_problem(name)
        if problem is not None:
            raise ValueError(
                f"{what} {name[:80]!r} {problem}: the model calls it as the function "
                f"<namespace>{NAMESPACE_SEPARATOR}<name>, so both must be letters, digits, _ "
                "or -, 64 at most"
            )
        return name

    return check


NamespaceName = Annotated[
    str, AfterValidator(_part_name("namespace name")), WithJsonSchema(_NAME_SCHEMA)
]
_FunctionName = Annotated[
    str, AfterValidator(_part_name("function name in a namespace")), WithJsonSchema(_NAME_SCHEMA)
]


class FunctionTool(FunctionDefinition):
    """A function tool, flat as this API sends it; offered to the model as the chat shape
    ``{"type": "function", "function": {name, description, parameters}}`` (``strict`` is the
    client's wish for constrained decoding, which the gateway does not do)."""

    type: Literal["function"]
    strict: bool | None = None


class NamespacedFunction(FunctionTool):
    """A function tool inside a namespace (its name restricted: see the module docstring)."""

    name: _FunctionName


def _function_only(value: Any) -> Any:
    """Names a namespace's non-function tool before the model's generic error would."""
    if isinstance(value, dict) and value.get("type") != "function":
        kind = str(value.get("type"))[:64]
        raise ValueError(
            f"tool type {kind!r} inside a namespace is not supported: only function tools "
            "are offered to the model from a namespace; send it as a function tool, or "
            "outside the namespace (recorded, not offered)"
        )
    return value


class NamespaceTool(BaseModel):
    """A namespace of function tools, each offered as the function ``<name>__<its name>``."""

    model_config = ConfigDict(extra="allow", json_schema_extra=free_form_extras)

    type: Literal["namespace"]
    name: NamespaceName
    description: str | None = Field(None, description="recorded; the model reads the functions'")
    tools: list[Annotated[NamespacedFunction, BeforeValidator(_function_only)]] = Field(
        min_length=1, max_length=MAX_FUNCTIONS, description="function tools only"
    )

    def flattened(self) -> list[FunctionTool]:
        """Its functions as the model is offered them, under their flattened names."""
        return [f.model_copy(update={"name": flat_name(self.name, f.name)}) for f in self.tools]


class HostedTool(BaseModel):
    """Any other tool (``web_search``, ``custom``, ...): recorded, not offered."""

    model_config = ConfigDict(extra="allow", json_schema_extra=free_form_extras)

    type: str = Field(
        min_length=1, max_length=64, json_schema_extra={"not": {"enum": ["function", "namespace"]}}
    )


class FunctionChoice(BaseModel):
    """A named function the model must call: a function tool's name, or a namespace's function
    as its ``function_call`` item names it (``namespace`` and ``name``) or flattened. Other
    fields are ignored, and documented as JSON values (the schema's bounded integers: the guard
    refuses one outside 64 bits anywhere in a body; schemathesis sent one here)."""

    model_config = ConfigDict(json_schema_extra=free_form_extras)

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=256)
    namespace: NamespaceName | None = None

    @property
    def function(self) -> str:
        """The function offered to the model that this choice names."""
        return self.name if self.namespace is None else flat_name(self.namespace, self.name)
