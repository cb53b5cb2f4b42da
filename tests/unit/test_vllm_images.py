"""Image turns through the vLLM backend: ``/inference/v1/generate`` with each image's placeholder
run collapsed to one token and the images as data URLs, the prompt vLLM read checked against the
gateway's kept ids (``gateway.backends.vllm_generate``).

Against a STAND-IN of vLLM 0.32 (tests/helpers/vllm_standin.py), because vLLM's CPU build here
cannot serve Qwen2-VL: ``import vllm.model_executor.models.qwen2_vl`` fails with
``ModuleNotFoundError: No module named 'torchvision'`` (transformers'
image_processing_qwen2_vl.py:26 imports ``torchvision.transforms.v2``, and the deploy venv has
no torchvision: its PyPI wheel needs CUDA). The stand-in validates each request as vLLM's
``GenerateRequest`` does and expands each placeholder with Qwen2-VL's rule, as vLLM's processor
does; tests/deploy/test_vllm_images.py runs the real server the day it can.
"""

from __future__ import annotations

import base64
import dataclasses
from typing import Any

import numpy as np
import pytest

from gateway.backends.interface import Prompt, SamplingParams
from gateway.backends.sglang import SGLangBackend
from gateway.backends.vllm import VLLMBackend
from gateway.backends.vllm_generate import collapsed_ids
from gateway.errors import BackendError, InvalidRequest
from gateway.images import VisionSpec
from gateway.model.tiny_vl import ensure_tiny_vl_model
from gateway.templates import ChatTemplate, load_tokenizer
from schemas.images import content_digest, image_parts
from tests.helpers.backend_transport import HandlerTransport
from tests.helpers.image_turns import ImageTurns, full_prompts, png, user
from tests.helpers.vllm_standin import VLLMStandIn

JSON = dict[str, Any]


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> ChatTemplate:
    model_dir = ensure_tiny_vl_model(tmp_path_factory.mktemp("models"))
    vision = VisionSpec.load(model_dir)
    assert vision is not None
    return ChatTemplate(load_tokenizer(model_dir), vision=vision)


def vision_of(template: ChatTemplate) -> VisionSpec:
    assert template.vision is not None
    return template.vision


def completion(template: ChatTemplate) -> list[int]:
    return [*template.encode("A red box."), *template.stop_token_ids[:1]]


def backend(standin: VLLMStandIn) -> VLLMBackend:
    return VLLMBackend(
        "http://gpu-1:8000/v1",
        "tiny-vl",
        backend_id="vllm-1",
        max_context=4096,
        transport=HandlerTransport(standin.handler),
        logprobs_kind="processed",  # known: no probe requests of its own
    )


def image_prompt(template: ChatTemplate, messages: list[JSON], data: list[bytes]) -> Prompt:
    ids = template.prompt_ids(messages, None)
    by_digest = {content_digest(d): d for d in data}
    images = vision_of(template).locate(np.asarray(ids), list(image_parts(messages)), by_digest)
    return Prompt(ids, images=images)


PARAMS = SamplingParams(max_tokens=16, seed=7, stop_token_ids=(1,), top_logprobs=1)


@pytest.mark.parametrize("stream", [True, False])
async def test_an_image_prompt_goes_collapsed_to_generate_and_comes_back_equal(
    template: ChatTemplate, stream: bool
) -> None:
    a, b = png(100, 60), png(640, 480, "green")
    prompt = image_prompt(template, [user("look", a), user("and this", b)], [a, b])
    standin = VLLMStandIn(vision_of(template), completion(template))
    vllm = backend(standin)
    params = dataclasses.replace(PARAMS, stream=stream)
    chunks = [chunk async for chunk in vllm.generate(prompt, params)]
    [request] = standin.requests
    assert request.url.path == "/inference/v1/generate"
    body = standin.bodies[0]
    pad = vision_of(template).image_token_id
    # One placeholder an image, where each run began; the rest of the ids as they were.
    assert body["token_ids"] == collapsed_ids(prompt)
    assert body["token_ids"].count(pad) == 2 < prompt.ids.tolist().count(pad)
    parts = body["content_parts"]
    assert [p["uuid"] for p in parts] == [content_digest(a), content_digest(b)]
    assert [base64.b64decode(p["url"].split(",", 1)[1]) for p in parts] == [a, b]
    assert all(p["url"].startswith("data:image/png;base64,") for p in parts)
    assert body["return_token_ids"] is True and body["stream"] is stream
    sampling = body["sampling_params"]
    assert (sampling["max_tokens"], sampling["seed"], sampling["logprobs"]) == (16, 7, 1)
    assert sampling["detokenize"] is False
    # vLLM's expansion of the collapsed ids is the gateway's: nothing to record apart.
    assert standin.served_prompts == [prompt.ids.tolist()]
    assert all(chunk.served_prompt is None for chunk in chunks)
    tokens = [t for chunk in chunks for t in chunk.token_ids]
    assert tokens == completion(template)
    assert [lp for chunk in chunks for lp in chunk.logprobs] == [-0.5] * len(tokens)
    tops = [top for chunk in chunks for top in chunk.top_logprobs or []]
    assert [[t.token_id for t in top] for top in tops] == [[t] for t in tokens]
    assert chunks[-1].finish_reason == "stop"
    assert chunks[-1].extra["prompt_tokens"] == len(prompt)


async def test_a_text_prompt_keeps_the_completions_endpoint(template: ChatTemplate) -> None:
    standin = VLLMStandIn(vision_of(template), completion(template))
    prompt = Prompt(template.prompt_ids([{"role": "user", "content": "hi"}], None))
    chunks = [chunk async for chunk in backend(standin).generate(prompt, PARAMS)]
    [request] = standin.requests
    assert request.url.path == "/v1/completions"
    body = standin.bodies[0]
    assert body["prompt"] == prompt.ids.tolist() and "content_parts" not in body
    assert [t for chunk in chunks for t in chunk.token_ids] == completion(template)


async def test_without_enable_scale_out_the_error_says_to_add_it(template: ChatTemplate) -> None:
    a = png(100, 60)
    prompt = image_prompt(template, [user("look", a)], [a])
    standin = VLLMStandIn(vision_of(template), completion(template), scale_out=False)
    with pytest.raises(BackendError) as raised:
        async for _ in backend(standin).generate(prompt, PARAMS):
            pass
    message = str(raised.value)
    assert "HTTP 403" in message and "/inference/v1/generate" in message
    assert "restart it with that flag" in message and "--enable-scale-out" in message


async def test_sglang_refuses_an_image_prompt_naming_itself(template: ChatTemplate) -> None:
    a = png(100, 60)
    prompt = image_prompt(template, [user("look", a)], [a])
    sglang = SGLangBackend(
        "http://gpu-2:30000", backend_id="sglang-1", max_context=4096, logprobs_kind="processed"
    )
    with pytest.raises(InvalidRequest, match="the SGLang backend \\(sglang-1\\) takes no images"):
        sglang.generate(prompt, PARAMS)
    await sglang.close()


# -- through the turn core: what the log records ------------------------------------------------


async def test_image_turns_round_trip_token_exact(template: ChatTemplate) -> None:
    shot, more = png(100, 60), png(200, 120, "green")
    standin = VLLMStandIn(vision_of(template), completion(template))
    stack = ImageTurns(template, backend(standin))
    session = await stack.session()
    messages = [user("what is this?", shot)]
    messages.append(await stack.turn(session, messages, [shot]))
    messages.append(user("and now?", more))
    await stack.turn(session, messages, [shot, more])
    events = stack.events
    assert len(events) == 2 and events[1].parent_turn == 0
    # What vLLM read (the stand-in's expansion of the collapsed ids) is what the log holds,
    # turn for turn, and a full render of the conversation gives the same ids.
    assert full_prompts(events) == standin.served_prompts
    assert standin.served_prompts[1] == template.prompt_ids(messages, None)
    assert all("prompt_fork" not in event.sampling for event in events)
    assert [ref.sha256 for ref in events[1].images] == [content_digest(more)]
    # The second turn sent both images again, each collapsed to one placeholder.
    assert [p["uuid"] for p in standin.bodies[1]["content_parts"]] == [
        content_digest(shot),
        content_digest(more),
    ]


async def test_another_expansion_is_recorded_as_vllm_read_it_and_marked(
    template: ChatTemplate,
) -> None:
    shot, more = png(100, 60), png(200, 120, "green")
    own = vision_of(template)
    # vLLM loading another processor config (min_pixels 16x): its runs are longer.
    other = dataclasses.replace(own, min_pixels=own.min_pixels * 16)
    assert other.placeholders(100, 60)[0] != own.placeholders(100, 60)[0]
    standin = VLLMStandIn(other, completion(template))
    stack = ImageTurns(template, backend(standin))
    session = await stack.session()
    messages = [user("what is this?", shot)]
    messages.append(await stack.turn(session, messages, [shot]))
    sent = template.prompt_ids(messages[:1], None)
    [first] = stack.events
    # Recorded with the ids vLLM read, never the gateway's: and marked.
    assert full_prompts([first]) == standin.served_prompts != [sent]
    [ref] = first.images
    pad, own_length = own.image_token_id, own.placeholders(100, 60)[0]
    assert (ref.offset, ref.length) == (sent.index(pad), other.placeholders(100, 60)[0])
    assert first.sampling["prompt_fork"] == {
        "at": ref.offset + own_length,  # where the gateway's run ended and vLLM's went on
        "sent_tokens": len(sent),
        "served_tokens": len(standin.served_prompts[0]),
        "backend": "vllm-1",
    }
    assert standin.served_prompts[0][ref.offset : ref.end] == [pad] * ref.length
    assert stack.metrics.prompt_forks._value.get() == 1
    # The next turn continues what vLLM read: its kept ids, the first image collapsed where
    # vLLM placed it, so vLLM expands it as before and the prompt is the one sent.
    messages.append(user("and now?", more))
    await stack.turn(session, messages, [shot, more])
    second = stack.events[1]
    assert second.parent_turn == 0
    assert full_prompts(stack.events)[1] == standin.served_prompts[1]
    context = standin.served_prompts[0] + first.completion_ids.tolist()
    assert standin.served_prompts[1][: len(context)] == context
    assert second.prefix_len == len(context)
    # Its new image is one both configs expand alike: this turn is not marked.
    assert other.placeholders(200, 120) == own.placeholders(200, 120)
    assert "prompt_fork" not in second.sampling
    assert [(r.sha256, r.length) for r in second.images] == [(content_digest(more), 28)]


async def test_a_continued_generation_goes_on_after_the_prompt_vllm_read(
    template: ChatTemplate,
) -> None:
    """Aborted (a weight update) after 2 tokens, the turn is sent again as the prompt vLLM
    read plus those tokens, its image collapsed where vLLM placed it: vLLM reads it as sent."""
    shot = png(100, 60)
    own = vision_of(template)
    other = dataclasses.replace(own, min_pixels=own.min_pixels * 16)
    standin = VLLMStandIn(other, completion(template), abort_after=2)
    stack = ImageTurns(template, backend(standin))
    session = await stack.session()
    await stack.turn(session, [user("what is this?", shot)], [shot])
    [event] = stack.events
    first, again = standin.served_prompts
    assert again == first + completion(template)[:2]  # the continuation, expanded alike
    assert full_prompts([event]) == [first]
    assert event.completion_ids.tolist() == completion(template)
    assert event.sampling["continued"][0]["at"] == 2
    assert event.sampling["prompt_fork"]["served_tokens"] == len(first)
    assert stack.metrics.prompt_forks._value.get() == 1


async def test_a_reply_holding_the_image_placeholder_is_continued_from_its_text(
    template: ChatTemplate,
) -> None:
    """A model may sample its own image placeholder (the tiny random one does): kept as
    sampled, its ids beside real images would be one placeholder too many for vLLM (it refuses
    the request: its counts differ) and for the trainer's forward. The next turn is rendered
    from the conversation's text instead, sharing the kept ids up to that token."""
    vision = vision_of(template)
    shot, more = png(100, 60), png(200, 120, "green")
    stray = [*template.encode("A "), vision.image_token_id, *completion(template)]
    standin = VLLMStandIn(vision, stray)
    stack = ImageTurns(template, backend(standin))
    session = await stack.session()
    messages = [user("what is this?", shot)]
    messages.append(await stack.turn(session, messages, [shot]))
    messages.append(user("and now?", more))
    await stack.turn(session, messages, [shot, more])  # refused by vLLM if it held the token
    first, second = stack.events
    prompts = full_prompts(stack.events)
    context = [*prompts[0], *first.completion_ids.tolist()]
    at = context.index(vision.image_token_id, first.images[0].end)  # the sampled one
    assert second.parent_turn == 0 and second.prefix_len == at  # shared up to that token
    assert prompts[1] == template.prompt_ids(messages, None)  # the render of the text
    shown = sum(vision.placeholders(*size)[0] for size in ((100, 60), (200, 120)))
    assert prompts[1].count(vision.image_token_id) == shown
    assert [ref.sha256 for ref in second.images] == [content_digest(more)]
