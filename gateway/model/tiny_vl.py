"""The tiny vision-language model: like ``gateway.model.tiny``, made here, loaded like a real one.

``ensure_tiny_vl_model`` writes a Hugging Face model directory of a real architecture that
transformers and vLLM both serve, Qwen2-VL (``Qwen2VLForConditionalGeneration``: a vision
tower whose patches are merged 2x2 and put in place of the prompt's ``<|image_pad|>`` tokens,
M-RoPE positions), with seeded random weights (~0.5M parameters), the tiny text model's byte-level
tokenizer plus Qwen2-VL's vision tokens, a ChatML template that renders an image part as
``<|vision_start|><|image_pad|><|vision_end|>`` (Qwen2-VL's own convention), and the image
processor's ``preprocessor_config.json`` (Qwen2-VL's: 14-pixel patches, merge 2, so one
placeholder token per 28x28 pixels, at most ``MAX_IMAGE_TOKENS`` per image to keep prompts
small). Consumers load it with ``AutoTokenizer``, ``AutoModelForImageTextToText`` and the image
processor's ``from_pretrained``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from gateway.model.tiny import CHATML_TOOLS_TEMPLATE, ENDOFTEXT, IM_END, _build_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerFast

__all__ = [
    "TINY_VL_MODEL_NAME",
    "TINY_VL_MODEL_VERSION",
    "VISION_TOKENS",
    "ensure_tiny_vl_model",
    "tiny_vl_model_dir",
]

TINY_VL_MODEL_VERSION = 1
TINY_VL_MODEL_NAME = "tiny-vl"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)
_PATCH = 14
_MERGE = 2
MAX_IMAGE_TOKENS = 64  # placeholder tokens per image at most (the processor's max_pixels)
_MAX_CONTEXT = 4096

_REQUIRED_FILES = (
    "chat_template.jinja",
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "preprocessor_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
)

# The text model's tool-calling ChatML template, with content that may be a list of parts (text
# and images), as Qwen2-VL's template reads it: an image part (type "image") is its placeholder.
_CONTENT_MACRO = """\
{%- macro render_content(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content -%}
        {%- for part in content -%}
            {%- if part.type == 'image' -%}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
            {%- elif part.type == 'text' -%}
                {{- part.text -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
"""
CHATML_VL_TEMPLATE = _CONTENT_MACRO + (
    CHATML_TOOLS_TEMPLATE.replace(
        "{{- messages[0].content }}", "{{- render_content(messages[0].content) }}"
    )
    .replace(
        "'<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n'",
        "'<|im_start|>system\\n' + render_content(messages[0].content) + '<|im_end|>\\n'",
    )
    .replace("(message.content or '')", "render_content(message.content)")
    .replace("{{- '\\n' + message.content }}", "{{- '\\n' + render_content(message.content) }}")
    .replace("        {{- message.content }}\n", "        {{- render_content(message.content) }}\n")
)


def tiny_vl_model_dir(cache_dir: Path, seed: int = 0) -> Path:
    """Where ``ensure_tiny_vl_model(cache_dir, seed)`` keeps its model."""
    return Path(cache_dir) / f"{TINY_VL_MODEL_NAME}-v{TINY_VL_MODEL_VERSION}-seed{seed}"


def ensure_tiny_vl_model(cache_dir: Path, seed: int = 0) -> Path:
    """The tiny vision-language model's directory under ``cache_dir``, created on first use (in
    a temporary sibling renamed into place, as ``ensure_tiny_model`` does)."""
    target = tiny_vl_model_dir(cache_dir, seed)
    if all((target / name).is_file() for name in _REQUIRED_FILES):
        return target
    if target.exists():
        shutil.rmtree(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        _write_model(staging, seed)
        try:
            os.rename(staging, target)
        except OSError:
            if not all((target / name).is_file() for name in _REQUIRED_FILES):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _write_model(path: Path, seed: int) -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    tokenizer = _vl_tokenizer()
    tokenizer.save_pretrained(path)
    _build_model(tokenizer, seed).save_pretrained(path, safe_serialization=True)
    pixels = _PATCH * _MERGE * _PATCH * _MERGE
    Qwen2VLImageProcessorPil(
        min_pixels=pixels,
        max_pixels=pixels * MAX_IMAGE_TOKENS,
        patch_size=_PATCH,
        temporal_patch_size=2,
        merge_size=_MERGE,
    ).save_pretrained(path)


def _vl_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import AddedToken

    tokenizer = _build_tokenizer()
    tokenizer.add_special_tokens(
        {
            "additional_special_tokens": [
                AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS
            ]
        }
    )
    tokenizer.chat_template = CHATML_VL_TEMPLATE
    return tokenizer


def _build_model(tokenizer: PreTrainedTokenizerFast, seed: int) -> PreTrainedModel:
    import torch
    from transformers import GenerationConfig
    from transformers.models.qwen2_vl import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (*VISION_TOKENS, ENDOFTEXT, IM_END)}
    assert all(isinstance(i, int) for i in ids.values())
    config = Qwen2VLConfig(
        text_config={
            "vocab_size": -(-len(tokenizer) // 64) * 64,
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,  # head_dim 64: vLLM's CPU attention refuses 16
            "num_key_value_heads": 1,
            "max_position_embeddings": _MAX_CONTEXT,
            # The t/h/w sections of M-RoPE sum to head_dim / 2 (Qwen2-VL: [16, 24, 24] of 64).
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [8, 12, 12],
            },
            "bos_token_id": ids[ENDOFTEXT],
            "eos_token_id": ids[IM_END],
            "pad_token_id": ids[ENDOFTEXT],
        },
        vision_config={
            "depth": 1,
            "embed_dim": 64,
            "hidden_size": 128,
            "num_heads": 1,
            "mlp_ratio": 2,
            "patch_size": _PATCH,
            "spatial_merge_size": _MERGE,
            "temporal_patch_size": 2,
            "in_channels": 3,
        },
        image_token_id=ids[IMAGE_PAD],
        video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model: PreTrainedModel = Qwen2VLForConditionalGeneration(config).to(torch.float32)
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        bos_token_id=ids[ENDOFTEXT],
        eos_token_id=[ids[IM_END], ids[ENDOFTEXT]],
        pad_token_id=ids[ENDOFTEXT],
    )
    return model
