"""Tool-call parsers by name, as chosen in the gateway's settings (one format per model)."""

from __future__ import annotations

from collections.abc import Callable

from gateway.errors import InvalidRequest
from gateway.tools.base import ToolCallParser
from gateway.tools.hermes import HermesParser
from gateway.tools.llama3_json import Llama3JsonParser
from gateway.tools.mistral import MistralParser

__all__ = ["get_parser", "parser_names"]

# Names as vLLM's --tool-call-parser spells them, so a deployment can reuse its setting.
_PARSERS: dict[str, Callable[[], ToolCallParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
}


def parser_names() -> tuple[str, ...]:
    return tuple(sorted(_PARSERS))


def get_parser(name: str) -> ToolCallParser:
    """
    >>> get_parser("hermes").name
    'hermes'
    """
    try:
        factory = _PARSERS[name]
    except KeyError:
        known = ", ".join(parser_names())
        raise InvalidRequest(
            f"unknown tool-call parser {name!r}; known parsers: {known}", param="tool_parser"
        ) from None
    return factory()
