"""The ``turnstream`` command."""

from __future__ import annotations

from turnstream.cli.commands import COMMANDS
from turnstream.cli.main import main

__all__ = ["COMMANDS", "main"]
