"""Images on the three API surfaces: each API's image parts checked at the edge and translated
into the canonical conversation's image parts, in order, beside its text parts
(gateway/serving/image_input.py, chat_service, anthropic_input, responses_input)."""

from __future__ import annotations

import asyncio
import base64
import io
from collections.abc import Iterator
from typing import Any

import pytest
from PIL import Image

from gateway.core.conversation import TurnRequest, message_keys
from gateway.errors import InvalidRequest
from gateway.images.limits import ImageLimits
from gateway.protocol.anthropic import MessagesRequest
from gateway.protocol.chat import ChatCompletionRequest
from gateway.protocol.responses import ResponsesRequest
from gateway.serving.anthropic_input import anthropic_images, messages_turn_request
from gateway.serving.chat_service import chat_images, chat_turn_request
from gateway.serving.image_input import FoundImage, KeptImages, check_images
from gateway.serving.responses_input import responses_images, responses_turn_request
from schemas.images import content_digest, image_part

LIMITS = ImageLimits()


def png(width: int, height: int, color: str = "red") -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), color).save(out, "PNG")
    return out.getvalue()


RED, BLUE = png(30, 20, "red"), png(8, 12, "blue")


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def part_of(data: bytes) -> dict[str, Any]:
    with Image.open(io.BytesIO(data)) as image:
        return image_part(content_digest(data), *image.size)


def checked(found: Iterator[FoundImage], limits: ImageLimits = LIMITS) -> dict[str, bytes]:
    return asyncio.run(check_images(found, limits=limits, where="messages"))


# -- Chat Completions ---------------------------------------------------------------------


def chat_image(data: bytes, **extra: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": data_url(data), **extra}}


def chat_turn(body: dict[str, Any], limits: ImageLimits = LIMITS) -> TurnRequest:
    req = ChatCompletionRequest.model_validate(body)
    return chat_turn_request(req, images=checked(chat_images(req), limits))


def test_chat_messages_translate_field_for_field_in_order() -> None:
    """Each message kind as the turn holds it: its fields (None left out) in the order the
    request model declares them, the content a string, None (appended last, as before) or the
    canonical parts; held equal to the dump-and-replace form it replaced."""
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "be brief", "name": "sys"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "content": "42", "tool_call_id": "c1", "extra": 1},
            {"role": "user", "content": [chat_image(RED), {"type": "text", "text": "this?"}]},
        ],
    }
    turn = chat_turn(body)
    req = ChatCompletionRequest.model_validate(body)
    reference = [
        {**m.model_dump(exclude_none=True), "content": turn.messages[i]["content"]}
        for i, m in enumerate(req.messages)
    ]
    assert turn.messages == reference
    assert [list(m) for m in turn.messages] == [list(m) for m in reference]
    assert [m["content"] for m in turn.messages[:4]] == ["be brief", "ab", None, "42"]
    assert list(turn.messages[2]) == ["role", "tool_calls", "content"]
    assert turn.messages[4]["content"] == [part_of(RED), {"type": "text", "text": "this?"}]


def test_chat_image_parts_become_canonical_parts_in_order() -> None:
    content = [
        {"type": "text", "text": "before"},
        chat_image(RED, detail="high"),
        {"type": "text", "text": "between"},
        chat_image(BLUE),
    ]
    turn = chat_turn({"messages": [{"role": "user", "content": content}]})
    assert turn.messages == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "before"},
                part_of(RED),
                {"type": "text", "text": "between"},
                part_of(BLUE),
            ],
        }
    ]
    assert turn.images == {content_digest(RED): RED, content_digest(BLUE): BLUE}


def test_a_tool_message_may_show_a_screenshot() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "screenshot", "arguments": "{}"}}
    body = {
        "messages": [
            {"role": "user", "content": "look"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": [chat_image(RED)]},
        ]
    }
    turn = chat_turn(body)
    assert turn.messages[2] == {"role": "tool", "tool_call_id": "c1", "content": [part_of(RED)]}
    assert turn.messages[0]["content"] == "look"


def test_a_text_conversation_is_what_it_always_was() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    body = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": parts}]}
    turn = chat_turn(body)
    assert turn.messages == [{"content": "s", "role": "system"}, {"content": "ab", "role": "user"}]
    assert turn.images == {}
    assert turn.keys == message_keys(
        [{"role": "system", "content": "s"}, {"role": "user", "content": "ab"}]
    )


def test_a_resent_screenshot_is_checked_once_and_named_by_its_digest() -> None:
    body = {
        "messages": [
            {"role": "user", "content": [chat_image(RED)]},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": [chat_image(RED), {"type": "text", "text": "again"}]},
        ]
    }
    req = ChatCompletionRequest.model_validate(body)
    found = list(chat_images(req))
    assert [where for where, _ in found] == [
        "messages[0].content[0].image_url",
        "messages[2].content[0].image_url",
    ]
    images = checked(iter(found))
    assert list(images) == [content_digest(RED)]
    assert found[0][1].checked is found[1][1].checked  # one check for the same source
    # The message key holds the image's digest: the same request again is a resend, another
    # image is another message.
    again = chat_turn(body)
    other = chat_turn({"messages": [{"role": "user", "content": [chat_image(BLUE)]}]})
    assert chat_turn_request(req, images=images).keys == again.keys
    assert again.keys[0] != other.keys[0]


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("data:image/png;base64,aGVsbG8=", "not a PNG, JPEG, GIF or WebP"),
        ("http://169.254.169.254/latest/meta-data", "does not fetch images from 169.254.169.254"),
        ("file:///etc/passwd", "not an image URL the gateway takes"),
        ("data:image/svg+xml;base64,PHN2Zy8+", "SVG is not"),
    ],
)
def test_a_bad_chat_image_is_a_400_naming_its_part(url: str, words: str) -> None:
    content = [{"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": url}}]
    body = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": content}]}
    with pytest.raises(InvalidRequest, match=words) as caught:
        chat_turn(body)
    assert caught.value.param == "messages[1].content[1].image_url"
    assert str(caught.value).startswith("messages[1].content[1].image_url: ")


def test_too_many_images_are_refused_before_any_is_decoded() -> None:
    content = [chat_image(RED)] * 3 + [{"type": "image_url", "image_url": {"url": "junk"}}]
    with pytest.raises(InvalidRequest, match="4 images in one request") as caught:
        chat_turn({"messages": [{"role": "user", "content": content}]}, ImageLimits(max_images=3))
    assert caught.value.param == "messages"


# -- Anthropic Messages -------------------------------------------------------------------


def anthropic_image(data: bytes, media_type: str = "image/png") -> dict[str, Any]:
    source = {"type": "base64", "media_type": media_type, "data": base64.b64encode(data).decode()}
    return {"type": "image", "source": source, "cache_control": {"type": "ephemeral"}}


def messages_turn(messages: list[dict[str, Any]]) -> TurnRequest:
    req = MessagesRequest.model_validate({"model": "tiny", "max_tokens": 8, "messages": messages})
    return messages_turn_request(req, images=checked(anthropic_images(req)))


def test_anthropic_image_blocks_keep_their_place_among_the_text_blocks() -> None:
    blocks = [
        {"type": "text", "text": "what is"},
        anthropic_image(RED),
        {"type": "text", "text": "?"},
    ]
    turn = messages_turn([{"role": "user", "content": blocks}])
    assert turn.messages == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "what is"},
                part_of(RED),
                {"type": "text", "text": "?"},
            ],
        }
    ]
    assert turn.images == {content_digest(RED): RED}


def test_a_tool_result_screenshot_is_the_tool_messages_and_text_alone_stays_a_string() -> None:
    use = {"type": "tool_use", "id": "tu1", "name": "computer", "input": {"action": "shot"}}
    shot = {
        "type": "tool_result",
        "tool_use_id": "tu1",
        "content": [{"type": "text", "text": "here"}, anthropic_image(BLUE)],
    }
    plain = {
        "type": "tool_result",
        "tool_use_id": "tu2",
        "content": [{"type": "text", "text": "t"}],
    }
    turn = messages_turn(
        [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": [use]},
            {"role": "user", "content": [shot, plain, {"type": "text", "text": "next"}]},
        ]
    )
    assert turn.messages[2:] == [
        {
            "role": "tool",
            "tool_call_id": "tu1",
            "content": [{"type": "text", "text": "here"}, part_of(BLUE)],
        },
        {"role": "tool", "tool_call_id": "tu2", "content": "t"},
        {"role": "user", "content": "next"},
    ]
    assert turn.images == {content_digest(BLUE): BLUE}


@pytest.mark.parametrize(
    ("block", "where", "words"),
    [
        (anthropic_image(RED, "image/jpeg"), "messages[0].content[1].source", "declare image/png"),
        (
            anthropic_image(RED, "image/p\u200bng\U0001f600"),
            "messages[0].content[1].source",
            "not accepted",
        ),
        (
            {"type": "image", "source": {"type": "url", "url": "http://169.254.169.254/"}},
            "messages[0].content[1].source",
            "request forgery",
        ),
        (
            {"type": "tool_result", "tool_use_id": "t", "content": [anthropic_image(b"GIF89a")]},
            "messages[0].content[1].content[0].source",
            "damaged or truncated",
        ),
    ],
)
def test_a_bad_anthropic_image_is_a_400_naming_its_block(
    block: dict[str, Any], where: str, words: str
) -> None:
    with pytest.raises(InvalidRequest, match=words) as caught:
        messages_turn([{"role": "user", "content": [{"type": "text", "text": "x"}, block]}])
    assert caught.value.param == where


# -- Responses ----------------------------------------------------------------------------


def responses_turn(
    body: dict[str, Any], previous: list[dict[str, Any]] | None = None
) -> TurnRequest:
    req = ResponsesRequest.model_validate(body)
    images = asyncio.run(check_images(responses_images(req), limits=LIMITS, where="input"))
    return responses_turn_request(req, previous or [], images)


def test_responses_input_images_in_messages_and_function_call_outputs() -> None:
    image = {"type": "input_image", "image_url": data_url(RED), "detail": "auto"}
    body = {
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "see"}, image]},
            {"type": "function_call", "call_id": "c", "name": "shot", "arguments": "{}"},
            {
                "type": "function_call_output",
                "call_id": "c",
                "output": [{"type": "input_image", "image_url": data_url(BLUE)}],
            },
            {"role": "user", "content": "plain"},
        ]
    }
    req = ResponsesRequest.model_validate(body)
    assert [w for w, _ in responses_images(req)] == [
        "input[0].content[1].image_url",
        "input[2].output[0].image_url",
    ]
    turn = responses_turn(body)
    assert turn.messages[0] == {
        "role": "user",
        "content": [{"type": "text", "text": "see"}, part_of(RED)],
    }
    assert turn.messages[2] == {"role": "tool", "tool_call_id": "c", "content": [part_of(BLUE)]}
    assert turn.messages[3] == {"role": "user", "content": "plain"}
    assert set(turn.images) == {content_digest(RED), content_digest(BLUE)}


def test_an_assistant_message_item_with_an_image_is_refused() -> None:
    image = {"type": "input_image", "image_url": data_url(RED)}
    with pytest.raises(InvalidRequest, match="assistant message with an input_image"):
        responses_turn({"input": [{"role": "assistant", "content": [image]}]})


def test_kept_images_supply_a_continued_conversations_bytes_until_forgotten() -> None:
    kept = KeptImages(max_bytes=len(RED) + len(BLUE))
    kept.keep({content_digest(RED): RED})
    previous = [{"role": "user", "content": [part_of(RED)]}, {"role": "assistant", "content": "a"}]
    assert kept.bytes_of(previous, {}, named="p", param="x") == {content_digest(RED): RED}
    assert kept.bytes_of(previous, {content_digest(RED): RED}, named="p", param="x") == {}
    kept.keep({content_digest(BLUE): BLUE, "0" * 64: b"x" * 100})  # RED is the oldest: out
    with pytest.raises(InvalidRequest, match="resend the full conversation") as caught:
        kept.bytes_of(previous, {}, named="previous_response_id 'resp_s_1'", param="x")
    assert caught.value.param == "x"


def test_a_screenshot_resent_in_a_later_request_is_not_decoded_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kept = KeptImages(max_bytes=len(RED) + len(BLUE))
    body = {"messages": [{"role": "user", "content": [chat_image(RED)]}]}

    def check(source: dict[str, Any]) -> dict[str, bytes]:
        req = ChatCompletionRequest.model_validate(source)
        return asyncio.run(check_images(chat_images(req), limits=LIMITS, where="m", kept=kept))

    assert check(body) == {content_digest(RED): RED}

    def decoded(*_: object, **__: object) -> None:
        raise AssertionError("decoded again")

    monkeypatch.setattr("gateway.serving.image_input.image_from_data_url", decoded)
    assert check(body) == {content_digest(RED): RED}  # remembered: its text's hash, no decode
    # Its bytes forgotten (the memory's bound), the source is checked again.
    kept.keep({"0" * 64: b"x" * (len(RED) + len(BLUE))})
    with pytest.raises(AssertionError, match="decoded again"):
        check(body)
