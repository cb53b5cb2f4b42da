"""The fold carries each sample's images (fold v8): where their placeholder tokens sit in the
sample's ids, rebuilt from the events' own images and their parents' (``prompt_images``)."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from consumers import FoldOptions, fold
from schemas.codec import Codec
from schemas.events import CompactTrajectory, SessionClosed, TrajectoryReady, TurnCompleted
from schemas.images import ImageRef

PAD = 9
A, B, C = (ImageRef(d * 64, 0, 1, 28, 28, "image/png", (1, 2, 2)) for d in "abc")


def at(ref: ImageRef, offset: int, length: int) -> ImageRef:
    return msgspec.structs.replace(ref, offset=offset, length=length)


def turn(index: int, **fields: object) -> TurnCompleted:
    return TurnCompleted(run="r", session="s", turn=index, created_at=float(index), **fields)  # type: ignore[arg-type]


# Turn 0 shows image A; turn 1 continues it with image B; turn 2 goes back to turn 0's prompt
# (before its reply: a retry with another image, C). The prefix it shares holds A, not B.
T0 = turn(
    0, prompt_ids=[1, PAD, PAD, PAD, 2], completion_ids=[5], logprobs=[-0.5], images=[at(A, 1, 3)]
)
T1 = turn(
    1,
    prefix_len=6,
    prompt_ids=[7, PAD, PAD, 3],
    completion_ids=[6],
    logprobs=[-0.25],
    images=[at(B, 7, 2)],
)
T2 = turn(
    2,
    parent_turn=0,
    prefix_len=5,
    prompt_ids=[8, PAD, PAD, 4],
    completion_ids=[6],
    logprobs=[-1.0],
    images=[at(C, 6, 2)],
)
CLOSE = SessionClosed(run="r", session="s", created_at=9.0, num_turns=3)
EVENTS = [T0, T1, T2, CLOSE]


def images(trajectories: list[TrajectoryReady]) -> list[list[ImageRef]]:
    return [t.images for t in trajectories]


def test_a_sample_carries_its_last_turns_full_prompt_images_in_its_own_ids() -> None:
    result = fold(EVENTS)
    assert images(result.trajectories) == [[at(A, 1, 3), at(B, 7, 2)], [at(A, 1, 3), at(C, 6, 2)]]
    for t in result.trajectories:
        for ref in t.images:
            assert t.input_ids[ref.offset : ref.end].tolist() == [PAD] * ref.length
            assert not t.loss_mask[ref.offset : ref.end].any()  # an image is never generated
        assert t.fold_version == 8


def test_per_turn_samples_carry_each_turns_images() -> None:
    result = fold(EVENTS, FoldOptions(per_turn=True))
    assert images(result.trajectories) == [
        [at(A, 1, 3)],
        [at(A, 1, 3), at(B, 7, 2)],
        [at(A, 1, 3), at(C, 6, 2)],
    ]


def test_text_only_sessions_have_no_images() -> None:
    plain = [
        msgspec.structs.replace(e, images=[]) if isinstance(e, TurnCompleted) else e for e in EVENTS
    ]
    assert images(fold(plain).trajectories) == [[], []]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(range(len(EVENTS))), min_size=0, max_size=6), st.randoms())
def test_any_duplication_or_reordering_folds_to_the_same_images(extra: list[int], rnd) -> None:  # type: ignore[no-untyped-def]
    events = EVENTS + [EVENTS[i] for i in extra]
    rnd.shuffle(events)
    assert images(fold(events).trajectories) == images(fold(EVENTS).trajectories)


def test_the_wire_form_carries_the_images() -> None:
    codec = Codec()
    [first, _] = fold(EVENTS).compact_trajectories
    back = codec.decode(codec.encode(first))  # decoded as the sample, per token
    assert isinstance(back, TrajectoryReady) and back.images == first.images
    assert isinstance(back.compact(), CompactTrajectory)
    assert back.compact().images == first.images


def test_a_sample_whose_image_lies_outside_its_ids_is_refused() -> None:
    [first, _] = fold(EVENTS).trajectories
    with pytest.raises(ValueError, match=r"outside the ids 0\.\.11"):
        msgspec.structs.replace(first, images=[at(A, 9, 3)])
    with pytest.raises(ValueError, match="overlaps"):
        msgspec.structs.replace(first, images=[at(A, 1, 3), at(B, 2, 2)])
