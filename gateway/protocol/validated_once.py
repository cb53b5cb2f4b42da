"""A value a client resends in every request, validated once per session: a coding agent's
tools (Claude Code: 24 tools, ~63 KB of JSON schemas) were validated into models, and each
schema's check looked up again, on every turn: ~0.1 ms of a later turn's CPU per API (issue
40, point 2).

The gateway keeps a session's last large body and decodes the members before its conversation
(the tools, the system prompt) once (``gateway.http.kept_bodies``): each turn's body holds the
same list object for its tools. A request model's field validated with ``validated_once``
answers a list it validated before, by identity, from the memo that body's kept members
carry (handed to pydantic as the validation context's ``KEPT_MEMO``); other values, and any
value without a memo, are validated as before. The memo lives as long as the kept members it
serves, so a list's identity cannot be reused while it is memoized, and nothing changes the
decoded values it holds.

>>> from pydantic import BaseModel
>>> class Req(BaseModel):
...     tools: list[dict[str, int]]
...     _tools_once = validated_once_field("tools")
>>> tools, memo = [{"a": 1}], new_memo()
>>> one = Req.model_validate({"tools": tools}, context={KEPT_MEMO: memo})
>>> two = Req.model_validate({"tools": tools}, context={KEPT_MEMO: memo})
>>> one.tools is two.tools, one.tools is Req.model_validate({"tools": tools}).tools
(True, False)
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationInfo, ValidatorFunctionWrapHandler, field_validator

__all__ = ["KEPT_MEMO", "Memo", "new_memo", "validated_once", "validated_once_field"]

KEPT_MEMO = "turnstream.kept_memo"

# id(value) -> (value, its validated value). A few at most: a body's kept members hold one
# tools list; a list sent after the conversation is a new object each turn, and must not pile up.
Memo = dict[int, tuple[Any, Any]]
MEMO_ENTRIES = 4


def new_memo() -> Memo:
    return {}


def validated_once(value: Any, handler: ValidatorFunctionWrapHandler, info: ValidationInfo) -> Any:
    """``handler(value)``, answered from the context's memo where ``value`` is a list it
    validated before."""
    context = info.context
    memo: Memo | None = context.get(KEPT_MEMO) if isinstance(context, dict) else None
    if memo is None or type(value) is not list:
        return handler(value)
    entry = memo.get(id(value))
    if entry is not None and entry[0] is value:
        return entry[1]
    validated = handler(value)  # raises where invalid: nothing is memoized
    memo[id(value)] = (value, validated)
    while len(memo) > MEMO_ENTRIES:
        del memo[next(iter(memo))]
    return validated


def validated_once_field(field: str) -> Any:
    """A request model's validator of ``field`` (a class attribute): ``validated_once``."""

    def once(
        cls: type, value: Any, handler: ValidatorFunctionWrapHandler, info: ValidationInfo
    ) -> Any:
        return validated_once(value, handler, info)

    return field_validator(field, mode="wrap")(classmethod(once))
