"""A turn generated in parts (issue 37, point 6): the parts ``turnstream replay --regenerate``
sends, which weights each goes to, and a continued turn sampled here by the real tiny model,
part by part as the gateway continues one, regenerated against a checkpoint per version."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from gateway.backends.interface import SamplingParams
from gateway.backends.local import LocalBackend
from gateway.serving.generating import continued_seed
from schemas.events import TurnCompleted
from tests.unit.test_regenerate import END, SYSTEM, sampled, user
from turnstream.data.parts import OWN_WEIGHTS, part_weights, turn_parts
from turnstream.data.regenerate import regenerate
from turnstream.data.regenerate_command import CheckpointWeights

SEED = 11


def continued(
    n: int, spans: list[tuple[int | None, int]] | None, at: list[int], **extra: Any
) -> TurnCompleted:
    sampling = {"seed": SEED, "max_tokens": 40, "continued": [{"at": a, "seed": a} for a in at]}
    return TurnCompleted(
        run="r", session="s", turn=0, prompt_ids=[1, 2], completion_ids=list(range(10, 10 + n)),
        logprobs=[-0.5] * n, weight_version=3, version_spans=spans,
        sampling={**sampling, **extra.pop("sampling", {})}, **extra,
    )  # fmt: skip


def test_each_part_is_the_prompt_and_the_tokens_before_it_with_its_own_seed() -> None:
    # Aborted after 4 tokens, then again before the continuation's first token, then after 7.
    turn = continued(9, [(3, 4), (4, 3), (5, 2)], at=[4, 4, 7])
    parts = turn_parts(turn, np.array([1, 2], dtype=np.int32), SamplingParams(40, seed=SEED))
    assert [(p.index, p.start, p.end, p.versions) for p in parts] == [
        (0, 0, 4, (3,)),
        (2, 4, 7, (4,)),  # part 1 had no tokens: nothing to send
        (3, 7, 9, (5,)),
    ]
    assert [p.params.seed for p in parts] == [SEED, 4, 7]
    assert [p.params.max_tokens for p in parts] == [40, 36, 33]
    assert parts[2].prompt.tolist() == [1, 2, *range(10, 17)]
    assert [p.enough for p in parts] == [4, 3, None]  # the last one ends as the backend ends it


@pytest.mark.parametrize("finish", ["version_limit", "stop_string"])
def test_a_last_part_the_gateway_cut_is_read_to_its_recorded_end(finish: str) -> None:
    extra: dict[str, Any] = (
        {"finish_reason": "version_limit"} if finish == "version_limit"
        else {"sampling": {"stop": ["x"]}}
    )  # fmt: skip
    turn = continued(6, [(3, 4), (4, 2)], at=[4], **extra)
    parts = turn_parts(turn, np.array([1, 2], dtype=np.int32), SamplingParams(40, seed=SEED))
    assert [p.enough for p in parts] == [4, 2]


def test_a_part_goes_to_its_own_version_or_says_why_not() -> None:
    prompt, params = np.array([1], dtype=np.int32), SamplingParams(40, seed=SEED)
    [frozen] = turn_parts(continued(5, [(3, 2), (None, 3)], at=[]), prompt, params)
    a, b = turn_parts(continued(5, [(3, 2), (4, 3)], at=[2]), prompt, params)
    [one] = turn_parts(continued(5, None, at=[]), prompt, params)
    assert part_weights({3, None}, frozen, [3]).startswith("at an unknown version")  # type: ignore[union-attr]
    assert part_weights({3, 4}, a, [3, 4]) == 3 and part_weights({3, 4}, b, [3, 4]) == 4
    assert part_weights({3, 4}, b, [3]) == (
        "at version 4: no weights for that version here (--checkpoint 4=PATH); not regenerated"
    )
    assert part_weights({3}, one, []) is OWN_WEIGHTS  # one version: as before, --model's
    assert part_weights({3}, one, [3]) == 3
    mixed = dataclasses.replace(frozen, versions=(3, 4))
    assert part_weights({3, 4}, mixed, [3, 4]) == (
        "spans versions 3, 4 (its weights changed under it): not regenerated"
    )


@pytest.fixture
async def backend(tiny_model_dir: Path) -> AsyncIterator[LocalBackend]:
    backend = LocalBackend.load(tiny_model_dir)
    try:
        yield backend
    finally:
        await backend.close()


async def test_a_continued_turn_regenerates_part_by_part(
    backend: LocalBackend, tiny_model_dir: Path
) -> None:
    """Sampled here as the gateway continues an aborted turn: 5 tokens, then prompt + those 5
    with the continuation's seed; the tiny model's weights recorded as versions 3 and 4."""
    prompt = [*SYSTEM, *user("Go on")]
    sampling = {"max_tokens": 30, "temperature": 1.0, "top_p": 1.0, "stop_token_ids": [END]}
    first, first_lp = await sampled(backend, prompt, {**sampling, "seed": SEED})
    assert len(first) > 5, "the seed's sample must outlast the abort at token 5"
    seed = continued_seed(SEED, 5)
    rest, rest_lp = await sampled(
        backend, [*prompt, *first[:5]], {**sampling, "seed": seed, "max_tokens": 25}
    )
    turn = TurnCompleted(
        run="r", session="s", turn=0, prompt_ids=prompt, completion_ids=first[:5] + rest,
        logprobs=first_lp[:5] + rest_lp, weight_version=3,
        version_spans=[(3, 5), (4, len(rest))],
        sampling={**sampling, "seed": SEED, "continued": [{"at": 5, "seed": seed}]},
    )  # fmt: skip
    weights = CheckpointWeights(backend, {3: tiny_model_dir, 4: tiny_model_dir}, tiny_model_dir)

    both = await regenerate([turn], backend, weights=weights)

    [verdict] = both.turns
    assert verdict.status == "same" and both.ok, verdict.line()
    assert [(p.part.start, p.status) for p in verdict.parts] == [(0, "same"), (5, "same")]
    assert backend.weight_version == 4  # each version's weights were loaded for its part

    one = await regenerate(
        [turn], backend, weights=CheckpointWeights(backend, {4: tiny_model_dir}, tiny_model_dir)
    )
    [partial] = one.turns
    assert partial.status == "partial" and one.ok, partial.line()
    assert [p.status for p in partial.parts] == ["not_reproducible", "same"]

    unknown = msgspec.structs.replace(turn, version_spans=[(3, 5), (None, len(rest))])
    frozen = await regenerate([unknown], backend, weights=weights)
    [told] = frozen.turns
    assert told.status == "partial" and [p.status for p in told.parts] == [
        "same",
        "not_reproducible",
    ]
    assert f"part 1 (tokens 5-{4 + len(rest)}) at an unknown version: not regenerated" in (
        told.line()
    )
    # Without any checkpoint, a turn of two versions has no part the backend's weights are.
    alone = await regenerate([turn], backend)
    assert alone.turns[0].status == "not_reproducible" and not alone.ok

    changed = turn.completion_ids.copy()
    changed[7] = (changed[7] + 1) % 256
    differs = await regenerate(
        [msgspec.structs.replace(turn, completion_ids=changed)], backend, weights=weights
    )
    [bad] = differs.turns
    assert bad.status == "differs" and bad.first_difference == 7 and not differs.ok
    assert [p.status for p in bad.parts] == ["same", "differs"]
