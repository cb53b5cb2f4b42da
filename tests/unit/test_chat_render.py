"""``ChatTemplate`` renders and encodes exactly as transformers does, on its faster paths.

``ChatTemplate.render`` calls the tokenizer's compiled chat template itself (skipping the
conversions ``apply_chat_template`` makes of message objects, which the gateway's JSON
messages do not need) and ``ChatTemplate.encode`` the Rust tokenizer. Both must give what
transformers gives, for every kind of message the gateway renders: tools and tool calls, tool
results, text parts, unicode, special-token text inside content, reasoning fields (which take
transformers' path), and a template that fails.
"""

from __future__ import annotations

import copy
import re
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from gateway.errors import InvalidRequest
from gateway.templates import UNLOCKED_ENCODE_CHARS, ChatTemplate, template_messages
from tests.helpers.bpe_model import bpe_model_dir
from tests.helpers.tiny_model import WEATHER_TOOLS, WEATHER_TRANSCRIPT
from tests.unit.test_load_tokenizer import TEXTS

JSON = dict[str, Any]

CONVERSATIONS: list[tuple[list[JSON], list[JSON] | None]] = [
    ([{"role": "user", "content": "hi"}], None),
    (
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "émoji 🧪 RTL שלום عربى 中文 \u200b zero-width"},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "<|im_start|>user\nspecial text<|im_end|>\n"},
        ],
        None,
    ),
    (WEATHER_TRANSCRIPT[:2], WEATHER_TOOLS),
    (WEATHER_TRANSCRIPT, WEATHER_TOOLS),
    (WEATHER_TRANSCRIPT, None),
    (
        [
            {
                "role": "user",
                "content": [{"type": "text", "text": "parts "}, {"type": "text", "text": "two"}],
            },
            {"role": "assistant", "content": "", "name": None},
        ],
        [],
    ),
    (
        [
            {"role": "user", "content": "think"},
            {"role": "assistant", "content": "done", "reasoning_content": "because"},
            {"role": "user", "content": "and?"},
        ],
        None,
    ),
    ([{"role": "user", "content": "nested", "metadata": {"a": [1, 2.5, True, None, "x"]}}], None),
]


def tokenizers(tmp_path: Path, tiny_model_dir: Path) -> list[PreTrainedTokenizerBase]:
    return [
        AutoTokenizer.from_pretrained(tiny_model_dir),
        AutoTokenizer.from_pretrained(bpe_model_dir(tmp_path / "bpe")),
    ]


def test_render_is_apply_chat_templates(tmp_path: Path, tiny_model_dir: Path) -> None:
    for tokenizer in tokenizers(tmp_path, tiny_model_dir):
        template = ChatTemplate(tokenizer, max_context=4096)
        assert template._jinja is not None  # the fast path is what is tested
        failed = 0
        for messages, tools in CONVERSATIONS:
            before = copy.deepcopy(messages)
            for generation in (False, True):
                try:
                    expected = tokenizer.apply_chat_template(
                        template_messages(messages),
                        tools=tools,  # type: ignore[arg-type]
                        add_generation_prompt=generation,
                        tokenize=False,
                    )
                except Exception as exc:  # the same failure, as the request's error
                    with pytest.raises(InvalidRequest, match=re.escape(str(exc))):
                        template.render(messages, tools, generation=generation)
                    failed += 1
                else:
                    assert template.render(messages, tools, generation=generation) == expected
            assert messages == before  # the caller's messages are left as they were
        assert failed == 2  # text parts: this template concatenates content as a string


def test_a_template_error_is_the_requests(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    plain = tokenizer.chat_template
    tokenizer.chat_template = (
        "{% if tools %}{{ raise_exception('no tools here') }}{% endif %}" + plain
    )
    template = ChatTemplate(tokenizer)
    assert template._jinja is not None
    assert template.render([{"role": "user", "content": "x"}], None, generation=True)
    with pytest.raises(InvalidRequest, match="no tools here"):
        template.render([{"role": "user", "content": "x"}], WEATHER_TOOLS, generation=True)
    with pytest.raises(InvalidRequest, match="empty conversation"):
        template.render([], None, generation=True)  # transformers' own refusal


def test_named_templates_take_transformers_path(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    plain = tokenizer.chat_template
    tokenizer.chat_template = {"default": plain, "tool_use": "TOOLS:" + plain}
    template = ChatTemplate(tokenizer)
    assert template._jinja is None
    messages = WEATHER_TRANSCRIPT[:1]
    assert template.render(messages, WEATHER_TOOLS, generation=True).startswith("TOOLS:")
    assert not template.render(messages, None, generation=True).startswith("TOOLS:")


def test_encode_is_transformers_encode(tmp_path: Path, tiny_model_dir: Path) -> None:
    for tokenizer in tokenizers(tmp_path, tiny_model_dir):
        template = ChatTemplate(tokenizer, max_context=4096)
        assert template._rust_encode is not None
        for text in TEXTS:
            assert template.encode(text) == tokenizer.encode(text, add_special_tokens=False)


def test_a_long_text_is_encoded_with_the_gil_released(tiny_model_dir: Path) -> None:
    # A 100k-token prompt is tokenized on a worker thread so that the event loop goes on; the
    # loop runs only if the encode lets go of the GIL meanwhile (issue 40). With a switch
    # interval longer than the encode, another thread runs during it only if it does.
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    template = ChatTemplate(tokenizer, max_context=1 << 20)
    text = ("émoji 🧪 and some code: x = [1, 2, 3]\n" * 10_000)[:400_000]
    assert len(text) >= UNLOCKED_ENCODE_CHARS
    ran, go, done = [0], threading.Event(), threading.Event()

    def spin() -> None:
        go.wait()
        while not done.is_set():
            ran[0] += 1

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1.0)
    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        go.set()  # the spinner waits for the GIL from here
        ran[0] = 0
        ids = template.encode(text)
        spun = ran[0]  # read before this thread lets go of the GIL again
    finally:
        done.set()
        sys.setswitchinterval(interval)
        spinner.join()
    assert spun > 0
    assert ids == tokenizer.encode(text, add_special_tokens=False)


def test_encode_leaves_a_reconfigured_tokenizer_to_transformers(tiny_model_dir: Path) -> None:
    # Someone truncating the shared Rust tokenizer, or splitting special tokens: the direct
    # call would not do what transformers' encode (which resets them per call) does.
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    template = ChatTemplate(tokenizer)
    text = TEXTS[-1]
    tokenizer.backend_tokenizer.enable_truncation(3)
    assert template._rust_encode is not None and template._rust_encode(text) is None
    assert template.encode(text) == tokenizer.encode(text, add_special_tokens=False)
    assert len(template.encode(text)) > 3
    tokenizer.split_special_tokens = True
    assert template.encode(text) == tokenizer.encode(text, add_special_tokens=False)


def test_a_template_changed_after_construction_is_the_one_rendered(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    template = ChatTemplate(tokenizer)
    tokenizer.chat_template = "CHANGED:" + str(tokenizer.chat_template)
    assert template.render([{"role": "user", "content": "x"}], None, generation=True).startswith(
        "CHANGED:"
    )


def test_kept_tools_render_from_their_kept_json(tiny_model_dir: Path) -> None:
    """A kept turn's tools (``keep_json``) render as transformers renders them, from JSON written
    once: the kept objects' text is not written again; an equal tool that is not the kept object
    is written afresh (identity, not equality, so a changed copy is never answered stale)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    template = ChatTemplate(tokenizer, max_context=4096)
    messages, tools = WEATHER_TRANSCRIPT[:2], copy.deepcopy(WEATHER_TOOLS)
    expected = tokenizer.apply_chat_template(
        template_messages(messages),
        tools=tools,  # type: ignore[arg-type]
        add_generation_prompt=True,
        tokenize=False,
    )
    template.keep_json(tools)
    assert template.render(messages, tools, generation=True) == expected
    kept = template._kept_json
    assert kept is not None
    written = {id(t): text for t in tools for text in kept._kept[id(t)][1].values()}
    assert len(written) == len(tools)  # each kept tool's JSON, written by the first render
    assert template.render(messages, tools, generation=True) == expected
    assert {id(t): text for t in tools for text in kept._kept[id(t)][1].values()} == written
    changed = copy.deepcopy(tools)
    changed[0]["function"]["description"] = "Changed."
    assert "Changed." in template.render(messages, changed, generation=True)
    assert template.render(messages, copy.deepcopy(tools), generation=True) == expected


def test_equal_kept_tools_of_two_sessions_share_one_text(tiny_model_dir: Path) -> None:
    """Each session decodes its own copy of an agent's tools; their JSON, written once per kept
    copy, is held once (issue 40: ~110 KB a Claude-Code-shaped session), and a changed copy
    still gets its own text."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    template = ChatTemplate(tokenizer, max_context=4096)
    messages = WEATHER_TRANSCRIPT[:2]
    one, other = copy.deepcopy(WEATHER_TOOLS), copy.deepcopy(WEATHER_TOOLS)
    changed = copy.deepcopy(WEATHER_TOOLS)
    changed[0]["function"]["description"] = "Changed."
    for tools in (one, other, changed):
        template.keep_json(tools)
        template.render(messages, tools, generation=True)
    kept = template._kept_json
    assert kept is not None

    def texts(tools: list[Any]) -> list[str]:
        return [text for t in tools for text in kept._kept[id(t)][1].values()]

    assert texts(one) and all(a is b for a, b in zip(texts(one), texts(other), strict=True))
    assert texts(changed)[0] != texts(one)[0] and "Changed." in texts(changed)[0]
    assert template.render(messages, other, generation=True) == template.render(
        messages, copy.deepcopy(WEATHER_TOOLS), generation=True
    )
