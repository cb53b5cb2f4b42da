"""Which rows of a batch are one session (trainer_sink.sessions), on batches the assembly made."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from tests.helpers.grpo_sessions import WON_SEGMENTS, segmented_group
from trainer_sink import AssemblySettings, SessionRows, assemble, non_tensor_values, segment_of


@pytest.mark.parametrize("layout", ["padded", "jagged"])
def test_the_segments_of_a_session_are_one_session_stood_for_by_its_last(layout: str) -> None:
    trajectories = segmented_group("last")
    batch = assemble(trajectories, AssemblySettings(layout=layout))  # type: ignore[arg-type]
    uids = non_tensor_values(batch, "session_uid")
    assert uids == [f"grpo/{t.session}" for t in trajectories]
    rows = SessionRows.of(uids, non_tensor_values(batch, "trajectory_id"))
    assert rows.uids == ("grpo/won", "grpo/lost-0", "grpo/lost-1", "grpo/lost-2")
    assert rows.sizes.tolist() == [WON_SEGMENTS, 1, 1, 1]
    assert rows.session.tolist() == [0] * WON_SEGMENTS + [1, 2, 3]
    # The last segment stands for "won": with final_reward_scope "last" it alone has the reward.
    assert rows.last.tolist() == [WON_SEGMENTS - 1, 6, 7, 8]
    assert [trajectories[i].reward for i in rows.last] == [1.0, 0.0, 0.0, 0.0]
    values = torch.tensor([1.5, -0.5, -0.5, -0.5])
    assert rows.broadcast(values).tolist() == [1.5] * WON_SEGMENTS + [-0.5] * 3
    assert rows.broadcast(values.numpy()).tolist() == [1.5] * WON_SEGMENTS + [-0.5] * 3
    assert float(rows.balanced_weights()[rows.session == 0].sum()) == pytest.approx(1.0)


def test_one_session_name_in_two_runs_is_two_sessions() -> None:
    first = segmented_group()[-1]
    other_run = msgspec.structs.replace(first, run="grpo-2", trajectory_id="grpo-2/lost-2/0")
    batch = assemble([first, other_run])
    uids = non_tensor_values(batch, "session_uid")
    assert uids == ["grpo/lost-2", "grpo-2/lost-2"]
    assert SessionRows.of(uids, ["grpo/lost-2/0", "grpo-2/lost-2/0"]).sizes.tolist() == [1, 1]


def test_what_is_refused_names_what_to_give() -> None:
    with pytest.raises(ValueError, match="2 session uids for 1 trajectory ids"):
        SessionRows.of(["r/a", "r/a"], ["r/a/0"])
    with pytest.raises(ValueError, match="'r/a' does not end with a segment index"):
        SessionRows.of(["r/a"], ["r/a"])
    rows = SessionRows.of(np.array(["r/a", "r/b"], dtype=object), ["r/a/0", "r/b/0"])
    with pytest.raises(ValueError, match="3 values for 2 sessions"):
        rows.broadcast(np.zeros(3))
    assert segment_of("run/with/slashes/s/12") == 12
