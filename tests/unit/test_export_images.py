"""A ``messages`` export row that shows images round-trips through the vision model's chat
template (issue 39, point 5): the check renders the canonical image parts, whose sizes set the
placeholder counts, and expands them as the gateway did; the exported ``{"type": "image"}``
placeholders render as the same image markers, so a trainer's template sees the same text."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pytest
from PIL import Image

from consumers.export import Fidelity, convert_messages
from gateway.model.tiny_vl import ensure_tiny_vl_model
from schemas.images import content_digest, image_part
from turnstream.data.export import TemplateRenderer, load_renderer

JSON = dict[str, Any]


@pytest.fixture(scope="module")
def renderer(tmp_path_factory: pytest.TempPathFactory) -> TemplateRenderer:
    return load_renderer(ensure_tiny_vl_model(tmp_path_factory.mktemp("models")))


def png(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), "green").save(out, format="PNG")
    return out.getvalue()


def test_an_image_row_round_trips_with_the_vision_template(renderer: TemplateRenderer) -> None:
    template = renderer.template
    assert template.vision is not None
    shot = png(64, 48)
    messages: list[JSON] = [
        {"role": "user", "content": [
            image_part(content_digest(shot), 64, 48), {"type": "text", "text": "what is this?"}
        ]},
    ]  # fmt: skip
    # The sample as the gateway records it: the expanded prompt, then the sampled reply.
    prompt = template.prompt_ids(messages, None)
    reply = [*template.encode("a green square"), *template.stop_token_ids[:1]]
    input_ids = np.asarray([*prompt, *reply])
    length, _ = template.vision.placeholders(64, 48)
    assert list(prompt).count(template.vision.image_token_id) == length > 1
    conversation = [*messages, {"role": "assistant", "content": "a green square"}]

    converted = convert_messages(conversation, parts=True)

    assert converted.images == [content_digest(shot)]
    assert converted.messages[0]["content"] == [
        {"type": "image", "text": None}, {"type": "text", "text": "what is this?"}
    ]  # fmt: skip
    fidelity = Fidelity()
    assert fidelity.check(renderer, ("t", converted.checked, [], input_ids, "{}"))
    # The exported rows, as a trainer's processor renders them (HF's apply_chat_template, the
    # nulls of the fixed shape included): the same text; the sizes are what the check needs.
    rendered = template.render(converted.checked, None, generation=False)
    as_trained = template.tokenizer.apply_chat_template(converted.messages, tokenize=False)
    assert as_trained == rendered
    assert not fidelity.check(renderer, ("t", converted.messages, [], input_ids, "{}"))
    assert fidelity.summary()["round_trips"] == 1
