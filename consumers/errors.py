"""Errors of the consumers package.

    TurnstreamError                  (schemas.errors)
    └── ConsumerError                anything the consumers raise on purpose
        └── FoldError                a session's events contradict each other: folding them again
            │                        gives the same error, so dead-letter the session
        │   └── MissingTurns         turns 0..n-1 are not all there: they may still be in flight,
        │                            so retry later before dead-lettering
        ├── RecordingDamaged         a recording whose rows do not match its footer (or no
        │                            recording at all): ``turnstream replay`` refuses it
        ├── ExportError              an export that cannot be done as asked: bad predicate, no
        │                            rows, output in the way
        └── AtifRefused              an ATIF trajectory ``turnstream import-atif`` cannot make
                                     events of (no token ids, not ATIF)

Every message names the run, the session and, where there is one, the turn. (Shard target
errors are the event-log runtime's: ``eventlog.errors``.)
"""

from __future__ import annotations

from collections.abc import Sequence

from schemas.errors import TurnstreamError

__all__ = [
    "AtifRefused",
    "ConsumerError",
    "ExportError",
    "FoldError",
    "MissingTurns",
    "RecordingDamaged",
]


class ConsumerError(TurnstreamError):
    """Root of the errors the consumers package raises on purpose."""


class FoldError(ConsumerError):
    """A session whose events cannot be folded into trajectories."""

    reason = "fold_error"
    permanent = True


class MissingTurns(FoldError):
    """Some of a session's turns 0..n-1 are absent, so its prompts cannot be rebuilt."""

    reason = "missing_turns"
    permanent = False

    def __init__(
        self,
        run: str,
        session: str,
        missing: Sequence[int],
        expected: int,
        why: str,
        count: int | None = None,
    ) -> None:
        self.run = run
        self.session = session
        self.missing = tuple(missing)  # the first missing indices, in order
        self.expected = expected
        self.count = len(self.missing) if count is None else count
        shown = ", ".join(map(str, self.missing[:20]))
        if self.count > 20:
            shown += f", … ({self.count} in all)"
        super().__init__(
            f"run={run} session={session}: missing turn(s) {shown} of 0..{expected - 1} "
            f"({why}); their events may still be in flight: retry the fold later, and "
            f"dead-letter the session if they never arrive"
        )


class RecordingDamaged(ConsumerError):
    """A recording whose rows do not match its footer (or that is no recording at all)."""


class ExportError(ConsumerError):
    """An export that cannot be done as asked: bad predicate, no rows, output in the way."""


class AtifRefused(ConsumerError):
    """An ATIF trajectory that cannot become a session's events (no token ids, not ATIF)."""
