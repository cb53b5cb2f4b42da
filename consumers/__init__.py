"""Consumers of the event log: the pure fold, and the workers built around it."""

from __future__ import annotations

from consumers.errors import ConsumerError, FoldError, MissingTurns
from consumers.fold import FOLD_VERSION, FoldOptions, FoldResult, apply, finish, fold, initial

__all__ = [
    "FOLD_VERSION",
    "ConsumerError",
    "FoldError",
    "FoldOptions",
    "FoldResult",
    "MissingTurns",
    "apply",
    "finish",
    "fold",
    "initial",
]
