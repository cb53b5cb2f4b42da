"""Tool calls in model text: one parser per model family's format, chosen by name."""

from __future__ import annotations

from gateway.tools.base import ParsedOutput, ParsedToolCall, ToolCallParser
from gateway.tools.hermes import HermesParser
from gateway.tools.llama3_json import Llama3JsonParser
from gateway.tools.mistral import MistralParser
from gateway.tools.registry import get_parser, parser_names
from gateway.tools.streaming import ContentStream

__all__ = [
    "ContentStream",
    "HermesParser",
    "Llama3JsonParser",
    "MistralParser",
    "ParsedOutput",
    "ParsedToolCall",
    "ToolCallParser",
    "get_parser",
    "parser_names",
]
