"""The tiny default model: created locally, loaded like a real one, with a real chat template."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from gateway.model import ensure_tiny_model, tiny_model_dir
from tests.helpers.tiny_model import WEATHER_TOOLS, WEATHER_TRANSCRIPT, render_ids


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _render(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], **kw: Any) -> str:
    text = tokenizer.apply_chat_template(messages, tokenize=False, **kw)
    assert isinstance(text, str)
    return text


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_loads_with_from_pretrained_like_a_real_model(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert model.config.model_type == "qwen3"
    assert model.config.vocab_size % 64 == 0
    assert len(tokenizer) <= model.config.vocab_size < len(tokenizer) + 64
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    assert set(model.generation_config.eos_token_id) == {
        tokenizer.convert_tokens_to_ids("<|im_end|>"),
        tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    }
    assert tokenizer.model_max_length == model.config.max_position_embeddings == 4096


def test_second_call_reuses_the_model(tmp_path: Path) -> None:
    first = ensure_tiny_model(tmp_path)
    weights = first / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    assert ensure_tiny_model(tmp_path) == first == tiny_model_dir(tmp_path)
    assert weights.stat().st_mtime_ns == mtime
    # Nothing is left behind by the temp-dir-then-rename creation.
    assert [p.name for p in tmp_path.iterdir()] == [first.name]


def test_damaged_model_dir_is_rebuilt(tmp_path: Path) -> None:
    path = ensure_tiny_model(tmp_path)
    digest = _sha256(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    assert ensure_tiny_model(tmp_path) == path
    assert _sha256(path / "model.safetensors") == digest


def test_same_seed_gives_identical_weight_bytes(tmp_path: Path) -> None:
    a = ensure_tiny_model(tmp_path / "a", seed=3)
    b = ensure_tiny_model(tmp_path / "b", seed=3)
    c = ensure_tiny_model(tmp_path / "c", seed=4)
    assert _sha256(a / "model.safetensors") == _sha256(b / "model.safetensors")
    assert _sha256(a / "model.safetensors") != _sha256(c / "model.safetensors")
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()


def test_head_dim_64_variant_is_another_model_with_the_same_tokenizer(tmp_path: Path) -> None:
    """vLLM's CPU attention refuses head_dim 16; the deploy tests serve the head_dim-64 one."""
    default = ensure_tiny_model(tmp_path)
    wide = ensure_tiny_model(tmp_path, head_dim=64)
    assert wide == tiny_model_dir(tmp_path, head_dim=64) != default == tiny_model_dir(tmp_path)
    config = json.loads((wide / "config.json").read_text())
    shape = ("head_dim", "num_attention_heads", "num_key_value_heads", "hidden_size")
    assert [config[k] for k in shape] == [64, 2, 1, 128]
    default_config = json.loads((default / "config.json").read_text())
    assert [default_config[k] for k in shape] == [16, 4, 2, 64]  # unchanged by the parameter
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (wide / name).read_bytes() == (default / name).read_bytes()


@settings(max_examples=300, deadline=None)
@given(text=st.text())
def test_tokenizer_round_trips_any_text(tokenizer: PreTrainedTokenizerBase, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text


@pytest.mark.parametrize(
    "text",
    ["e\u0301", "\u212b", "ﬁ", "\x00\r\n\t", "🎉𝔘", "  leading and trailing  ", "ｆｕｌｌ"],
)
def test_tokenizer_does_not_normalize(tokenizer: PreTrainedTokenizerBase, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert len(ids) == len(text.encode())  # one token per byte, no merges


def test_byte_ids_are_the_byte_values(tokenizer: PreTrainedTokenizerBase) -> None:
    assert tokenizer.encode("A é", add_special_tokens=False) == list("A é".encode())


@pytest.mark.parametrize(
    ("token", "special"),
    [
        ("<|endoftext|>", True),
        ("<|im_start|>", True),
        ("<|im_end|>", True),
        ("<tool_call>", False),
        ("</tool_call>", False),
    ],
)
def test_chat_tokens_are_single_ids(
    tokenizer: PreTrainedTokenizerBase, token: str, special: bool
) -> None:
    ids = tokenizer.encode(f"a{token}b", add_special_tokens=False)
    assert len(ids) == 3
    assert tokenizer.convert_ids_to_tokens(ids[1]) == token
    # Like Qwen, the tool-call markers survive skip_special_tokens: the parser needs them.
    kept = tokenizer.decode(ids, skip_special_tokens=True)
    assert kept == ("ab" if special else f"a{token}b")


def test_template_renders_tools_calls_and_responses(tokenizer: PreTrainedTokenizerBase) -> None:
    messages = [
        *WEATHER_TRANSCRIPT[:3],
        {"role": "tool", "tool_call_id": "call_1", "content": "second result"},
        WEATHER_TRANSCRIPT[3],
    ]
    text = _render(tokenizer, messages, tools=WEATHER_TOOLS, add_generation_prompt=True)
    tools_json = json.dumps(WEATHER_TOOLS[0])
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n\n")
    assert f"<tools>\n{tools_json}\n</tools>" in text
    assert (
        "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    ) in text
    assert "<|im_start|>user\nWhat is the weather in Paris?<|im_end|>\n" in text
    assert (
        "<|im_start|>assistant\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
    ) in text
    # Consecutive tool results share one user turn.
    assert (
        "<|im_start|>user\n<tool_response>\n"
        '{"temp_c": 18, "sky": "sunny"}\n</tool_response>\n'
        "<tool_response>\nsecond result\n</tool_response><|im_end|>\n"
    ) in text
    assert text.endswith(
        "<|im_start|>assistant\nIt is 18°C and sunny in Paris.<|im_end|>\n<|im_start|>assistant\n"
    )


def test_template_takes_arguments_as_json_string_or_object(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    as_object = json.loads(json.dumps(WEATHER_TRANSCRIPT[:2]))
    as_object[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    assert _render(tokenizer, as_object, tools=WEATHER_TOOLS) == _render(
        tokenizer, WEATHER_TRANSCRIPT[:2], tools=WEATHER_TOOLS
    )


def test_template_without_tools(tokenizer: PreTrainedTokenizerBase) -> None:
    hello = [{"role": "user", "content": "hi"}]
    assert _render(tokenizer, hello, add_generation_prompt=True) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    with_system = [{"role": "system", "content": "Be terse."}, *hello]
    assert _render(tokenizer, with_system).startswith(
        "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nhi"
    )
    assert "Be terse.\n\n# Tools" in _render(tokenizer, with_system, tools=WEATHER_TOOLS)


def test_each_turn_extends_the_previous_context(tokenizer: PreTrainedTokenizerBase) -> None:
    """What the gateway's delta encoding relies on: the prompt of a turn followed by the
    assistant's reply is a prefix of the next rendering (up to the reply's <|im_end|>)."""
    for i, message in enumerate(WEATHER_TRANSCRIPT):
        if message["role"] != "assistant":
            continue
        prompt = render_ids(
            tokenizer, WEATHER_TRANSCRIPT[:i], WEATHER_TOOLS, add_generation_prompt=True
        )
        after = render_ids(
            tokenizer, WEATHER_TRANSCRIPT[: i + 1], WEATHER_TOOLS, add_generation_prompt=False
        )
        assert after[: len(prompt)] == prompt
