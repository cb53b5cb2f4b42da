"""The in-process torch backend, on the real tiny model: sampling, logprobs, concurrency,
cancellation, weight swaps, and a tool call the fitted model really generates."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from gateway.backends.interface import Backend, GenerationChunk, Prompt, SamplingParams
from gateway.backends.local import LocalBackend
from gateway.backends.sampler import processed_log_probs, sample_token
from gateway.errors import (
    BackendError,
    BackendUnavailable,
    ContextLengthExceeded,
    InvalidRequest,
)
from gateway.model import ensure_tiny_model
from tests.helpers.generation import logprobs, tokens
from tests.helpers.tiny_model import WEATHER_TOOLS, WEATHER_TRANSCRIPT, render_ids
from tests.helpers.waiting import eventually

PROMPT = [257, *b"system\nYou are terse.", 258, 10, 257, *b"user\nHello there!", 258, 10]
PROMPT += [257, *b"assistant\n"]


@pytest.fixture
async def backend(tiny_model_dir: Path) -> AsyncIterator[LocalBackend]:
    backend = LocalBackend.load(tiny_model_dir)
    yield backend
    await backend.close()


@pytest.fixture
async def endless(tiny_model_dir: Path) -> AsyncIterator[LocalBackend]:
    """No end-of-turn ids: generations end only at max_tokens or a requested stop token (the
    random model samples <|im_end|> every few hundred tokens)."""
    backend = LocalBackend(AutoModelForCausalLM.from_pretrained(tiny_model_dir), eos_token_ids=())
    yield backend
    await backend.close()


@pytest.fixture(scope="module")
def other_weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint of the same architecture with different weights."""
    return ensure_tiny_model(tmp_path_factory.mktemp("other"), seed=1)


async def run(
    backend: LocalBackend, prompt: list[int], params: SamplingParams
) -> list[GenerationChunk]:
    return [chunk async for chunk in backend.generate(Prompt(prompt), params)]


def test_implements_the_backend_protocol(tiny_model_dir: Path) -> None:
    assert isinstance(LocalBackend.load(tiny_model_dir), Backend)


async def test_greedy_is_deterministic(backend: LocalBackend) -> None:
    params = SamplingParams(max_tokens=40, temperature=0)
    first, second = await run(backend, PROMPT, params), await run(backend, PROMPT, params)
    assert tokens(first) == tokens(second)
    assert logprobs(first) == logprobs(second)
    assert len(first) == 40  # one chunk per token
    assert [c.finish_reason for c in first] == [None] * 39 + ["length"]
    assert {c.weight_version for c in first} == {0}
    assert {"queue_s", "prefill_s", "decode_s"} <= first[-1].extra.keys()


async def test_same_seed_same_sample(backend: LocalBackend) -> None:
    def params(seed: int) -> SamplingParams:
        return SamplingParams(max_tokens=40, temperature=1.0, seed=seed)

    a, b, c = [await run(backend, PROMPT, params(s)) for s in (7, 7, 8)]
    assert tokens(a) == tokens(b)
    assert tokens(a) != tokens(c)  # near-uniform over 320 ids: 40 equal draws cannot happen


def nucleus_reference(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The sampled distribution's log-probs written plainly, in float64 and independently of
    ``processed_log_probs``: tempered softmax; with top_p < 1 the smallest head of the
    descending order whose mass reaches top_p (a token stays while the mass above it is below
    top_p), renormalized; -inf outside."""
    scores = logits.double() / (temperature or 1.0)
    log_p = torch.log_softmax(scores, -1)
    if temperature == 0 or top_p >= 1:
        return log_p
    probs, order = torch.sort(log_p.exp(), dim=-1, descending=True)
    keep = torch.cumsum(probs, -1) - probs < top_p
    keep[..., 0] = True
    inside = torch.zeros_like(keep).scatter(-1, order, keep)
    kept_mass = (log_p.exp() * inside).sum(-1, keepdim=True)
    return torch.where(inside, log_p - kept_mass.log(), -torch.inf)


SAMPLINGS = [(0.0, 1.0), (1.0, 1.0), (0.7, 1.0), (0.5, 1.0), (1.0, 0.9), (0.5, 0.9), (1.3, 0.9)]


@pytest.mark.parametrize(("temperature", "top_p"), SAMPLINGS)
async def test_logprobs_equal_a_full_forward_recomputation(
    backend: LocalBackend, tiny_model_dir: Path, temperature: float, top_p: float
) -> None:
    """What RL needs (issue 19): a trainer scoring prompt + completion in one fp32 pass gets the
    logprobs the backend recorded, under the distribution it sampled from: tempered, and
    renormalized over the top-p nucleus. Every sampled token lies inside that nucleus."""
    params = SamplingParams(max_tokens=64, temperature=temperature, top_p=top_p, seed=3)
    chunks = await run(backend, PROMPT, params)
    completion = tokens(chunks)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.inference_mode():
        logits = model(torch.tensor([PROMPT + completion])).logits[0].float()
    scores = logits[len(PROMPT) - 1 : -1]
    chosen = torch.tensor(completion)[:, None]
    reference = nucleus_reference(scores, temperature, top_p)
    expected = reference.gather(-1, chosen).squeeze(-1)
    got = torch.tensor(logprobs(chunks), dtype=torch.float64)
    assert torch.isfinite(expected).all()  # every sampled token is inside the nucleus
    assert (got - expected).abs().max().item() <= 1e-4
    # The shared helper (tests, deploy checks) gives the backend's numbers from the logits.
    helper = processed_log_probs(scores, temperature, top_p).gather(-1, chosen).squeeze(-1)
    assert (helper.double() - got).abs().max().item() <= 1e-5
    if (temperature, top_p) not in ((0.0, 1.0), (1.0, 1.0)):
        # The check can tell: the raw log-probs are not the sampled distribution's.
        raw = torch.log_softmax(scores.double(), -1).gather(-1, chosen).squeeze(-1)
        assert (raw - got).abs().max().item() > 1e-2
    if top_p < 1:
        # ... nor are the tempered, untruncated ones: the nucleus really cut the tail.
        untruncated = nucleus_reference(scores, temperature, 1.0).gather(-1, chosen).squeeze(-1)
        assert (untruncated - got).abs().min().item() > 1e-3


async def test_top_logprobs_leave_out_what_the_nucleus_cuts(backend: LocalBackend) -> None:
    # The random tiny model is near-uniform: at 0.2 and 0.3 its nucleus is a few tokens.
    params = SamplingParams(max_tokens=20, temperature=0.2, top_p=0.3, top_logprobs=20, seed=1)
    chunks = await run(backend, PROMPT, params)
    for chunk in chunks:
        assert chunk.top_logprobs is not None
        (top,) = chunk.top_logprobs
        values = [t.logprob for t in top]
        assert 1 <= len(top) <= 20 and all(math.isfinite(v) for v in values)
        assert values == sorted(values, reverse=True)
        if len(top) < 20:  # the whole nucleus, renormalized: the sampled token is in it
            assert sum(math.exp(v) for v in values) == pytest.approx(1.0, abs=1e-5)
            assert chunk.token_ids[0] in {t.token_id for t in top}
    assert any(len(c.top_logprobs[0]) < 20 for c in chunks if c.top_logprobs)


async def test_top_logprobs_are_sorted_and_hold_the_greedy_token(backend: LocalBackend) -> None:
    chunks = await run(
        backend, PROMPT, SamplingParams(max_tokens=20, temperature=0, top_logprobs=5)
    )
    for chunk in chunks:
        assert chunk.top_logprobs is not None and len(chunk.top_logprobs) == 1
        (top,) = chunk.top_logprobs
        assert len(top) == 5
        values = [t.logprob for t in top]
        assert values == sorted(values, reverse=True)
        assert top[0].token_id == chunk.token_ids[0]
        assert top[0].logprob == pytest.approx(chunk.logprobs[0], abs=1e-6)
    without = await run(backend, PROMPT, SamplingParams(max_tokens=3, temperature=0))
    assert all(c.top_logprobs is None for c in without)


async def test_stop_token_ends_generation_and_is_included(endless: LocalBackend) -> None:
    free = tokens(await run(endless, PROMPT, SamplingParams(max_tokens=30, seed=5)))
    assert len(free) == 30
    stop = free[10]
    params = SamplingParams(max_tokens=30, seed=5, stop_token_ids=[stop])
    chunks = await run(endless, PROMPT, params)
    assert tokens(chunks) == free[: free.index(stop) + 1]
    assert [c.finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["stop"]


async def test_the_models_end_of_turn_ends_generation(backend: LocalBackend) -> None:
    # The generation config lists <|im_end|> and <|endoftext|>; the random model samples one
    # now and then.
    eos = {256, 258}
    stopped = 0
    for seed in range(25):
        chunks = await run(backend, PROMPT, SamplingParams(max_tokens=40, seed=seed))
        ids = tokens(chunks)
        assert not eos & set(ids[:-1])
        if ids[-1] in eos:
            assert chunks[-1].finish_reason == "stop"
            stopped += 1
        else:
            assert (len(ids), chunks[-1].finish_reason) == (40, "length")
    assert stopped > 0


async def test_max_tokens_finishes_with_length(endless: LocalBackend) -> None:
    chunks = await run(endless, PROMPT, SamplingParams(max_tokens=7, temperature=1.0, seed=0))
    assert len(tokens(chunks)) == 7
    assert chunks[-1].finish_reason == "length"


async def test_context_overflow_is_refused_with_both_lengths(tiny_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    backend = LocalBackend(model, max_context=64, eos_token_ids=())
    with pytest.raises(ContextLengthExceeded) as caught:
        await run(backend, list(range(50)), SamplingParams(max_tokens=20))
    message = str(caught.value)
    assert "50" in message and "20" in message and "64" in message
    assert backend.decode_steps == 0
    assert len(tokens(await run(backend, list(range(50)), SamplingParams(max_tokens=14)))) == 14


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=0),
        SamplingParams(max_tokens=5, temperature=-1),
        SamplingParams(max_tokens=5, top_p=0),
        SamplingParams(max_tokens=5, top_logprobs=-1),
    ],
)
async def test_invalid_params_are_refused(backend: LocalBackend, params: SamplingParams) -> None:
    with pytest.raises(InvalidRequest):
        await run(backend, PROMPT, params)


async def test_invalid_prompts_are_refused(backend: LocalBackend) -> None:
    with pytest.raises(InvalidRequest):
        await run(backend, [], SamplingParams(max_tokens=5))
    with pytest.raises(InvalidRequest, match="10000"):
        await run(backend, [1, 10_000], SamplingParams(max_tokens=5))


async def test_concurrent_generations_equal_their_solo_runs(backend: LocalBackend) -> None:
    requests = [
        (PROMPT, SamplingParams(max_tokens=60, temperature=0)),
        (PROMPT[:20], SamplingParams(max_tokens=80, temperature=1.0, seed=1)),
        (PROMPT, SamplingParams(max_tokens=50, temperature=0.8, top_p=0.9, seed=2)),
        (PROMPT[5:], SamplingParams(max_tokens=70, temperature=1.0, seed=3, top_logprobs=2)),
    ]
    solo = [await run(backend, p, params) for p, params in requests]
    spans: list[tuple[float, float]] = []

    async def timed(prompt: list[int], params: SamplingParams) -> list[GenerationChunk]:
        chunks, first = [], 0.0
        async for chunk in backend.generate(Prompt(prompt), params):
            first = first or time.monotonic()
            chunks.append(chunk)
        spans.append((first, time.monotonic()))
        return chunks

    together = await asyncio.gather(*(timed(p, params) for p, params in requests))
    # Really concurrent: every generation had started streaming before any of them ended.
    assert max(first for first, _ in spans) < min(last for _, last in spans)
    for alone, concurrent in zip(solo, together, strict=True):
        assert tokens(concurrent) == tokens(alone)
        assert logprobs(concurrent) == pytest.approx(logprobs(alone), abs=1e-5)


async def steps_once_settled(backend: LocalBackend) -> int:
    """The decode step count once it stops moving (waits at most 5 s)."""

    async def settle() -> int:
        while True:
            before = backend.decode_steps
            await asyncio.sleep(0.1)
            if backend.decode_steps == before:
                return before

    return await asyncio.wait_for(settle(), 5)


async def test_cancelling_the_consumer_stops_the_decode_loop(endless: LocalBackend) -> None:
    received: list[GenerationChunk] = []

    async def consume() -> None:
        async for chunk in endless.generate(
            Prompt(PROMPT), SamplingParams(max_tokens=3000, seed=0)
        ):
            received.append(chunk)

    task = asyncio.create_task(consume())
    await eventually(lambda: len(received) >= 5, 10, "the first tokens")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert endless.in_flight == 0
    cancelled_at = len(received)
    # The worker checks the flag before every forward pass: it stops a few tokens after the
    # consumer did (the ones already in the queue or in the pass), not thousands later.
    steps = await steps_once_settled(endless)
    assert steps < cancelled_at + 100
    await asyncio.sleep(0.2)
    assert endless.decode_steps == steps


async def test_closing_the_iterator_early_stops_the_decode_loop(endless: LocalBackend) -> None:
    stream = endless.generate(Prompt(PROMPT), SamplingParams(max_tokens=3000, seed=0))
    assert isinstance(stream, AsyncGenerator)
    await anext(stream)
    await stream.aclose()
    assert endless.in_flight == 0
    assert await steps_once_settled(endless) < 100


async def test_close_ends_running_and_queued_generations(tiny_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    backend = LocalBackend(model, eos_token_ids=(), max_concurrency=1)
    running = backend.generate(Prompt(PROMPT), SamplingParams(max_tokens=3000, seed=0))
    queued = backend.generate(Prompt(PROMPT), SamplingParams(max_tokens=3000, seed=1))
    await anext(running)
    waiting = asyncio.create_task(anext(queued))
    await asyncio.sleep(0.05)
    assert not waiting.done()  # the only worker is busy
    await backend.close()
    with pytest.raises(BackendUnavailable, match="closed before the generation finished"):
        async for _ in running:
            pass
    with pytest.raises(BackendUnavailable, match="closed before the generation finished"):
        await waiting
    with pytest.raises(BackendUnavailable, match="is closed"):
        await run(backend, PROMPT, SamplingParams(max_tokens=3))
    assert backend.in_flight == 0


async def test_load_weights_swaps_the_policy(
    backend: LocalBackend, tiny_model_dir: Path, other_weights: Path
) -> None:
    greedy = SamplingParams(max_tokens=40, temperature=0)
    before = await run(backend, PROMPT, greedy)
    await backend.load_weights(other_weights, version=2)
    assert backend.weight_version == 2
    after = await run(backend, PROMPT, greedy)
    assert logprobs(after) != logprobs(before)
    assert {c.weight_version for c in after} == {2}
    reference = await run(LocalBackend.load(other_weights), PROMPT, greedy)
    assert tokens(reference) == tokens(after)
    assert logprobs(reference) == pytest.approx(logprobs(after), abs=1e-6)
    # A bare safetensors file works as well as a model directory.
    await backend.load_weights(tiny_model_dir / "model.safetensors", version=3)
    assert backend.weight_version == 3
    assert logprobs(await run(backend, PROMPT, greedy)) == pytest.approx(logprobs(before), abs=1e-6)


async def test_in_flight_generation_finishes_on_the_weights_it_started_with(
    endless: LocalBackend, other_weights: Path
) -> None:
    params = SamplingParams(max_tokens=600, seed=11)
    solo_old = await run(endless, PROMPT, params)
    stream = endless.generate(Prompt(PROMPT), params)
    chunks = [await anext(stream)]
    steps_before = endless.decode_steps
    await endless.load_weights(other_weights, version=2)
    # Still decoding when the swap landed: the old generation had more tokens to go.
    assert endless.decode_steps - steps_before < len(solo_old) - 1
    chunks += [chunk async for chunk in stream]
    assert tokens(chunks) == tokens(solo_old)
    assert logprobs(chunks) == pytest.approx(logprobs(solo_old), abs=1e-5)
    assert {c.weight_version for c in chunks} == {0}
    fresh = await run(endless, PROMPT, params)
    assert {c.weight_version for c in fresh} == {2}
    assert tokens(fresh) != tokens(solo_old)


async def test_a_load_in_mode_abort_ends_running_generations_and_holds_new_ones(
    endless: LocalBackend, other_weights: Path
) -> None:
    """What vLLM's /pause?mode=abort does (issue 37): the generation in flight ends at its next
    token with finish_reason "abort", its tokens so far kept; a generation asked for during the
    load waits for it and runs on the new weights."""
    params = SamplingParams(max_tokens=600, seed=11)
    stream = endless.generate(Prompt(PROMPT), params)
    chunks = [await anext(stream)]
    loading = asyncio.ensure_future(endless.load_weights(other_weights, 2, "abort"))
    chunks += [chunk async for chunk in stream]
    assert chunks[-1].finish_reason == "abort" and chunks[-1].token_ids == []
    assert 1 <= len(tokens(chunks)) < 600 and {c.weight_version for c in chunks} == {0}
    held = asyncio.ensure_future(run(endless, PROMPT, SamplingParams(max_tokens=4, seed=1)))
    await loading
    assert {c.weight_version for c in await held} == {2}, "it waited for the new weights"
    assert endless.accepting


async def test_a_load_in_mode_keep_switches_running_generations_at_their_next_token(
    endless: LocalBackend, other_weights: Path
) -> None:
    """/pause?mode=keep's equivalent: the generation goes on, each token reporting the version
    that sampled it, and the tokens after the swap are exactly those the new weights sample
    from the prompt and the tokens before (their log-probs those of a fp32 recomputation)."""
    params = SamplingParams(max_tokens=300, seed=11)
    stream = endless.generate(Prompt(PROMPT), params)
    chunks = [await anext(stream)]
    await endless.load_weights(other_weights, 2, "keep")
    chunks += [chunk async for chunk in stream]
    versions = [c.weight_version for c in chunks]
    swap = versions.index(2)
    assert swap >= 1 and set(versions[:swap]) == {0} and set(versions[swap:]) == {2}
    assert len(tokens(chunks)) == 300, "nothing aborted"
    before, after = tokens(chunks[:swap]), tokens(chunks[swap:])
    model = AutoModelForCausalLM.from_pretrained(other_weights, dtype=torch.float32)
    with torch.inference_mode():
        logits = model(torch.tensor([PROMPT + before + after])).logits[0].float()
    scores = logits[len(PROMPT) + len(before) - 1 : -1]
    expected = torch.log_softmax(scores, -1).gather(-1, torch.tensor(after)[:, None]).squeeze(-1)
    got = torch.tensor(logprobs(chunks[swap:]))
    assert (got - expected).abs().max().item() <= 1e-4


async def test_bad_checkpoint_keeps_the_current_weights(
    backend: LocalBackend, tmp_path: Path
) -> None:
    greedy = SamplingParams(max_tokens=20, temperature=0)
    before = tokens(await run(backend, PROMPT, greedy))
    wrong = tmp_path / "wrong.safetensors"
    save_file({"model.embed_tokens.weight": torch.zeros(3, 3)}, wrong)
    for checkpoint in (wrong, tmp_path / "nowhere"):
        with pytest.raises(BackendError, match="weight_version 5"):
            await backend.load_weights(checkpoint, version=5)
    assert backend.weight_version == 0
    assert tokens(await run(backend, PROMPT, greedy)) == before


async def test_errors_in_the_worker_surface_as_backend_error(tiny_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    # A config that lies about the vocabulary lets an id past the embedding table through
    # validation; the forward pass then fails on the worker thread.
    model.config.vocab_size = 10**6
    backend = LocalBackend(model)
    with pytest.raises(BackendError, match="failed while generating"):
        await run(backend, [5, 100_000], SamplingParams(max_tokens=3))
    assert backend.in_flight == 0


def test_sample_token_nucleus_keeps_only_the_head() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    params = SamplingParams(max_tokens=1, temperature=1.0, top_p=0.7, top_logprobs=4)
    generator = torch.Generator().manual_seed(0)
    drawn = {sample_token(logits, params, generator).token_id for _ in range(300)}
    assert drawn == {0, 1}  # the token crossing 0.7 stays (vLLM's rule), the tail goes
    sampled = sample_token(logits, params, generator)
    # Reported logprobs are the truncated distribution's, renormalized over the nucleus.
    assert sampled.logprob == pytest.approx(math.log([0.5, 0.3][sampled.token_id] / 0.8))
    assert sampled.top_logprobs is not None
    assert [t.token_id for t in sampled.top_logprobs] == [0, 1]
    assert [t.logprob for t in sampled.top_logprobs] == pytest.approx(
        [math.log(0.625), math.log(0.375)]
    )


@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    scale=st.floats(0.1, 20),
    temperature=st.floats(0.05, 2),
    top_p=st.floats(0, 1, exclude_min=True),
)
def test_processed_log_probs_are_the_nucleus_renormalized(
    seed: int, scale: float, temperature: float, top_p: float
) -> None:
    logits = torch.randn(2, 320, generator=torch.Generator().manual_seed(seed)) * scale
    got = processed_log_probs(logits, temperature, top_p)
    tempered_log = torch.log_softmax(logits.double() / temperature, -1)
    tempered = tempered_log.exp()
    for row, probs, log_probs in zip(got, tempered, tempered_log, strict=True):
        inside = torch.isfinite(row)
        assert inside[int(torch.argmax(probs))]  # the most likely token always stays
        assert row[inside].double().exp().sum().item() == pytest.approx(1.0, abs=1e-5)
        # a head of the descending order: no token left out is likelier than one kept
        if not inside.all():
            assert probs[~inside].max() <= probs[inside].min() + 1e-12
        # the smallest such head reaching top_p: without its least likely token it falls short
        kept = probs[inside].sum().item()
        assert kept >= top_p - 1e-5 or inside.all()
        assert kept - probs[inside].min().item() < top_p + 1e-5
        # renormalized, not reshaped: kept tokens keep their tempered ratios (log_softmax: a
        # kept token's probability may underflow to 0 at scale 20 and temperature 0.05); float32
        # rounds a tempered logit of ~1,000 (scale 17, temperature 0.0625) to ~6e-5
        ratio = row[inside].double() - log_probs[inside]
        rounding = 4 * torch.finfo(torch.float32).eps * (logits.abs().max().item() / temperature)
        assert (ratio - ratio[0]).abs().max().item() <= max(1e-4, rounding)


@pytest.mark.parametrize("top_p", [1.0, 0.9, 0.2])
def test_processed_log_probs_greedy_and_full_nucleus(top_p: float) -> None:
    logits = torch.randn(3, 320, generator=torch.Generator().manual_seed(2)) * 5
    # greedy's log-probs are the raw ones whatever top_p (vLLM sets top_p 1 for greedy)
    assert torch.equal(processed_log_probs(logits, 0.0, top_p), torch.log_softmax(logits, -1))
    tempered = torch.log_softmax(logits / 0.7, -1)
    if top_p == 1.0:
        assert torch.equal(processed_log_probs(logits, 0.7, top_p), tempered)
    rows = [processed_log_probs(row, 0.7, top_p) for row in logits]
    assert torch.equal(processed_log_probs(logits, 0.7, top_p), torch.stack(rows))


@pytest.mark.parametrize("temperature", [1e-6, 9.99e-6])
def test_a_temperature_below_vllms_epsilon_is_greedy(temperature: float) -> None:
    """Issue 38: vLLM takes a temperature below 1e-5 as greedy (argmax, raw log-probs, top_p
    ignored); so does the local backend, so a turn means one thing on both and in its record."""
    logits = torch.randn(320, generator=torch.Generator().manual_seed(3)) * 5
    raw = torch.log_softmax(logits, -1)
    assert torch.equal(processed_log_probs(logits, temperature, 0.5), raw)
    params = SamplingParams(max_tokens=1, temperature=temperature, top_p=0.5)
    sampled = sample_token(logits, params, torch.Generator().manual_seed(0))
    assert sampled.token_id == int(torch.argmax(logits))
    assert sampled.logprob == float(raw[sampled.token_id])
    # at 1e-5 it tempers: the argmax's log-prob is ~0, not the raw one
    assert float(processed_log_probs(logits, 1e-5, 1.0).max()) > float(raw.max())


def test_processed_log_probs_with_a_setting_per_position_are_each_positions_own() -> None:
    """What a trainer computes for a batch ([B, R, vocab], the sink's per-token temperature and
    top-p): bit for bit what the sampler computed for each token alone, greedy included."""
    logits = torch.randn(3, 5, 320, generator=torch.Generator().manual_seed(4)) * 5
    temperature = torch.tensor([0.7, 1.0, 1e-6, 0.3, 1.3]).repeat(3, 1)
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.95, 0.2]).repeat(3, 1)
    got = processed_log_probs(logits, temperature, top_p)
    each = [
        [
            processed_log_probs(logits[b, r], float(temperature[b, r]), float(top_p[b, r]))
            for r in range(5)
        ]
        for b in range(3)
    ]
    assert torch.equal(got, torch.stack([torch.stack(row) for row in each]))
    assert torch.equal(processed_log_probs(logits, temperature, 1.0)[:, 1], got[:, 1])


async def test_fitted_model_generates_a_tool_call_then_an_answer(tool_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tool_model_dir)
    backend = LocalBackend.load(tool_model_dir)
    greedy = SamplingParams(max_tokens=200, temperature=0)

    prompt = render_ids(
        tokenizer, WEATHER_TRANSCRIPT[:1], WEATHER_TOOLS, add_generation_prompt=True
    )
    call = await run(backend, prompt, greedy)
    text = tokenizer.decode(tokens(call))
    assert text == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call><|im_end|>"
    )
    assert call[-1].finish_reason == "stop"  # at the model's own <|im_end|>
    body = text.removeprefix("<tool_call>\n").removesuffix("\n</tool_call><|im_end|>")
    assert json.loads(body) == {"name": "get_weather", "arguments": {"city": "Paris"}}

    # The next turn: the previous context plus only the tool result's tokens, as the gateway
    # builds it, is exactly the template's rendering of the longer conversation.
    context = prompt + tokens(call)
    full = render_ids(tokenizer, WEATHER_TRANSCRIPT[:3], WEATHER_TOOLS, add_generation_prompt=True)
    assert full[: len(context)] == context
    answer = await run(backend, full, greedy)
    assert tokenizer.decode(tokens(answer)) == "It is 18°C and sunny in Paris.<|im_end|>"
    assert tokenizer.decode(tokens(answer), skip_special_tokens=True) == (
        "It is 18°C and sunny in Paris."
    )
    await backend.close()


@pytest.mark.parametrize(
    ("temperature", "top_p"), [(1e-300, 0.3), (5e-324, 0.3), (1e-40, 0.3), (1.0, 5e-324)]
)
def test_vanishing_temperature_or_top_p_samples_the_argmax(
    temperature: float, top_p: float
) -> None:
    """Found by the OpenAPI contract run: logits / 1e-300 overflowed (0 in float32), and a
    top_p of 5e-324 (0 in float32) kept no token: multinomial raised, mid-stream."""
    logits = torch.randn(320, generator=torch.Generator().manual_seed(1)) * 10
    params = SamplingParams(max_tokens=1, temperature=temperature, top_p=top_p)
    sampled = sample_token(logits, params, torch.Generator().manual_seed(0))
    assert sampled.token_id == int(torch.argmax(logits))


@settings(max_examples=300, deadline=None)
@given(temperature=st.floats(0, 2), top_p=st.floats(0, 1, exclude_min=True))
def test_every_sampling_setting_the_api_accepts_samples_a_token(
    temperature: float, top_p: float
) -> None:
    logits = torch.randn(320, generator=torch.Generator().manual_seed(1)) * 10
    params = SamplingParams(max_tokens=1, temperature=temperature, top_p=top_p)
    sampled = sample_token(logits, params, torch.Generator().manual_seed(0))
    assert 0 <= sampled.token_id < 320 and sampled.logprob <= 0.0
