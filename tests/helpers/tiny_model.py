"""Fitting the tiny model to chat transcripts, so tests can watch it really call a tool.

The seeded tiny model (gateway.model) emits noise. ``overfit_tool_calls`` fine-tunes a copy on a
few transcripts rendered with the model's own chat template, with the loss on the assistant turns
only, until greedy decoding reproduces them token for token: a ``<tool_call>`` turn, then after
the tool's response a final answer. A couple of hundred AdamW steps on CPU take seconds.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

__all__ = [
    "TOOLS",
    "WEATHER_QUESTION",
    "WEATHER_RESULT",
    "WEATHER_TOOLS",
    "WEATHER_TRANSCRIPT",
    "overfit_tool_calls",
    "render_ids",
]

Message = Mapping[str, Any]

WEATHER_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]

TOOLS = WEATHER_TOOLS

WEATHER_QUESTION: list[dict[str, Any]] = [
    {"role": "user", "content": "What is the weather in Paris?"}
]
WEATHER_RESULT = '{"temp_c": 18, "sky": "sunny"}'

# The OpenAI wire shape: arguments are a JSON string, the template inserts them verbatim. The
# call turn is 60 tokens (byte-level), the answer 32: ask for max_tokens >= 60.
WEATHER_TRANSCRIPT: list[dict[str, Any]] = [
    *WEATHER_QUESTION,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_0",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_0", "content": WEATHER_RESULT},
    {"role": "assistant", "content": "It is 18°C and sunny in Paris."},
]


def render_ids(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    tools: Sequence[Mapping[str, Any]] | None,
    *,
    add_generation_prompt: bool,
) -> list[int]:
    text = tokenizer.apply_chat_template(
        [dict(m) for m in messages],
        tools=None if tools is None else [dict(t) for t in tools],
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
    )
    assert isinstance(text, str)
    ids: list[int] = tokenizer.encode(text, add_special_tokens=False)
    return ids


def overfit_tool_calls(
    model_dir: Path,
    out_dir: Path,
    transcripts: Sequence[Sequence[Message]],
    tools: Sequence[Mapping[str, Any]] | None,
    *,
    max_steps: int = 400,
    lr: float = 1e-2,
    margin: float = 1.0,
    seed: int = 0,
) -> Path:
    """Copy the model at ``model_dir`` to ``out_dir`` and fine-tune it on ``transcripts``.

    Each transcript is rendered once with the chat template; the loss covers every assistant
    turn (the generation prompt excluded, ``<|im_end|>`` included, so the model learns to stop).
    Training stops as soon as, at every assistant position, the right token's logit beats every
    other by ``margin``: then greedy decoding reproduces the turns exactly, with room for the
    tiny numerical differences of a KV-cached decode. Returns ``out_dir``, loadable with
    ``from_pretrained``; raises AssertionError if ``max_steps`` were not enough.
    """
    shutil.copytree(model_dir, out_dir)
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    examples = [_example(tokenizer, t, tools) for t in transcripts]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        for step in range(max_steps + 1):
            optimizer.zero_grad()
            worst = float("inf")
            for input_ids, labels in examples:
                out = model(input_ids=input_ids, labels=labels)
                worst = min(worst, _min_margin(out.logits.detach()[0], labels[0]))
                (out.loss / len(examples)).backward()
            if worst >= margin:
                break
            if step == max_steps:
                raise AssertionError(
                    f"{max_steps} steps did not fit the transcripts (worst margin {worst:.3f})"
                )
            optimizer.step()
    model.train(False)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def _min_margin(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Smallest lead of the labelled token's logit over the best other token (negative: wrong)."""
    positions = (labels[1:] != -100).nonzero().squeeze(-1)
    predicted = logits[positions]  # logits at t predict the token at t + 1
    target = labels[1:][positions]
    right = predicted.gather(-1, target[:, None]).squeeze(-1)
    others = predicted.scatter(-1, target[:, None], float("-inf")).amax(-1)
    return float((right - others).min())


def _example(
    tokenizer: PreTrainedTokenizerBase,
    transcript: Sequence[Message],
    tools: Sequence[Mapping[str, Any]] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids of the whole transcript and labels that are -100 outside assistant turns."""
    full = render_ids(tokenizer, transcript, tools, add_generation_prompt=False)
    labels = [-100] * len(full)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert isinstance(im_end, int)
    for i, message in enumerate(transcript):
        if message["role"] != "assistant":
            continue
        start = len(render_ids(tokenizer, transcript[:i], tools, add_generation_prompt=True))
        end = full.index(im_end, start) + 1
        labels[start:end] = full[start:end]
    return torch.tensor([full]), torch.tensor([labels])
