"""Batch assembly: folded trajectories -> padded (verl) and jagged TensorDict batches."""

from __future__ import annotations

import importlib.metadata
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from packaging.version import Version
from tensordict import TensorDict

from consumers import fold
from schemas.events import TrajectoryReady
from tests.helpers.sessions import TurnSpec, reward, reward_events, session_events, turn_specs
from trainer_sink import (
    AssemblySettings,
    BatchBuffers,
    BatchError,
    assemble,
    assemble_jagged,
    assemble_padded,
    non_tensor_values,
)

JAGGED = AssemblySettings(layout="jagged")
TENSOR_KEYS = (
    "prompts",
    "responses",
    "input_ids",
    "attention_mask",
    "position_ids",
    "response_mask",
    "rollout_log_probs",
    "rollout_temperature",
    "rollout_top_p",
    "rm_scores",
)
NON_TENSOR_KEYS = (
    "uid",
    "group",
    "session",
    "trajectory_id",
    "__num_turns__",
    "agent_id",
    "agent_kind",
    "multi_modal_inputs",
)
# torch's jagged tensors refuse slicing / index tensors on the batch dim; tensordict 0.15 routes
# around it (checked: 0.8.3 to 0.14.0 fail).
JAGGED_BATCH_SLICING = Version(importlib.metadata.version("tensordict")) >= Version("0.15")


def _trajectories(specs: list[TurnSpec], session: str, **events: Any) -> list[TrajectoryReady]:
    return fold(session_events(specs, session=session, group="g1", **events)).trajectories


def known() -> list[TrajectoryReady]:
    """Three samples of group g1: a two-turn session with a tool result (two tokens, 101 102)
    between its turns, then a session that forks at its second turn (two segments)."""
    multi = _trajectories(
        [
            TurnSpec(
                prompt=[1, 2, 3], completion=[11, 12], logprobs=[-0.5, -0.25], weight_version=3
            ),
            TurnSpec(
                prompt=[1, 2, 3, 11, 12, 101, 102],
                completion=[21, 22, 23],
                logprobs=[-1.0, -2.0, -0.125],
                weight_version=4,
            ),
        ],
        "multi",
        rewards=[reward(0.5, turn=0, session="multi")],
        final_reward=1.0,
    )
    forked = _trajectories(
        [
            TurnSpec(prompt=[7, 8], completion=[9], logprobs=[-0.75], weight_version=1),
            TurnSpec(
                prompt=[7, 5, 4, 4], completion=[6, 6], logprobs=[-0.5, -0.5], weight_version=2
            ),
        ],
        "fork",
        final_reward=-1.0,
    )
    samples = [*multi, *forked]
    # What the fold made of them, so the expectations below read against it.
    assert [t.input_ids.tolist() for t in samples] == [
        [1, 2, 3, 11, 12, 101, 102, 21, 22, 23],
        [7, 8, 9],
        [7, 5, 4, 4, 6, 6],
    ]
    assert [t.prompt_len for t in samples] == [3, 2, 4]
    assert [t.turn_ends.tolist() for t in samples] == [[5, 10], [3], [6]]
    assert [t.turn_rewards for t in samples] == [[0.5, None], [None], [None]]
    assert [t.reward for t in samples] == [1.0, -1.0, -1.0]
    return samples


def rows(value: torch.Tensor) -> list[list[Any]]:
    """Each sample's row, padded or jagged."""
    return [row.tolist() for row in value.unbind(0)]


# -- padded ------------------------------------------------------------------------------------


def test_padded_batch_of_known_trajectories() -> None:
    batch = assemble(known())

    assert isinstance(batch, TensorDict)
    assert batch.batch_size == torch.Size([3])
    assert rows(batch["prompts"]) == [[0, 1, 2, 3], [0, 0, 7, 8], [7, 5, 4, 4]]  # left-padded
    assert rows(batch["responses"]) == [  # right-padded; the tool tokens 101 102 included
        [11, 12, 101, 102, 21, 22, 23],
        [9, 0, 0, 0, 0, 0, 0],
        [6, 6, 0, 0, 0, 0, 0],
    ]
    assert torch.equal(batch["input_ids"], torch.cat([batch["prompts"], batch["responses"]], 1))
    assert rows(batch["attention_mask"]) == [
        [0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1],
        [0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0],
    ]
    assert rows(batch["position_ids"]) == [
        [0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9],
        [0, 0, 0, 1, 2, 2, 2, 2, 2, 2, 2],
        [0, 1, 2, 3, 4, 5, 5, 5, 5, 5, 5],
    ]
    assert rows(batch["response_mask"]) == [
        [1, 1, 0, 0, 1, 1, 1],
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
    ]
    assert rows(batch["rollout_log_probs"]) == [
        [-0.5, -0.25, 0.0, 0.0, -1.0, -2.0, -0.125],
        [-0.75, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
        [-0.5, -0.5, 0.0, 0.0, 0.0, 0.0, 0.0],
    ]
    # Turn 0's reward on its last completion token (12); the final reward on the last generated.
    assert rows(batch["rm_scores"]) == [
        [0.0, 0.5, 0.0, 0.0, 0.0, 0.0, 1.0],
        [-1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
        [0.0, -1.0, 0.0, 0.0, 0.0, 0.0, 0.0],
    ]
    assert batch["truncated"].tolist() == [False, False, False]
    assert batch["min_weight_version"].tolist() == [3, 1, 2]
    assert batch["max_weight_version"].tolist() == [4, 1, 2]


def test_padded_dtypes_and_shapes() -> None:
    batch = assemble_padded(known())

    for key in ("prompts", "responses", "input_ids", "attention_mask", "position_ids"):
        assert batch[key].dtype == torch.int64, key
    assert batch["response_mask"].dtype == torch.int64
    assert batch["rollout_log_probs"].dtype == torch.float32
    assert batch["rm_scores"].dtype == torch.float32
    assert batch["truncated"].dtype == torch.bool
    assert batch["min_weight_version"].dtype == batch["max_weight_version"].dtype == torch.int64
    shapes = {key: tuple(batch[key].shape) for key in TENSOR_KEYS}
    assert shapes == {
        "prompts": (3, 4),
        "responses": (3, 7),
        "input_ids": (3, 11),
        "attention_mask": (3, 11),
        "position_ids": (3, 11),
        "response_mask": (3, 7),
        "rollout_log_probs": (3, 7),
        "rollout_temperature": (3, 7),
        "rollout_top_p": (3, 7),
        "rm_scores": (3, 7),
    }
    # Separate storage: a trainer writing into responses must not change input_ids.
    batch["responses"][0, 0] = -5
    assert batch["input_ids"][0, 4] == 11


def test_position_ids_follow_verls_rule() -> None:
    batch = assemble(known(), AssemblySettings(max_prompt_len=6, max_response_len=9))
    mask = batch["attention_mask"]

    assert torch.equal(batch["position_ids"], torch.clip(torch.cumsum(mask, dim=-1) - 1, min=0))


def test_pad_token_and_fixed_lengths_pad_to_the_limits() -> None:
    batch = assemble(
        known(), AssemblySettings(pad_token_id=99, max_prompt_len=6, max_response_len=9)
    )

    assert batch["prompts"].shape == (3, 6) and batch["responses"].shape == (3, 9)
    assert rows(batch["prompts"])[1] == [99, 99, 99, 99, 7, 8]
    assert rows(batch["responses"])[1] == [9, *[99] * 8]
    assert batch["truncated"].tolist() == [False, False, False]


def test_non_tensor_entries() -> None:
    batch = assemble(known())

    # Called directly, a sample's group instance is its group name within its run.
    assert non_tensor_values(batch, "uid") == ["run-1/g1"] * 3
    assert non_tensor_values(batch, "group") == ["g1"] * 3
    assert non_tensor_values(batch, "multi_modal_inputs") == [{}, {}, {}]
    assert batch["stale"].tolist() == [False, False, False]
    assert non_tensor_values(batch, "session") == ["multi", "fork", "fork"]
    # One session instance per session, shared by its segments (GRPO's unit, issue 18).
    assert non_tensor_values(batch, "session_uid") == ["run-1/multi", "run-1/fork", "run-1/fork"]
    assert non_tensor_values(batch, "trajectory_id") == [
        "run-1/multi/0",
        "run-1/fork/0",
        "run-1/fork/1",
    ]
    assert non_tensor_values(batch, "__num_turns__") == [2, 1, 1]
    # Indexing keeps one value per sample, equal values included (tensordict 0.8 collapses
    # them into one NonTensorData; the helper undoes it).
    picked = batch[torch.tensor([2, 0])]
    assert non_tensor_values(picked, "uid") == ["run-1/g1", "run-1/g1"]
    assert non_tensor_values(picked, "multi_modal_inputs") == [{}, {}]
    assert non_tensor_values(picked, "trajectory_id") == ["run-1/fork/1", "run-1/multi/0"]
    assert non_tensor_values(batch[1:], "__num_turns__") == [1, 1]
    assert batch[1].get_non_tensor("session") == "fork"
    with pytest.raises(KeyError, match="input_ids"):
        non_tensor_values(batch, "input_ids")


def test_padded_batch_moves_and_splits() -> None:
    batch = assemble(known()).to("cpu")

    halves = batch.split([2, 1])
    assert [non_tensor_values(half, "trajectory_id") for half in halves] == [
        ["run-1/multi/0", "run-1/fork/0"],
        ["run-1/fork/1"],
    ]
    assert torch.equal(TensorDict.cat(halves)["responses"], batch["responses"])


# -- truncation -------------------------------------------------------------------------------


def test_truncation_keeps_the_prompts_end_and_the_responses_start() -> None:
    batch = assemble(known(), AssemblySettings(max_prompt_len=2, max_response_len=3))

    assert rows(batch["prompts"]) == [[2, 3], [7, 8], [4, 4]]
    assert rows(batch["responses"]) == [[11, 12, 101], [9, 0, 0], [6, 6, 0]]
    assert batch["truncated"].tolist() == [True, False, True]
    assert rows(batch["response_mask"]) == [[1, 1, 0], [1, 0, 0], [1, 1, 0]]
    assert rows(batch["position_ids"]) == [[0, 1, 2, 3, 4], [0, 1, 2, 2, 2], [0, 1, 2, 3, 3]]
    # multi: turn 0's 0.5 survives on token 12; the final 1.0 moves to the last generated token
    # that survives, the same token 12.
    assert rows(batch["rm_scores"]) == [[0.0, 1.5, 0.0], [-1.0, 0.0, 0.0], [0.0, -1.0, 0.0]]


def test_a_turn_reward_cut_off_is_dropped() -> None:
    [multi, *_] = known()
    batch = assemble([multi], AssemblySettings(max_response_len=1))

    # Turn 0 ends at response position 1, which is cut: its 0.5 is gone; the final reward sits
    # on the one generated token kept.
    assert rows(batch["rm_scores"]) == [[1.0]]
    assert batch["truncated"].tolist() == [True]


def test_rewards_around_an_empty_completion() -> None:
    [sample] = _trajectories(
        [
            TurnSpec(prompt=[1], completion=[]),
            TurnSpec(prompt=[1, 5], completion=[6], logprobs=[-0.5]),
        ],
        "empty",
        rewards=[reward(0.25, turn=0, session="empty")],
        final_reward=2.0,
    )
    assert (sample.prompt_len, sample.turn_ends.tolist()) == (1, [1, 3])

    # Turn 0 produced nothing: its end is the prompt's last token, outside the response.
    assert rows(assemble([sample])["rm_scores"]) == [[0.0, 2.0]]
    # No generated token kept: the final reward sits on the last kept response token.
    cut = assemble([sample], AssemblySettings(max_response_len=1))
    assert rows(cut["rm_scores"]) == [[2.0]]
    assert rows(cut["response_mask"]) == [[0]]


def test_truncate_off_names_the_trajectory_and_its_lengths() -> None:
    strict = AssemblySettings(max_prompt_len=3, max_response_len=3, truncate=False)

    with pytest.raises(BatchError) as raised:
        assemble(known(), strict)
    message = str(raised.value)
    assert "run-1/multi/0 (prompt 3, response 7 tokens)" in message
    assert "run-1/fork/1 (prompt 4, response 2 tokens)" in message
    assert "run-1/fork/0" not in message
    assert "max_prompt_len 3" in message and "max_response_len 3" in message
    with pytest.raises(BatchError, match="multi"):
        assemble(known(), strict.model_copy(update={"layout": "jagged"}))
    # Within the limits, truncate=False is no obstacle.
    fits = AssemblySettings(max_prompt_len=4, max_response_len=7, truncate=False)
    assert assemble(known(), fits)["truncated"].tolist() == [False, False, False]


@pytest.mark.parametrize("layout", ["padded", "jagged"])
def test_an_empty_batch_is_an_error(layout: str) -> None:
    with pytest.raises(BatchError, match="empty batch"):
        assemble([], AssemblySettings(layout=layout))


def _fields(t: TrajectoryReady) -> dict[str, Any]:
    return {name: getattr(t, name) for name in t.__struct_fields__}


# -- jagged -----------------------------------------------------------------------------------


def test_jagged_batch_of_known_trajectories() -> None:
    batch = assemble(known(), JAGGED)

    assert batch.batch_size == torch.Size([3])
    for key in TENSOR_KEYS:
        value = batch[key]
        assert value.is_nested and value.layout == torch.jagged, key
    assert rows(batch["prompts"]) == [[1, 2, 3], [7, 8], [7, 5, 4, 4]]
    assert rows(batch["responses"]) == [[11, 12, 101, 102, 21, 22, 23], [9], [6, 6]]
    assert rows(batch["input_ids"]) == [t.input_ids.tolist() for t in known()]
    assert rows(batch["attention_mask"]) == [[1] * 10, [1] * 3, [1] * 6]
    assert rows(batch["position_ids"]) == [list(range(10)), [0, 1, 2], list(range(6))]
    assert rows(batch["response_mask"]) == [[1, 1, 0, 0, 1, 1, 1], [1], [1, 1]]
    assert rows(batch["rollout_log_probs"]) == [
        [-0.5, -0.25, 0.0, 0.0, -1.0, -2.0, -0.125],
        [-0.75],
        [-0.5, -0.5],
    ]
    assert rows(batch["rm_scores"]) == [[0.0, 0.5, 0.0, 0.0, 0.0, 0.0, 1.0], [-1.0], [0.0, -1.0]]
    assert batch["truncated"].tolist() == [False, False, False]
    assert non_tensor_values(batch, "uid") == ["run-1/g1"] * 3
    assert non_tensor_values(batch, "__num_turns__") == [2, 1, 1]
    assert batch["min_weight_version"].tolist() == [3, 1, 2]


def test_jagged_dtypes_and_shared_raggedness() -> None:
    batch = assemble_jagged(known())

    integer = ("prompts", "responses", "input_ids", "attention_mask", "position_ids")
    assert all(batch[key].dtype == torch.int64 for key in (*integer, "response_mask"))
    assert batch["rollout_log_probs"].dtype == batch["rm_scores"].dtype == torch.float32
    # One raggedness per length: elementwise ops need no unpacking.
    masked = batch["response_mask"] * batch["rollout_log_probs"]
    assert rows(masked)[0] == [-0.5, -0.25, 0.0, 0.0, -1.0, -2.0, -0.125]
    assert (batch["attention_mask"] * batch["position_ids"]).shape[0] == 3
    assert batch["responses"].offsets().tolist() == [0, 7, 8, 10]


def test_jagged_batch_indexes_and_moves() -> None:
    batch = assemble(known(), JAGGED)

    assert batch[2]["responses"].tolist() == [6, 6]
    assert batch[2].get_non_tensor("trajectory_id") == "run-1/fork/1"
    moved = batch.to("cpu")
    assert rows(moved["input_ids"]) == rows(batch["input_ids"])
    assert [sample["prompts"].tolist() for sample in batch.unbind(0)] == rows(batch["prompts"])


@pytest.mark.skipif(not JAGGED_BATCH_SLICING, reason="jagged batch slicing needs tensordict>=0.15")
def test_jagged_batch_slices() -> None:
    batch = assemble(known(), JAGGED)

    assert rows(batch[1:]["responses"]) == [[9], [6, 6]]
    picked = batch[torch.tensor([2, 0])]
    assert rows(picked["prompts"]) == [[7, 5, 4, 4], [1, 2, 3]]
    assert non_tensor_values(picked, "session") == ["fork", "multi"]


def test_jagged_truncation_cuts_without_padding() -> None:
    batch = assemble(
        known(), JAGGED.model_copy(update={"max_prompt_len": 2, "max_response_len": 3})
    )

    assert rows(batch["prompts"]) == [[2, 3], [7, 8], [4, 4]]
    assert rows(batch["responses"]) == [[11, 12, 101], [9], [6, 6]]
    assert rows(batch["rm_scores"]) == [[0.0, 1.5, 0.0], [-1.0], [0.0, -1.0]]
    assert batch["truncated"].tolist() == [True, False, True]


# -- properties -------------------------------------------------------------------------------


@st.composite
def batches(draw: st.DrawFn) -> list[TrajectoryReady]:
    """Trajectories of 1-4 random sessions (forks, empty prompts and completions, rewards)."""
    samples: list[TrajectoryReady] = []
    for index in range(draw(st.integers(1, 4))):
        specs = draw(turn_specs(max_turns=4))
        session = f"s{index}"
        rewards = [
            reward(r.value, turn=r.turn, key=r.key, session=session)
            for r in draw(reward_events(len(specs)))
        ]
        final = draw(st.none() | st.floats(-2.0, 2.0, width=32))
        events = session_events(
            specs,
            session=session,
            group=draw(st.sampled_from(["a", "b"])),
            rewards=rewards,
            final_reward=final,
        )
        samples.extend(fold(events).trajectories)
    return samples


limits = st.none() | st.integers(1, 12)


@settings(max_examples=200, deadline=None)
@given(samples=batches(), max_prompt=limits, max_response=limits, pad=st.integers(-1, 7))
def test_unpadding_gives_back_each_sample(
    samples: list[TrajectoryReady], max_prompt: int | None, max_response: int | None, pad: int
) -> None:
    options = AssemblySettings(
        pad_token_id=pad, max_prompt_len=max_prompt, max_response_len=max_response
    )
    padded = assemble(samples, options)
    jagged = assemble(samples, options.model_copy(update={"layout": "jagged"}))
    width_p = padded["prompts"].shape[1]

    for i, t in enumerate(samples):
        p, r = t.prompt_len, t.response_len
        kp, kr = min(p, max_prompt or p), min(r, max_response or r)
        assert padded["truncated"][i].item() == (kp < p or kr < r)
        assert not t.loss_mask[:p].any()  # the prompt holds no generated token
        real = padded["attention_mask"][i].bool()
        assert real.tolist() == [False] * (width_p - kp) + [True] * (kp + kr) + [False] * (
            padded["input_ids"].shape[1] - width_p - kr
        )
        assert padded["input_ids"][i][real].tolist() == t.input_ids[p - kp : p + kr].tolist()
        assert padded["input_ids"][i][~real].eq(pad).all()
        assert padded["response_mask"][i, :kr].tolist() == t.loss_mask[p : p + kr].tolist()
        assert padded["rollout_log_probs"][i, :kr].tolist() == t.logprobs[p : p + kr].tolist()
        assert not padded["response_mask"][i, kr:].any()
        assert not padded["rollout_log_probs"][i, kr:].any()
        assert not padded["rm_scores"][i, kr:].any()
        if kp == p and kr == r:  # nothing cut: the sample comes back whole
            assert padded["input_ids"][i][real].tolist() == t.input_ids.tolist()
            mask = [0] * p + padded["response_mask"][i, :r].tolist()
            assert mask == t.loss_mask.tolist()
            logprobs = [0.0] * p + padded["rollout_log_probs"][i, :r].tolist()
            assert logprobs == t.logprobs.tolist()
            turns = zip(t.turn_ends.tolist(), t.turn_rewards, strict=True)
            landed = [v for end, v in turns if v is not None and end > p]
            final = t.reward if t.reward is not None and r else 0.0
            expected = sum(landed) + final
            assert padded["rm_scores"][i].sum().item() == pytest.approx(expected, abs=1e-4)
        # The jagged sample is the padded one without its padding.
        assert jagged["prompts"][i].tolist() == padded["prompts"][i, width_p - kp :].tolist()
        for key in ("responses", "response_mask", "rollout_log_probs", "rm_scores"):
            assert jagged[key][i].tolist() == padded[key][i, :kr].tolist(), key
        assert jagged["input_ids"][i].tolist() == padded["input_ids"][i][real].tolist()
        assert jagged["position_ids"][i].tolist() == padded["position_ids"][i][real].tolist()
    mask = padded["attention_mask"]
    assert torch.equal(padded["position_ids"], torch.clip(torch.cumsum(mask, -1) - 1, min=0))
    for key in NON_TENSOR_KEYS:
        assert non_tensor_values(jagged, key) == non_tensor_values(padded, key)
    assert non_tensor_values(padded, "trajectory_id") == [t.trajectory_id for t in samples]
    assert non_tensor_values(padded, "uid") == [f"{t.run}/{t.group}" for t in samples]
    assert torch.equal(jagged["truncated"], padded["truncated"])


@pytest.mark.parametrize("layout", ["padded", "jagged"])
def test_the_batchers_uids_and_stale_flags_and_the_verl_entries(layout: str) -> None:
    chosen = AssemblySettings(layout=layout)  # type: ignore[arg-type]
    batch = assemble(known(), chosen, uids=["a", "b", "b"], stale=[True, False, True])
    assert non_tensor_values(batch, "uid") == ["a", "b", "b"]
    assert batch["stale"].tolist() == [True, False, True]
    assert non_tensor_values(batch, "session_uid") == ["run-1/multi", "run-1/fork", "run-1/fork"]
    bare = assemble(known(), chosen.model_copy(update={"multi_modal_inputs": False}))
    assert "multi_modal_inputs" not in bare.keys()  # noqa: SIM118  # tensordict 0.8: no `in`
    with pytest.raises(BatchError, match="2 uids for 3 trajectories"):
        assemble(known(), chosen, uids=["a", "b"])


@pytest.mark.parametrize("layout", ["padded", "jagged"])
def test_samples_with_raw_log_probs_are_flagged(layout: str) -> None:
    """Issue 19: a sample holding a turn recorded with the model's raw log-probs (the fold's
    metadata ``logprobs_kind: "raw"``) is flagged, so a trainer can refuse its ratios."""
    chosen = AssemblySettings(layout=layout)  # type: ignore[arg-type]
    samples = known()
    assert assemble(samples, chosen)["raw_logprobs"].tolist() == [False, False, False]
    raw = _trajectories(
        [TurnSpec(prompt=[1, 2], completion=[3], extra={"logprobs_kind": "raw"})], "raw"
    )
    batch = assemble([samples[0], *raw, samples[1]], chosen)
    assert batch["raw_logprobs"].dtype == torch.bool
    assert batch["raw_logprobs"].tolist() == [False, True, False]
    assert non_tensor_values(batch, "trajectory_id")[1] == "run-1/raw/0"


@pytest.mark.parametrize("layout", ["padded", "jagged"])
def test_each_response_token_carries_its_turns_sampling(layout: str) -> None:
    """Issue 38: the temperature and top-p of the distribution each token's rollout log-prob is
    of, from its turn's (fold v7 metadata): a trainer recomputes the same distribution. A greedy
    turn's are 1 and 1 (raw log-probs); a row that recorded none is NaN; padding 1."""
    hot = {"temperature": 0.7, "top_p": 0.9, "max_tokens": 8}
    greedy = {"temperature": 0.0, "top_p": 0.5}
    [sampled] = _trajectories(
        [
            TurnSpec(prompt=[1, 2, 3], completion=[11, 12], extra={"sampling": hot}),
            TurnSpec(
                prompt=[1, 2, 3, 11, 12, 101, 102], completion=[21, 22], extra={"sampling": greedy}
            ),
        ],
        "sampled",
    )
    [unrecorded] = _trajectories([TurnSpec(prompt=[7, 8], completion=[9])], "old")
    nan = float("nan")
    for limit, temperatures, top_ps in [
        (None, [0.7, 0.7, 1.0, 1.0, 1.0, 1.0], [0.9, 0.9, 1.0, 1.0, 1.0, 1.0]),
        (3, [0.7, 0.7, 1.0], [0.9, 0.9, 1.0]),  # the response cut: its first tokens' turns
    ]:
        settings = AssemblySettings(layout=layout, max_response_len=limit)  # type: ignore[arg-type]
        batch = assemble([sampled, unrecorded], settings)
        temperature, top_p = rows(batch["rollout_temperature"]), rows(batch["rollout_top_p"])
        assert temperature[0] == pytest.approx(temperatures)
        assert top_p[0] == pytest.approx(top_ps)
        assert batch["rollout_temperature"].dtype == batch["rollout_top_p"].dtype == torch.float32
        padding = [1.0] * (len(temperatures) - 1) if layout == "padded" else []
        assert temperature[1] == pytest.approx([nan, *padding], nan_ok=True)
        assert top_p[1] == pytest.approx([nan, *padding], nan_ok=True)


def test_sampling_metadata_that_is_not_one_entry_per_turn_is_a_batch_error() -> None:
    [sample] = _trajectories(
        [TurnSpec(prompt=[1, 2], completion=[3], extra={"sampling": {"temperature": 0.5}})], "s"
    )
    sample.metadata["sampling"] = [*sample.metadata["sampling"], {"temperature": 1.0}]
    with pytest.raises(BatchError, match=r"run-1/s/0: metadata 'sampling' must be one .* \(1\)"):
        assemble([sample])


# -- reused memory (trainer_sink.buffers) -----------------------------------------------------


def _equal(a: TensorDict, b: TensorDict) -> bool:
    """Equal tensors, NaN where NaN (the per-token sampling of rows that recorded none)."""
    return all(
        torch.equal(a[k], b[k])
        or (a[k].is_floating_point() and torch.allclose(a[k], b[k], 0, 0, equal_nan=True))
        for k in TENSOR_KEYS
    )


@settings(max_examples=10, deadline=None)  # 2-5 batches each, and run again on tensordict 0.8
@given(rounds=st.lists(batches(), min_size=2, max_size=4), pad=st.integers(-1, 7))
def test_batches_written_into_reused_memory_equal_fresh_ones(
    rounds: list[list[TrajectoryReady]], pad: int
) -> None:
    """Each batch dropped before the next, so the next is written over its memory (rows,
    widths and padding differ from batch to batch): the same tensors as a fresh assembly."""
    options = AssemblySettings(pad_token_id=pad)
    pool = BatchBuffers()
    for samples in [*rounds, rounds[-1]]:  # the last one twice: then every array is reused
        reused = pool.reused
        assert _equal(assemble(samples, options, buffers=pool), assemble(samples, options))
    assert pool.reused - reused == len(TENSOR_KEYS)


def test_memory_is_reused_only_once_nothing_refers_to_the_batch() -> None:
    pool = BatchBuffers()
    samples = known()
    kept = assemble(samples, buffers=pool)
    expected = assemble(samples)
    view = assemble(samples, buffers=pool)["input_ids"][:, :2]  # the batch gone, a view kept
    made = pool.allocated
    assert made == 2 * len(TENSOR_KEYS) and pool.reused == 0  # two batches, all fresh
    third = assemble(list(reversed(samples)), buffers=pool)
    # the second batch's memory, but for its input_ids (the view holds it): 1 or 2 arrays new
    assert pool.reused >= len(TENSOR_KEYS) - 2
    assert pool.allocated + pool.reused == made + len(TENSOR_KEYS)
    assert _equal(kept, expected)  # written over nothing of a batch still held
    assert torch.equal(view, expected["input_ids"][:, :2])
    assert _equal(third, assemble(list(reversed(samples))))
    assert all(third[k].data_ptr() != kept[k].data_ptr() for k in TENSOR_KEYS)


def test_the_pool_keeps_at_most_its_bound() -> None:
    pool = BatchBuffers(keep=8)
    held = [assemble(known(), buffers=pool) for _ in range(3)]  # in use: never reused
    assert pool.allocated == 3 * len(TENSOR_KEYS) and len(pool._buffers) == 8
    assert all(_equal(b, held[0]) for b in held)
    with pytest.raises(ValueError, match="keep"):
        BatchBuffers(keep=0)


def test_the_sink_setting_turns_reuse_off() -> None:
    assert AssemblySettings().reuse_memory
    assert not AssemblySettings(reuse_memory=False).reuse_memory
