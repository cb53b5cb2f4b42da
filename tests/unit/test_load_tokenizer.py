"""``gateway.templates.load_tokenizer`` loads what ``AutoTokenizer.from_pretrained`` loads.

It skips AutoTokenizer (whose module imports torch) only for a directory whose
tokenizer_config.json names the plain fast tokenizer; the tokenizer it returns must be the same
as AutoTokenizer's in every way the gateway, ``inspect`` and ``export`` use one. Checked on the
built-in tiny model (no merges), a locally trained BPE and a directory that names another class.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from gateway.templates import ChatTemplate, load_tokenizer
from tests.helpers.bpe_model import bpe_model_dir
from tests.helpers.tiny_model import WEATHER_TOOLS, WEATHER_TRANSCRIPT

TEXTS = [
    "",
    "plain words, the end.",
    "  spaces  and\ttabs\n\nnewlines ",
    "émoji 🧪 RTL שלום عربى 中文 \u200b zero-width",
    "<|im_start|>user\nspecial tokens inside text<|im_end|>\n<tool_call>{}</tool_call>",
]


def same_tokenizer(dir: Path) -> tuple[Any, Any]:
    loaded, auto = load_tokenizer(dir), AutoTokenizer.from_pretrained(dir)
    assert type(loaded) is type(auto)
    assert loaded.get_vocab() == auto.get_vocab()
    assert loaded.all_special_ids == auto.all_special_ids
    assert loaded.eos_token_id == auto.eos_token_id and loaded.pad_token_id == auto.pad_token_id
    assert loaded.model_max_length == auto.model_max_length
    assert loaded.chat_template == auto.chat_template
    for text in TEXTS:
        ids = loaded.encode(text, add_special_tokens=False)
        assert ids == auto.encode(text, add_special_tokens=False)
        assert loaded(text)["input_ids"] == auto(text)["input_ids"]
        for skip in (False, True):
            assert loaded.decode(ids, skip_special_tokens=skip) == auto.decode(
                ids, skip_special_tokens=skip
            )
        assert loaded.batch_decode([[i] for i in ids]) == auto.batch_decode([[i] for i in ids])
    for messages in (WEATHER_TRANSCRIPT[:2], WEATHER_TRANSCRIPT):
        for prompt in (False, True):
            rendered = {
                tok.apply_chat_template(
                    messages, tools=WEATHER_TOOLS, tokenize=False, add_generation_prompt=prompt
                )
                for tok in (loaded, auto)
            }
            assert len(rendered) == 1
    return loaded, auto


def test_the_tiny_models_tokenizer_is_autotokenizers(tiny_model_dir: Path) -> None:
    loaded, auto = same_tokenizer(tiny_model_dir)
    # The gateway's template over either decodes through the same fast path.
    assert ChatTemplate(loaded).decode([65, 48]) == ChatTemplate(auto).decode([65, 48]) == "A0"


def test_a_trained_bpe_tokenizer_is_autotokenizers(tmp_path: Path) -> None:
    model = bpe_model_dir(tmp_path / "bpe")
    assert json.loads((model / "tokenizer_config.json").read_text())["tokenizer_class"] in {
        "TokenizersBackend",
        "PreTrainedTokenizerFast",
    }
    same_tokenizer(model)


@pytest.mark.parametrize("config", ["named-other", "no-config", "bad-config"])
def test_any_other_directory_goes_through_autotokenizer(
    tiny_model_dir: Path, tmp_path: Path, config: str
) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    path = model / "tokenizer_config.json"
    if config == "named-other":  # a class of its own: AutoTokenizer resolves it
        path.write_text(
            json.dumps({**json.loads(path.read_text()), "tokenizer_class": "Qwen2Tokenizer"})
        )
    elif config == "no-config":
        path.unlink()
    else:
        path.write_text("[not a json object")
        with pytest.raises(ValueError):  # as AutoTokenizer itself fails on it
            load_tokenizer(model)
        return
    same_tokenizer(model)


def test_loading_a_plain_tokenizer_imports_no_torch(tiny_model_dir: Path) -> None:
    probe = (
        "import sys; from pathlib import Path; from gateway.templates import load_tokenizer; "
        f"load_tokenizer(Path({str(tiny_model_dir)!r})); print('torch' in sys.modules)"
    )
    ran = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    assert ran.stdout.strip() == "False", ran.stderr[-2000:]
