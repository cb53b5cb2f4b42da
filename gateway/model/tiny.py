"""The default model: tiny, seeded, created on this machine, loaded exactly like a real one.

Nothing is downloaded (DESIGN §4): ``ensure_tiny_model`` writes a Hugging Face model directory
— a byte-level BPE tokenizer whose ChatML special tokens and tool-calling chat template are real
(Qwen2.5's conventions), and a two-layer ``Qwen3`` causal LM with seeded random weights — and
every consumer then loads it with ``AutoTokenizer`` / ``AutoModelForCausalLM.from_pretrained``.
Its output is noise until a test (or a trainer) fits it, but every code path it exercises is the
one a real model takes: special tokens are single ids, tool calls are text between
``<tool_call>`` tokens, ``<|im_end|>`` ends a turn.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch and transformers are imported only to build the model (~3 s): the
    # commands that look the directory up (export, inspect, train) or find it built need neither
    from transformers import PreTrainedModel, PreTrainedTokenizerFast

__all__ = [
    "CHATML_TOOLS_TEMPLATE",
    "TINY_MODEL_NAME",
    "TINY_MODEL_VERSION",
    "ensure_tiny_model",
    "tiny_model_dir",
]

# Bump when anything below changes what is written: old cache dirs are then simply not reused.
TINY_MODEL_VERSION = 1
TINY_MODEL_NAME = "tiny-chatml"

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
_MAX_CONTEXT = 4096
_HEAD_DIM = 16

# Files whose presence makes a directory a complete model. The directory only ever appears by an
# atomic rename of a finished temp dir, so a partial one means outside damage.
_REQUIRED_FILES = (
    "chat_template.jinja",
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)

# Qwen2.5's template, with one change: ``arguments`` given as a JSON string (the OpenAI wire
# format) are inserted verbatim instead of being JSON-encoded a second time.
CHATML_TOOLS_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- '\\n\\n# Tools\\n\\n' }}
    {{- 'You may call one or more functions to assist with the user query.\\n\\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and ' }}
    {{- 'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n' }}
    {{- '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user'
        or (message.role == 'system' and not loop.first)
        or (message.role == 'assistant' and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {%- if tool_call.arguments is string %}
                {{- tool_call.arguments }}
            {%- else %}
                {{- tool_call.arguments | tojson }}
            {%- endif %}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {#- Consecutive tool results share one user turn, as in Qwen2.5. #}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def tiny_model_dir(cache_dir: Path, seed: int = 0, *, head_dim: int = _HEAD_DIM) -> Path:
    """Where ``ensure_tiny_model(cache_dir, seed, head_dim=...)`` keeps its model."""
    shape = "" if head_dim == _HEAD_DIM else f"-hd{head_dim}"
    return Path(cache_dir) / f"{TINY_MODEL_NAME}-v{TINY_MODEL_VERSION}-seed{seed}{shape}"


def ensure_tiny_model(cache_dir: Path, seed: int = 0, *, head_dim: int = _HEAD_DIM) -> Path:
    """Return the tiny model's directory under ``cache_dir``, creating it on first use.

    Creation writes into a temporary sibling directory and renames it into place, so a reader
    (or a concurrent creator) sees either no model or a complete one. The same ``seed`` gives
    byte-identical weights. ``head_dim`` 64 gives the variant vLLM's CPU attention serves (it
    refuses head_dim 16): same tokenizer and chat template, 2 heads of 64 (see _heads).
    """
    target = tiny_model_dir(cache_dir, seed, head_dim=head_dim)
    if _is_complete(target):
        return target
    if target.exists():
        shutil.rmtree(target)  # damaged from outside: see _REQUIRED_FILES
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        _write_model(staging, seed, head_dim)
        try:
            os.rename(staging, target)
        except OSError:
            # Another process renamed its finished copy first; theirs is as good as ours.
            if not _is_complete(target):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _is_complete(path: Path) -> bool:
    return all((path / name).is_file() for name in _REQUIRED_FILES)


def _write_model(path: Path, seed: int, head_dim: int) -> None:
    tokenizer = _build_tokenizer()
    tokenizer.save_pretrained(path)
    _build_model(tokenizer, seed, head_dim).save_pretrained(path, safe_serialization=True)


def _build_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    # Ids 0..255 are the bytes themselves (in GPT-2's printable byte alphabet), with no merges:
    # any UTF-8 text round-trips, and a token is never more than one byte.
    alphabet: dict[int, str] = bytes_to_unicode()  # type: ignore[no-untyped-call]  # untyped
    core = Tokenizer(models.BPE(vocab={alphabet[b]: b for b in range(256)}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in (ENDOFTEXT, IM_START, IM_END)]
    )
    # Like Qwen2.5, the tool-call markers are added but not special: skip_special_tokens keeps
    # them in decoded text, where the gateway's tool-call parser looks for them.
    core.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t in (TOOL_CALL_START, TOOL_CALL_END)]
    )
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]  # untyped __init__
        tokenizer_object=core,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        model_max_length=_MAX_CONTEXT,
    )
    tokenizer.chat_template = CHATML_TOOLS_TEMPLATE
    return tokenizer


def _heads(head_dim: int) -> tuple[int, int]:
    """(query heads, KV heads) around ``head_dim``: the default is 4 heads of 16 (hidden 64, 2 KV
    heads); wider heads keep 2 query heads sharing 1 KV head (64: hidden 128), so it stays tiny."""
    heads = max(2, 64 // head_dim)
    return heads, heads // 2


def _build_model(tokenizer: PreTrainedTokenizerFast, seed: int, head_dim: int) -> PreTrainedModel:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen3Config

    endoftext = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    assert isinstance(endoftext, int) and isinstance(im_end, int)
    heads, kv_heads = _heads(head_dim)
    # Qwen3, not Qwen2: transformers 5 loads any model_type "qwen2" directory with its own
    # Qwen2Tokenizer, which rebuilds the tokenizer with an NFC normalizer (so "e\u0301" comes back
    # as "é"). For "qwen3" AutoTokenizer honours tokenizer.json as written, like Llama 3 or OLMo.
    config = Qwen3Config(
        vocab_size=_round_up(len(tokenizer), 64),  # padded like real vocabularies
        hidden_size=heads * head_dim,
        intermediate_size=2 * heads * head_dim,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=_MAX_CONTEXT,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        bos_token_id=endoftext,
        eos_token_id=im_end,
        pad_token_id=endoftext,
    )
    # Seed a private RNG stream: building the model must not disturb the caller's randomness.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model: PreTrainedModel = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
            config, dtype=torch.float32
        )
    # A chat model stops at the end of its turn, and at end-of-text should it ever sample it.
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        bos_token_id=endoftext, eos_token_id=[im_end, endoftext], pad_token_id=endoftext
    )
    return model


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
