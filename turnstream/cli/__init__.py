"""The ``turnstream`` command."""

from __future__ import annotations

from turnstream.cli.main import COMMANDS, main

__all__ = ["COMMANDS", "main"]
