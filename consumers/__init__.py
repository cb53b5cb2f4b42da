"""Consumers of the event log: the pure fold, the fold worker, the reaper, the shard writer."""

from __future__ import annotations

from consumers.config import FoldWorkerSettings, ReaperSettings, ShardWriterSettings
from consumers.errors import (
    ConsumerError,
    ExportError,
    FoldError,
    MissingTurns,
    RecordingDamaged,
)
from consumers.fold import FOLD_VERSION, FoldOptions, FoldResult, apply, finish, fold, initial
from consumers.reaper import Reaper, ReaperStats, SessionActivity
from consumers.worker import FoldMarker, FoldWorker, WorkerStats

__all__ = [
    "FOLD_VERSION",
    "ConsumerError",
    "ExportError",
    "FoldError",
    "FoldMarker",
    "FoldOptions",
    "FoldResult",
    "FoldWorker",
    "FoldWorkerSettings",
    "MissingTurns",
    "Reaper",
    "ReaperSettings",
    "ReaperStats",
    "RecordingDamaged",
    "SessionActivity",
    "ShardWriterSettings",
    "WorkerStats",
    "apply",
    "finish",
    "fold",
    "initial",
]
