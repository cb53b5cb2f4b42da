"""Regenerating a recorded turn that shows images (issue 39): the turn is sampled by the local
backend's pixel path on the real tiny vision-language model, recorded as the gateway records it
(its images' refs in the event, their bytes beside, as a recording holds them), and sent again
by ``regenerate`` with its images: the same tokens; other pixels under the same names differ,
and a recording without the bytes cannot regenerate it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest

from gateway.backends.interface import SamplingParams
from gateway.backends.local import LocalBackend
from schemas.events import TurnCompleted
from tests.helpers.generation import logprobs, tokens
from tests.unit.test_local_backend_images import PICTURES, image_prompt, png, run, vl_dir
from turnstream.data.regenerate import regenerate

__all__ = ["vl_dir"]  # the fixture, imported to be used here

SAMPLING = {"max_tokens": 6, "temperature": 1.0, "top_p": 1.0, "seed": 11, "stop_token_ids": []}


@pytest.fixture
async def backend(vl_dir: Path) -> AsyncIterator[LocalBackend]:
    backend = LocalBackend.load(vl_dir)
    yield backend
    await backend.close()


async def test_a_recorded_image_turn_regenerates_with_its_images(
    backend: LocalBackend, vl_dir: Path
) -> None:
    prompt = image_prompt(vl_dir, PICTURES)
    params = SamplingParams(max_tokens=6, temperature=1.0, top_p=1.0, seed=11, stop_token_ids=[])
    chunks = await run(backend, prompt, params)
    turn = TurnCompleted(
        run="r", session="s", turn=0, prompt_ids=prompt.ids, completion_ids=tokens(chunks),
        logprobs=logprobs(chunks), sampling=SAMPLING, images=[i.ref for i in prompt.images],
    )  # fmt: skip
    recorded = {i.ref.sha256: i.data for i in prompt.images}

    (same,) = (await regenerate([turn], backend, images=recorded)).turns

    assert same.status == "same", same.line()
    # The pixels are sent: another picture of the first one's size, under its name, differs.
    first = prompt.images[0].ref.sha256
    other = {**recorded, first: png(100, 60, "purple")}
    (differs,) = (await regenerate([turn], backend, images=other)).turns
    assert differs.status == "differs", differs.line()
    (lacking,) = (await regenerate([turn], backend, images={})).turns
    assert lacking.status == "not_reproducible"
    assert f"its image sha256:{first} is not in the recording" in lacking.reason
    # A text turn of the same ids, no images named: the pad tokens alone are not the prompt.
    blind = msgspec.structs.replace(turn, images=[])
    (unseen,) = (await regenerate([blind], backend, images=recorded)).turns
    assert unseen.status != "same"
