"""Reading the JSON a remote server sent, trusting nothing: every field is checked for its type,
and a payload of the wrong shape is a ``BackendError`` that names the server, not a KeyError."""

from __future__ import annotations

from typing import Any

from gateway.errors import BackendError

__all__ = ["as_float", "as_int", "as_int_list", "as_list", "member"]


def member(obj: Any, key: str, where: str) -> Any:
    if not isinstance(obj, dict):
        raise BackendError(f"{where}: expected an object holding {key!r}, got {obj!r:.200}")
    return obj.get(key)


def as_list(value: Any, what: str, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise BackendError(f"{where}: {what} should be a list, got {value!r:.200}")
    return value


def as_int(value: Any, what: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BackendError(f"{where}: {what} should be an integer, got {value!r:.200}")
    return value


def as_float(value: Any, what: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BackendError(f"{where}: {what} should be a number, got {value!r:.200}")
    return float(value)


def as_int_list(value: Any, what: str, where: str) -> list[int]:
    return [as_int(item, what, where) for item in as_list(value, what, where)]
