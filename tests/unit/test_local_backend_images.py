"""The local backend's pixel path, on the real tiny vision-language model (a random Qwen2-VL)
and real Pillow-drawn PNGs: the log-probs it records are those of one full forward pass of the
prompt with its pixels and the completion, concurrent generations with images do not disturb
each other's positions, a weight switch in mode "keep" reads the images again, and prompts whose
placeholders do not fit their images are refused as the client's error."""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image, ImageDraw
from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

from gateway.backends.interface import GenerationChunk, Prompt, PromptImage, SamplingParams
from gateway.backends.local import LocalBackend
from gateway.backends.local_vision import VisionReader
from gateway.backends.sampler import processed_log_probs
from gateway.errors import InvalidRequest
from gateway.model.tiny_vl import IMAGE_PAD, ensure_tiny_vl_model
from schemas.images import ImageRef, content_digest, image_part
from schemas.pixels import PROCESSOR_BACKEND, image_inputs
from tests.helpers.tiny_model import render_ids

SAMPLINGS = [(0.0, 1.0), (0.7, 0.9), (1.0, 1.0)]


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_vl_model(tmp_path_factory.mktemp("tiny-vl"))


@pytest.fixture(scope="module")
def other_vl_weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same architecture with other weights: a checkpoint to switch to."""
    return ensure_tiny_vl_model(tmp_path_factory.mktemp("tiny-vl-other"), seed=1)


@pytest.fixture
async def backend(vl_dir: Path) -> AsyncIterator[LocalBackend]:
    backend = LocalBackend.load(vl_dir)
    yield backend
    await backend.close()


@pytest.fixture
async def endless(vl_dir: Path) -> AsyncIterator[LocalBackend]:
    """No end-of-turn ids: generations run to max_tokens (the random model samples <|im_end|>
    early)."""
    model = AutoModelForImageTextToText.from_pretrained(vl_dir, dtype=torch.float32)
    vision = VisionReader.load(vl_dir, model, "local-0")
    backend = LocalBackend(model, eos_token_ids=(), vision=vision)
    yield backend
    await backend.close()


def png(width: int, height: int, colour: str) -> bytes:
    """A drawn picture (not a flat colour: its patches differ), as PNG bytes."""
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    draw.ellipse((width // 8, height // 8, width // 2, height // 2), fill=colour)
    draw.rectangle((width // 2, height // 3, width - 4, height - 4), outline="black", width=3)
    draw.line((0, height - 1, width - 1, 0), fill="blue", width=2)
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


PICTURES = [png(100, 60, "red"), png(57, 90, "green")]


def image_prompt(vl_dir: Path, pictures: list[bytes], text: str = "What is this?") -> Prompt:
    """A user turn holding ``pictures`` then ``text``, rendered by the model's chat template and
    each image's one placeholder expanded as its processor expands it (the gateway's template
    layer does this for real turns)."""
    tokenizer: Any = AutoTokenizer.from_pretrained(vl_dir)
    pad = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    sizes = [Image.open(io.BytesIO(p)).size for p in pictures]
    parts = [image_part(content_digest(p), w, h) for p, (w, h) in zip(pictures, sizes, strict=True)]
    messages = [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]
    rendered = render_ids(tokenizer, messages, None, add_generation_prompt=True)
    counts = image_inputs(processor(vl_dir), pictures).placeholders if pictures else ()
    ids: list[int] = []
    images: list[PromptImage] = []
    pending = iter(zip(pictures, sizes, counts, strict=True))
    for token in rendered:
        if token != pad:
            ids.append(token)
            continue
        data, (w, h), n = next(pending)
        images.append(PromptImage(ImageRef(content_digest(data), len(ids), n, w, h), data))
        ids += [pad] * n
    return Prompt(ids, images=tuple(images))


def processor(vl_dir: Path) -> Any:
    return AutoImageProcessor.from_pretrained(vl_dir, backend=PROCESSOR_BACKEND)


async def run(
    backend: LocalBackend, prompt: Prompt, params: SamplingParams
) -> list[GenerationChunk]:
    return [chunk async for chunk in backend.generate(prompt, params)]


def tokens(chunks: list[GenerationChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def logprobs(chunks: list[GenerationChunk]) -> list[float]:
    return [lp for c in chunks for lp in c.logprobs]


def full_forward_scores(model_dir: Path, prompt: Prompt, completion: list[int]) -> torch.Tensor:
    """The logits at each completion token's position, from ONE fp32 forward pass of prompt +
    completion with the images' pixels, the model working out its positions itself: what a
    trainer computes."""
    model: Any = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    ids = [*prompt.tolist(), *completion]
    kwargs: dict[str, torch.Tensor] = {}
    if prompt.images:
        inputs = image_inputs(processor(model_dir), [image.data for image in prompt.images])
        token_types = torch.zeros(1, len(ids), dtype=torch.long)
        for image in prompt.images:
            token_types[0, image.ref.offset : image.ref.offset + image.ref.length] = 1
        kwargs = {
            "pixel_values": torch.from_numpy(inputs.pixel_values),
            "image_grid_thw": torch.from_numpy(inputs.grid_thw),
            "mm_token_type_ids": token_types,
        }
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids]), **kwargs).logits[0].float()
    return logits[len(prompt) - 1 : -1]


def assert_logprobs_are_a_full_forwards(
    model_dir: Path,
    prompt: Prompt,
    chunks: list[GenerationChunk],
    temperature: float,
    top_p: float,
) -> None:
    completion = tokens(chunks)
    scores = full_forward_scores(model_dir, prompt, completion)
    expected = processed_log_probs(scores, temperature, top_p)
    expected = expected.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1).double()
    got = torch.tensor(logprobs(chunks), dtype=torch.float64)
    assert torch.isfinite(expected).all()  # every sampled token lies inside the nucleus
    assert (got - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize(("temperature", "top_p"), SAMPLINGS)
async def test_logprobs_equal_one_full_forward_with_the_pixels(
    endless: LocalBackend, vl_dir: Path, temperature: float, top_p: float
) -> None:
    """Two images of different shapes (grids 4x8 and 6x4 patches: their M-RoPE positions are not
    a token's index), 48 tokens each sampling: the recorded log-probs are a trainer's."""
    prompt = image_prompt(vl_dir, PICTURES)
    assert [image.ref.length for image in prompt.images] == [8, 6]
    params = SamplingParams(max_tokens=48, temperature=temperature, top_p=top_p, seed=5)
    chunks = await run(endless, prompt, params)
    assert len(tokens(chunks)) == 48
    assert_logprobs_are_a_full_forwards(vl_dir, prompt, chunks, temperature, top_p)


async def test_the_pixels_decide_the_completion(backend: LocalBackend, vl_dir: Path) -> None:
    """The prefill reads the images: other pixels in the same placeholders, other log-probs."""
    greedy = SamplingParams(max_tokens=8, temperature=0)
    red = await run(backend, image_prompt(vl_dir, [png(100, 60, "red")]), greedy)
    green = await run(backend, image_prompt(vl_dir, [png(100, 60, "green")]), greedy)
    assert logprobs(red) != logprobs(green)


async def test_a_text_prompt_on_a_vision_model_runs_the_text_path(
    endless: LocalBackend, vl_dir: Path
) -> None:
    prompt = image_prompt(vl_dir, [])
    assert not prompt.images
    chunks = await run(endless, prompt, SamplingParams(max_tokens=32, temperature=0.7, seed=2))
    assert_logprobs_are_a_full_forwards(vl_dir, prompt, chunks, 0.7, 1.0)


async def test_concurrent_image_generations_equal_their_solo_runs(
    endless: LocalBackend, vl_dir: Path
) -> None:
    """The model keeps its M-RoPE offset on itself when left to work out positions; generations
    sharing it on threads each carry their own, so running together changes nothing."""
    requests = [
        (image_prompt(vl_dir, PICTURES), SamplingParams(max_tokens=40, temperature=0)),
        (image_prompt(vl_dir, PICTURES[1:]), SamplingParams(max_tokens=40, seed=1)),
        (image_prompt(vl_dir, [png(200, 40, "red")], "Hi"), SamplingParams(max_tokens=40, seed=2)),
        (image_prompt(vl_dir, [], "Only text"), SamplingParams(max_tokens=40, seed=3)),
    ]
    solo = [await run(endless, prompt, params) for prompt, params in requests]
    together = await asyncio.gather(*(run(endless, p, params) for p, params in requests))
    for alone, concurrent in zip(solo, together, strict=True):
        assert tokens(concurrent) == tokens(alone)
        assert logprobs(concurrent) == pytest.approx(logprobs(alone), abs=1e-5)


async def test_a_switch_in_mode_keep_reads_the_images_again(
    endless: LocalBackend, vl_dir: Path, other_vl_weights: Path
) -> None:
    """The new weights read the prompt (with its pixels) and the tokens so far: the tokens after
    the switch have the log-probs of one full forward of the new weights."""
    prompt = image_prompt(vl_dir, PICTURES)
    stream = endless.generate(prompt, SamplingParams(max_tokens=60, seed=11))
    chunks = [await anext(stream)]
    # As save_pretrained wrote it: the checkpoint's key names, not the module's.
    await endless.load_weights(other_vl_weights, 2, "keep")
    chunks += [chunk async for chunk in stream]
    versions = [c.weight_version for c in chunks]
    swap = versions.index(2)
    assert swap >= 1 and set(versions[:swap]) == {0} and set(versions[swap:]) == {2}
    before, after = tokens(chunks[:swap]), tokens(chunks[swap:])
    scores = full_forward_scores(other_vl_weights, prompt, before + after)[len(before) :]
    expected = torch.log_softmax(scores, -1).gather(-1, torch.tensor(after)[:, None]).squeeze(-1)
    got = torch.tensor(logprobs(chunks[swap:]))
    assert (got - expected).abs().max().item() <= 1e-4


async def test_a_text_model_refuses_images(tiny_model_dir: Path, vl_dir: Path) -> None:
    backend = LocalBackend.load(tiny_model_dir, backend_id="text-0")
    try:
        prompt = image_prompt(vl_dir, PICTURES[:1])
        with pytest.raises(InvalidRequest, match="text-0 takes no images"):
            await run(backend, Prompt(prompt.ids % 256, images=prompt.images), SamplingParams(4))
    finally:
        await backend.close()


async def test_placeholders_that_do_not_fit_their_images_are_refused(
    backend: LocalBackend, vl_dir: Path
) -> None:
    prompt = image_prompt(vl_dir, PICTURES[:1])
    (image,) = prompt.images
    ref, ids = image.ref, prompt.tolist()
    pad = ids[ref.offset]
    params = SamplingParams(max_tokens=4)

    async def refused(ids: list[int], images: list[PromptImage], match: str) -> None:
        with pytest.raises(InvalidRequest, match=match):
            await run(backend, Prompt(ids, images=tuple(images)), params)

    # One placeholder short: the run is 7 where the processor expands this image to 8.
    short = ImageRef(ref.sha256, ref.offset, ref.length - 1, ref.width, ref.height)
    cut = ids[: ref.offset] + ids[ref.offset + 1 :]
    await refused(cut, [PromptImage(short, image.data)], "7 placeholder tokens .* expands .* 8")
    # The run is there, but the image is another size (another grid: 4 tokens).
    small = png(60, 60, "red")
    await refused(ids, [PromptImage(ref, small)], "expands this image to 4")
    # The ids at the offset are not the image token.
    moved = ImageRef(ref.sha256, ref.offset - 1, ref.length, ref.width, ref.height)
    await refused(ids, [PromptImage(moved, image.data)], f"should all be the image token {pad}")
    # An image token outside any image's placeholders.
    await refused([*ids, pad], [image], "outside an image's placeholders")
    # Not an image at all.
    await refused(ids, [PromptImage(ref, b"GIF89a not really")], "not a decodable image")
    # Nothing ran: the backend still serves.
    assert len(tokens(await run(backend, prompt, params))) == 4
