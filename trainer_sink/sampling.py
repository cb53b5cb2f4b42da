"""Each response token's sampling, from its turn's (PURE): what the batch's
``rollout_temperature`` and ``rollout_top_p`` hold (issue 38).

The fold (version 7) records each turn's sampling in the trajectory's metadata, one entry per
turn in the order of ``turn_ends``; a response token takes the entry of the turn it belongs to
(a tool result between two turns takes the later turn's: it is masked out of the loss anyway).
The values are those of the distribution ``rollout_log_probs`` are of: a greedy turn's
(temperature below 1e-5, ``schemas.sampling``) are 1 and 1, its log-probs being the raw ones.
A row folded before version 7 (or from events that recorded no sampling) says nothing: NaN, for
the trainer to fill with its own setting.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from schemas.events import TrajectoryReady
from schemas.sampling import TurnSampling
from trainer_sink.errors import BatchError

__all__ = ["PADDING", "write_token_sampling"]

PADDING = 1.0
"""The value on padding: neutral, so that a computation over the whole padded row stays finite."""

_NOT_RECORDED = float("nan")


def write_token_sampling(
    trajectory: TrajectoryReady,
    prompt_len: int,
    kept: int,
    temperature: npt.NDArray[np.float32],
    top_p: npt.NDArray[np.float32],
) -> None:
    """Write the temperature and top-p of the ``kept`` response tokens (those at
    ``prompt_len``, ``prompt_len + 1``, ...) into ``temperature`` and ``top_p`` (1-D, ``kept``
    long). BatchError when the metadata's ``sampling`` is not one entry per turn."""
    entries = trajectory.metadata.get("sampling")
    if entries is None:
        temperature.fill(_NOT_RECORDED)
        top_p.fill(_NOT_RECORDED)
        return
    turns = len(trajectory.turn_ends)
    if (
        not isinstance(entries, list)
        or len(entries) != turns
        or not all(isinstance(e, dict) for e in entries)
    ):
        raise BatchError(
            f"trajectory {trajectory.trajectory_id}: metadata 'sampling' must be one "
            f"{{temperature, top_p, top_k, min_p}} object per turn ({turns}), not {entries!r:.200}"
        )
    first = entries[0]
    if all(entry == first for entry in entries):  # the usual case: one setting for the session
        temperature[:], top_p[:] = TurnSampling.of(first).distribution
        return
    settings = np.array([TurnSampling.of(entry).distribution for entry in entries], np.float32)
    # The response position where each turn ends; the tokens before a turn's end are its own.
    ends = np.clip(trajectory.turn_ends - prompt_len, 0, kept)
    counts = np.diff(ends, prepend=0)
    per_token = np.repeat(settings, counts, axis=0)
    written = len(per_token)
    temperature[:written], top_p[:written] = per_token[:, 0], per_token[:, 1]
    temperature[written:], top_p[written:] = settings[-1]  # past the last end: none in a fold's
