"""The progress bar every long data command shows on stderr (rich): what it does, a bar,
done / total, time elapsed."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

__all__ = ["progress_bar"]


def progress_bar(what: str, console: Console, *, enabled: bool = True) -> Progress:
    """A bar labelled ``what``; use as a context manager, ``add_task`` then ``update``."""
    return Progress(
        TextColumn(what),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=not enabled,
    )
