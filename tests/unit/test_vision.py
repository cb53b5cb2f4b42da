"""Images in the prompt's tokens: expanded as the model's own processor expands them, a continued
turn expanding only its new images, and events naming each image once (issue 39, point 3)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from gateway.core.aggregate import TurnDraft, apply, fold, turn_event
from gateway.errors import InvalidRequest
from gateway.images import VisionSpec
from gateway.model.tiny_vl import IMAGE_PAD, ensure_tiny_vl_model
from gateway.templates import ChatTemplate, load_tokenizer
from schemas.events import SessionOpened
from schemas.images import content_digest, image_parts, sniff_mime
from tests.helpers.image_turns import png, user

JSON = dict[str, Any]


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_vl_model(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def template(vl_dir: Path) -> ChatTemplate:
    vision = VisionSpec.load(vl_dir)
    assert vision is not None
    return ChatTemplate(load_tokenizer(vl_dir), vision=vision)


@pytest.mark.parametrize("size", [(100, 60), (28, 28), (1, 1), (640, 480), (1920, 1080), (3, 500)])
def test_placeholders_are_the_processors_own(vl_dir: Path, size: tuple[int, int]) -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    processor = Qwen2VLImageProcessorPil.from_pretrained(vl_dir)
    vision = VisionSpec.load(vl_dir)
    assert vision is not None
    grid = processor(images=[Image.new("RGB", size, "blue")], return_tensors="pt")["image_grid_thw"]
    n, own = vision.placeholders(*size)
    assert list(own) == grid[0].tolist()
    assert n == int(grid[0].prod()) // processor.merge_size**2


def test_a_text_model_has_no_vision(tmp_path: Path) -> None:
    from gateway.model import ensure_tiny_model

    assert VisionSpec.load(ensure_tiny_model(tmp_path)) is None


def test_each_placeholder_expands_to_its_images_run(template: ChatTemplate) -> None:
    a, b = png(100, 60), png(640, 480, "green")
    messages = [user("look", a), user("and", b)]
    ids = template.prompt_ids(messages, None)
    assert template.vision is not None
    pad = template.vision.image_token_id
    runs = [template.vision.placeholders(100, 60)[0], template.vision.placeholders(640, 480)[0]]
    assert ids.count(pad) == sum(runs)
    images = template.vision.locate(
        np.asarray(ids), list(image_parts(messages)), {content_digest(a): a, content_digest(b): b}
    )
    assert [i.ref.length for i in images] == runs
    assert [i.ref.sha256 for i in images] == [content_digest(a), content_digest(b)]
    assert all(ids[i.ref.offset : i.ref.end] == [pad] * i.ref.length for i in images)
    assert images[0].ref.mime == sniff_mime(a) == "image/png"


def test_a_continued_turn_expands_only_its_new_images(template: ChatTemplate) -> None:
    a, b = png(100, 60), png(200, 120, "green")
    first = [user("look", a)]
    reply = {"role": "assistant", "content": "a red box"}
    completion = template.encode("a red box<|im_end|>")
    suffix = template.continuation_ids([*first, reply], completion, [user("now", b)], None)
    assert suffix is not None
    whole = template.prompt_ids([*first, reply, user("now", b)], None)
    kept = template.prompt_ids(first, None) + completion
    assert kept + suffix == whole  # the kept ids + the new messages' ids: the full render's


@pytest.mark.parametrize(
    "text",
    [IMAGE_PAD, f"a{IMAGE_PAD}b", f"{IMAGE_PAD}{IMAGE_PAD}"],
)
def test_text_holding_the_image_token_is_refused(template: ChatTemplate, text: str) -> None:
    with pytest.raises(InvalidRequest, match="image token"):
        template.prompt_ids([user(text, png(50, 50))], None)
    with pytest.raises(InvalidRequest, match="image token"):
        template.prompt_ids([{"role": "user", "content": text}], None)


def _draft(
    template: ChatTemplate, messages: list[JSON], data: dict[str, bytes], **kw: Any
) -> TurnDraft:
    ids = template.prompt_ids(messages, None)
    assert template.vision is not None
    images = template.vision.locate(np.asarray(ids), list(image_parts(messages)), data)
    return TurnDraft(
        prompt_ids=ids,
        messages=messages,
        tools=None,
        completion_ids=[5],
        logprobs=[-0.5],
        images=tuple(i.ref for i in images),
        **kw,
    )


def test_events_name_each_image_once_and_recovery_rebuilds_them(template: ChatTemplate) -> None:
    shot, new = png(100, 60), png(100, 60, "white")  # same size: the same placeholder tokens
    data = {content_digest(shot): shot, content_digest(new): new}
    state = apply(None, SessionOpened(run="r", session="s"))
    assert state is not None
    first = turn_event(state, _draft(template, [user("a", shot)], data))
    state = apply(state, first)
    assert state is not None
    assert [r.sha256 for r in first.images] == [content_digest(shot)]
    convo = [*state.nodes[0].conversation, user("b", shot, new)]
    second = turn_event(state, _draft(template, convo, data, parent_turn=0))
    assert second.prefix_len > first.images[0].end  # the first screenshot is inherited
    assert [r.sha256 for r in second.images] == [content_digest(shot), content_digest(new)]
    state = apply(state, second)
    assert state is not None
    assert [r.sha256 for r in state.nodes[1].images] == [content_digest(shot)] * 2 + [
        content_digest(new)
    ]
    # A prompt sharing the first turn's tokens with ANOTHER image of the same size: the shared
    # tokens are the same, the image is not; the prefix stops before it.
    other = turn_event(state, _draft(template, [user("a", new)], data))
    assert other.prefix_len == first.images[0].offset
    assert [r.sha256 for r in other.images] == [content_digest(new)]
    recovered = fold([SessionOpened(run="r", session="s"), first, second])
    assert recovered is not None
    assert recovered.nodes[1].images == state.nodes[1].images
