"""Regenerating recorded turns (issue 19, point 2) on the real tiny model in this process: the
turns are sampled by the local backend with their seeds, recorded as the gateway records them
(prompt deltas against parents, a branch, the sampling), and sent again by ``regenerate``."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from gateway.backends.interface import Prompt, SamplingParams
from gateway.backends.local import LocalBackend
from gateway.serving.engine import derived_seed
from schemas.delta import replay_context
from schemas.events import SessionOpened, TurnCompleted
from schemas.images import ImageRef
from turnstream.data.regenerate import (
    compare,
    full_prompt_images,
    full_prompts,
    regenerate,
    regeneration_params,
    session_turns,
)

END = 258  # the tiny model's <|im_end|>
SYSTEM = [257, *b"system\nYou are terse.", END, 10]


def user(text: str) -> list[int]:
    return [257, *f"user\n{text}".encode(), END, 10, 257, *b"assistant\n"]


@pytest.fixture
async def backend(tiny_model_dir: Path) -> AsyncIterator[LocalBackend]:
    backend = LocalBackend.load(tiny_model_dir)
    yield backend
    await backend.close()


async def sampled(
    backend: LocalBackend, prompt: Sequence[int], sampling: dict[str, Any]
) -> tuple[list[int], list[float]]:
    params = SamplingParams(
        max_tokens=sampling["max_tokens"],
        temperature=sampling["temperature"],
        top_p=sampling["top_p"],
        seed=sampling.get("seed"),
        stop_token_ids=sampling["stop_token_ids"],
    )
    ids: list[int] = []
    logprobs: list[float] = []
    async for chunk in backend.generate(Prompt(list(prompt)), params):
        ids += chunk.token_ids
        logprobs += chunk.logprobs
    return ids, logprobs


def sampling_of(turn: int, **extra: Any) -> dict[str, Any]:
    return {
        "max_tokens": 12,
        "temperature": 1.0,
        "top_p": 1.0,
        "stop_token_ids": [END],
        "seed": derived_seed("r", "s", turn),
        "seed_derived": True,
        **extra,
    }


async def recorded_session(backend: LocalBackend) -> list[TurnCompleted]:
    """Turn 0, turn 1 continuing it, turn 2 a branch of turn 0 (a retried second question),
    turn 3 at temperature 0.7 and top_p 0.9 continuing turn 1: sampled here, recorded as the
    gateway records them."""
    turns: list[TurnCompleted] = []
    asks = [
        (-1, SYSTEM + user("Hi"), sampling_of(0)),
        (0, user("And then?"), sampling_of(1)),
        (0, user("Or else?"), sampling_of(2)),
        (1, user("Why?"), sampling_of(3, temperature=0.7, top_p=0.9)),
    ]
    for index, (parent, new_ids, sampling) in enumerate(asks):
        context = replay_context(turns[: parent + 1])[0] if parent >= 0 else np.empty(0, int)
        prompt = [*context.tolist(), *new_ids]
        ids, logprobs = await sampled(backend, prompt, sampling)
        turns.append(
            TurnCompleted(
                run="r",
                session="s",
                turn=index,
                parent_turn=parent,
                prefix_len=len(context),
                prompt_ids=new_ids,
                completion_ids=ids,
                logprobs=logprobs,
                sampling=sampling,
            )
        )
    return turns


def with_sampling(turn: TurnCompleted, **changes: Any) -> TurnCompleted:
    sampling = {k: v for k, v in {**turn.sampling, **changes}.items() if v is not None}
    return msgspec.structs.replace(turn, sampling=sampling)


async def test_a_recorded_session_regenerates_token_for_token(backend: LocalBackend) -> None:
    turns = await recorded_session(backend)
    opened = SessionOpened(run="r", session="s")
    seen: list[int] = []
    report = await regenerate(
        [opened, *turns, turns[1]], backend, progress=lambda v: seen.append(v.turn)
    )
    assert [t.status for t in report.turns] == ["same"] * 4, [t.line() for t in report.turns]
    assert report.ok and seen == [0, 1, 2, 3]
    assert [t.recorded_tokens for t in report.turns] == [len(t.completion_ids) for t in turns]
    assert all(t.max_logprob_delta <= 1e-5 for t in report.turns)
    assert report.summary() == (
        "4 turns of 1 sessions: 4 same, 0 differ, 0 failed, 0 not reproducible"
    )


async def test_another_seed_or_a_changed_token_differs(backend: LocalBackend) -> None:
    turns = await recorded_session(backend)
    other_seed = with_sampling(turns[0], seed=derived_seed("r", "s", 99))
    changed = turns[2].completion_ids.copy()
    changed[1] = (changed[1] + 1) % 256
    tampered = msgspec.structs.replace(turns[2], completion_ids=changed)
    report = await regenerate([other_seed, turns[1], tampered], backend)
    first, second, third = report.turns
    assert first.status == "differs" and first.first_difference is not None
    assert second.status == "same"  # its recorded prompt holds turn 0's recorded tokens
    assert third.status == "differs" and third.first_difference == 1
    assert f"token 1 of {len(changed)}: recorded {changed[1]}" in third.reason
    assert not report.ok


async def test_a_drifted_logprob_differs_beyond_the_tolerance(backend: LocalBackend) -> None:
    turn = (await recorded_session(backend))[0]
    drifted = msgspec.structs.replace(turn, logprobs=turn.logprobs + np.float32(1e-3))
    (verdict,) = (await regenerate([drifted], backend)).turns
    assert verdict.status == "differs" and verdict.first_difference is None
    assert "log-prob of token 0 differs by 0.001" in verdict.reason
    (loose,) = (await regenerate([drifted], backend, tolerance=2e-3)).turns
    assert loose.status == "same"


async def test_turns_without_a_seed_or_their_parent_are_not_reproducible(
    backend: LocalBackend,
) -> None:
    turns = await recorded_session(backend)
    unseeded = with_sampling(turns[0], seed=None, seed_derived=None)
    report = await regenerate([unseeded, turns[3]], backend)  # turn 3's parent 1 is missing
    assert [t.status for t in report.turns] == ["not_reproducible"] * 2
    assert "recorded without a seed" in report.turns[0].reason
    assert "parent turn 1" in report.turns[1].reason
    assert not report.ok  # nothing could be sent again


async def test_a_turn_showing_an_image_the_recording_lacks_is_not_reproducible(
    backend: LocalBackend,
) -> None:
    turns = await recorded_session(backend)
    shot = ImageRef("ab" * 32, offset=0, length=2, width=8, height=8)
    seeing = msgspec.structs.replace(turns[0], images=[shot])
    report = await regenerate([seeing, turns[1]], backend, images={"cd" * 32: b"other"})
    first, second = report.turns
    assert first.status == second.status == "not_reproducible"  # turn 1's prompt holds it too
    assert f"its image sha256:{'ab' * 32} is not in the recording" in first.reason
    assert full_prompt_images({0: seeing, 1: turns[1]}) == {0: [shot], 1: [shot]}


async def test_a_greedy_turn_needs_no_seed(backend: LocalBackend) -> None:
    sampling = sampling_of(0, temperature=0.0, seed=None)
    ids, logprobs = await sampled(backend, SYSTEM + user("Hi"), sampling)
    turn = TurnCompleted(
        run="r", session="s", turn=0, prompt_ids=SYSTEM + user("Hi"),
        completion_ids=ids, logprobs=logprobs, sampling=sampling,
    )  # fmt: skip
    (verdict,) = (await regenerate([turn], backend)).turns
    assert verdict.status == "same"


async def test_a_turn_cut_by_a_stop_string_compares_its_recorded_tokens(
    backend: LocalBackend,
) -> None:
    """The gateway ends a turn at a stop string and keeps the tokens sampled up to it: the
    backend would go on, so only as many are read back."""
    turn = (await recorded_session(backend))[0]
    assert len(turn.completion_ids) > 3
    cut = msgspec.structs.replace(
        turn,
        completion_ids=turn.completion_ids[:3],
        logprobs=turn.logprobs[:3],
        sampling={**turn.sampling, "stop": ["whatever"]},
    )
    (verdict,) = (await regenerate([cut], backend)).turns
    assert verdict.status == "same" and verdict.regenerated_tokens == 3
    uncut = msgspec.structs.replace(cut, sampling=turn.sampling)
    (longer,) = (await regenerate([uncut], backend)).turns
    assert longer.status == "differs" and longer.first_difference == 3


async def test_a_backend_error_fails_the_turn_and_the_next_is_tried(
    backend: LocalBackend,
) -> None:
    turns = await recorded_session(backend)
    # More tokens than the model's context: the backend refuses it (413 in the gateway).
    too_long = with_sampling(turns[0], max_tokens=10**9)
    report = await regenerate([too_long, turns[1]], backend)
    assert [t.status for t in report.turns] == ["failed", "same"]
    assert "ContextLengthExceeded" in report.turns[0].reason
    assert "run r session s turn 0: failed: the backend failed" in report.turns[0].line()


# -- pure parts ---------------------------------------------------------------------------------


def event(turn: int, parent: int, prefix_len: int, prompt: list[int], out: list[int]) -> Any:
    return TurnCompleted(
        run="r", session="s", turn=turn, parent_turn=parent, prefix_len=prefix_len,
        prompt_ids=prompt, completion_ids=out, logprobs=[-1.0] * len(out),
    )  # fmt: skip


def test_full_prompts_follow_parents_as_replay_context_does() -> None:
    turns = [
        event(0, -1, 0, [1, 2], [3]),
        event(1, 0, 3, [4], [5, 6]),
        event(2, 0, 2, [7], [8]),  # a branch of turn 0 sharing its prompt only
        event(3, 1, 6, [9], [10]),
        event(4, -1, 0, [11], [12]),  # shares nothing
    ]
    prompts = full_prompts({t.turn: t for t in turns})
    for t in turns:
        parent_context = replay_context(turns[: t.parent + 1])[0] if t.parent >= 0 else []
        expected = [*list(parent_context)[: t.prefix_len], *t.prompt_ids.tolist()]
        prompt = prompts[t.turn]
        assert prompt is not None and prompt.tolist() == expected
    assert prompts[3].tolist() == [1, 2, 3, 4, 5, 6, 9]
    del turns[1]
    assert full_prompts({t.turn: t for t in turns})[3] is None


def test_the_first_event_of_a_turn_wins_and_sessions_stay_apart() -> None:
    first, retry = event(0, -1, 0, [1], [2]), event(0, -1, 0, [1], [3])
    other = msgspec.structs.replace(event(0, -1, 0, [1], [4]), session="t")
    sessions = session_turns([first, other, retry])
    assert sessions[("r", "s")][0] is first and sessions[("r", "t")][0] is other


def test_regeneration_params_are_the_recorded_sampling() -> None:
    turn = msgspec.structs.replace(
        event(0, -1, 0, [1], [2]),
        sampling={"max_tokens": 5, "temperature": 0.5, "top_p": 0.9, "seed": 7},
        logprobs_kind="raw",
    )
    params = regeneration_params(turn, stop_token_ids=[258])
    assert params == SamplingParams(
        max_tokens=5, temperature=0.5, top_p=0.9, seed=7, stop_token_ids=[258],
        allow_raw_logprobs=True,
    )  # fmt: skip
    recorded_stops = with_sampling(turn, stop_token_ids=[1, 2])
    assert regeneration_params(recorded_stops, [258]).stop_token_ids == [1, 2]
    assert "max_tokens" in str(regeneration_params(with_sampling(turn, max_tokens=None)))


def test_compare_names_where_the_tokens_part() -> None:
    turn = event(0, -1, 0, [1], [5, 6, 7])
    assert compare(turn, [5, 6, 7], [-1.0] * 3).status == "same"
    shorter = compare(turn, [5, 6], [-1.0] * 2)
    assert shorter.first_difference == 2 and "regenerated the end" in shorter.reason
    longer = compare(turn, [5, 6, 7, 8], [-1.0] * 4)
    assert longer.first_difference == 3 and "recorded the end, regenerated 8" in longer.reason
    nan = compare(turn, [5, 6, 7], [-1.0, float("nan"), -1.0])
    assert nan.status == "differs" and nan.max_logprob_delta == float("inf")
