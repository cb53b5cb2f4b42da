"""Errors of the trainer sink.

    TurnstreamError                  (schemas.errors)
    └── SinkError                    anything the trainer sink raises on purpose
        ├── BatchError               trajectories that cannot become a batch (a sample longer than
        │                            a fixed length with truncation off, an empty batch)
        ├── BatchCommitted           a batch committed (or released) twice
        └── PolicyError              a run's published policy the reference trainer cannot
                                     resume from (unreadable entry, checkpoint not here)

Messages name the trajectory ids involved and what to change (a setting, a length).
"""

from __future__ import annotations

from schemas.errors import TurnstreamError

__all__ = ["BatchCommitted", "BatchError", "PolicyError", "SinkError"]


class SinkError(TurnstreamError):
    """Root of the errors the trainer sink raises on purpose."""


class BatchError(SinkError):
    """Trajectories that cannot be assembled into a batch as configured."""


class BatchCommitted(SinkError):
    """A batch that was already committed or released."""


class PolicyError(SinkError):
    """A run's published policy that the reference trainer cannot resume from."""
