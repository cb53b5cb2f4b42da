"""Which rows of a batch are one session: GRPO's unit is the session, not the row. Pure.

A session (an episode) may become several rows, its *segments* (sub-agents, forks, per-turn
samples), and every row of one session carries the same ``session_uid`` (``<run>/<session>``).
GRPO compares the *sessions* of a group: one reward each, one advantage each, given to every
row of the session. Counting rows instead weighs a 6-segment session six times in its group's
mean and deviation: rewards [1]*6 + [0, 0, 0] have the row baseline 0.67 (advantage 0.67 once
divided by the std), where the sessions [1, 0, 0, 0] have the baseline 0.25 and advantage 1.5.

**A session's reward** is the reward of its *last* row, the one with the highest segment index
(``trajectory_id`` is ``<run>/<session>/<segment>``): the segment holding the episode's last
turn, which carries the final reward whatever the fold's ``final_reward_scope`` ("all": every
segment has it; "last": only that one). Per-turn rewards on the session's *other* segments do
not enter it. When a batch holds only some of a session's rows (count batching split it),
the last of those stands for it. A side request's row (kept by ``keep_side_calls``) stands for
its session only when the session has no other row in the batch: the fold rewards the last
sample that is not a side request.

>>> rows = SessionRows.of(
...     ["r/a", "r/a", "r/b", "r/a"], ["r/a/0", "r/a/2", "r/b/0", "r/a/1"]
... )
>>> rows.session.tolist(), rows.last.tolist(), rows.sizes.tolist()
([0, 0, 1, 0], [1, 2], [3, 1])
>>> rows.broadcast(np.array([1.5, -0.5])).tolist()
[1.5, 1.5, -0.5, 1.5]
>>> [round(w, 3) for w in rows.balanced_weights().tolist()]
[0.333, 0.333, 1.0, 0.333]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import numpy.typing as npt
import torch

__all__ = ["SessionRows", "segment_of"]

Int64Array = npt.NDArray[np.int64]
_Values = TypeVar("_Values", torch.Tensor, npt.NDArray[np.generic])


@dataclass(frozen=True)
class SessionRows:
    """The sessions of a batch's B rows, numbered 0..S-1 in the order they first appear."""

    session: Int64Array
    """[B] each row's session number."""
    last: Int64Array
    """[S] each session's last row (its highest segment): the one that stands for it."""
    sizes: Int64Array
    """[S] rows per session."""
    uids: tuple[str, ...]
    """[S] each session's ``session_uid``."""

    @classmethod
    def of(
        cls,
        session_uids: Sequence[str] | npt.NDArray[np.object_],
        trajectory_ids: Sequence[str],
        side_calls: Sequence[bool] | None = None,
    ) -> SessionRows:
        """The sessions of the rows whose ``session_uid`` and ``trajectory_id`` entries are given
        (a batch's ``non_tensor_values`` or a ``DataProto``'s ``non_tensor_batch`` arrays).
        ``side_calls`` (the batch's ``side_call``, where the batcher kept them): a side
        request's row never stands for its session while the session has another row."""
        if len(session_uids) != len(trajectory_ids) or (
            side_calls is not None and len(side_calls) != len(trajectory_ids)
        ):
            raise ValueError(
                f"{len(session_uids)} session uids for {len(trajectory_ids)} trajectory ids"
                + (f" and {len(side_calls)} side_call flags" if side_calls is not None else "")
                + ": give one of each per row"
            )
        side = (
            [False] * len(trajectory_ids) if side_calls is None else [bool(x) for x in side_calls]
        )
        number: dict[str, int] = {}
        session = np.empty(len(session_uids), dtype=np.int64)
        last: list[int] = []
        last_key: list[tuple[bool, int]] = []  # (not a side call, segment): the highest stands
        for row, (uid, trajectory_id) in enumerate(zip(session_uids, trajectory_ids, strict=True)):
            key = (not side[row], segment_of(str(trajectory_id)))
            found = number.setdefault(str(uid), len(number))
            session[row] = found
            if found == len(last):
                last.append(row)
                last_key.append(key)
            elif key > last_key[found]:
                last[found], last_key[found] = row, key
        return cls(
            session=session,
            last=np.asarray(last, dtype=np.int64),
            sizes=np.bincount(session, minlength=len(number)).astype(np.int64),
            uids=tuple(number),
        )

    def broadcast(self, values: _Values) -> _Values:
        """[S] one value per session -> [B] each row its session's (numpy or torch)."""
        if len(values) != len(self.last):
            raise ValueError(f"{len(values)} values for {len(self.last)} sessions: give one each")
        if isinstance(values, torch.Tensor):
            return values[torch.from_numpy(self.session).to(values.device)]
        return values[self.session]

    def balanced_weights(self) -> npt.NDArray[np.float32]:
        """[B] 1 / (rows of the row's session): a session's rows weigh 1 together."""
        return (1.0 / self.sizes[self.session]).astype(np.float32)


def segment_of(trajectory_id: str) -> int:
    """The segment index that ends a trajectory id ``<run>/<session>/<segment>``."""
    _, _, tail = trajectory_id.rpartition("/")
    if not tail.isdigit():
        raise ValueError(
            f"trajectory id {trajectory_id!r} does not end with a segment index "
            f"(<run>/<session>/<segment>): pass the batch's own trajectory_id entries"
        )
    return int(tail)
