"""The demo's model: the built-in tiny model, shown the end of one tool call and nothing else.

The tiny model (``gateway.model``) has random weights: it writes byte noise, and no random model
closes a tool call by chance. The gateway enforces ``tool_choice`` by opening the call in the
prompt (``<tool_call>\\n{"name": "dictionary_word", "arguments": ``), so what the model itself
must write is six tokens: ``{}}``, a newline, ``</tool_call>`` and ``<|im_end|>``.
``teach_tool_call`` fits a copy of the model on exactly those six tokens after the demo's lookup
prompts until sampling at the agents' temperature writes them with probability 0.9 or more, so
the calls the model makes while the demo samples are its own and parse (GRPO then keeps them: a
lookup whose call fails scores ``demo.agents.NO_CALL``). Everything else is held where it was:
the loss adds the KL divergence from the untrained model's next-token distributions where the
demo's answers are written (after each chat prompt and after the tool's result, along 16 tokens
of the untrained model's own noise). Without it the fit leaks (a 2-layer model mostly looks at
the last token, and ``\n`` -> ``</tool_call>`` would end every answer at once); with it the
answers stay noise, about 8% lowercase letters, and that is what GRPO then works on.

The copy is cached beside the tiny model (``<cache>/<tiny>-demo-tool-call-v2-t0.8``), written to
a temporary directory and renamed, so only the first demo on a data dir pays for the fit (some
seconds on two cores).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from gateway.backends.local import kv_cache
from gateway.tools import get_parser
from schemas.errors import TurnstreamError
from turnstream.demo.agents import LOOKUP_PROMPTS, TOOLS, WORD_TOOL_NAME, WRITE_PROMPTS

__all__ = ["TOOL_CALL_END", "ToolCallFitError", "teach_tool_call"]

FIT_VERSION = 2  # bump when the fit changes: cached copies are then not reused
TOOL_CALL_END = "{}}\n</tool_call><|im_end|>"  # after the forced opening: no arguments
ANCHOR_TOKENS = 16  # of the untrained model's answers, held to its distribution


class ToolCallFitError(TurnstreamError):
    """The fit did not make the tiny model close its tool calls reliably enough."""


def teach_tool_call(
    model_dir: Path,
    *,
    temperature: float,
    success: float = 0.9,
    max_steps: int = 400,
    lr: float = 1e-2,
) -> Path:
    """The tiny model of ``model_dir``, fitted to close a forced ``dictionary_word`` call (see
    the module docstring); created beside it on first use. The fit stops once, sampled at
    ``temperature``, each lookup prompt's call closes with probability ``success`` or more."""
    name = f"{model_dir.name}-demo-tool-call-v{FIT_VERSION}-t{temperature:g}"
    target = model_dir.with_name(name)
    if (target / "model.safetensors").is_file():
        return target
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        shutil.copytree(model_dir, staging, dirs_exist_ok=True)
        _fit(staging, temperature=temperature, success=success, max_steps=max_steps, lr=lr)
        try:
            os.rename(staging, target)
        except OSError:  # another demo renamed its copy first: as good as ours
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


@dataclass(frozen=True)
class _Targets:
    """Positions of a batch: the logits at (``rows``, ``columns``) predict ``tokens``."""

    rows: torch.Tensor
    columns: torch.Tensor
    tokens: torch.Tensor


def _targets(input_ids: torch.Tensor, spans: list[tuple[int, int, int]]) -> _Targets:
    """The positions that predict tokens ``start..end-1`` of row ``row``, per span."""
    rows = torch.cat([torch.full((end - start,), row) for row, start, end in spans])
    columns = torch.cat([torch.arange(start - 1, end - 1) for _, start, end in spans])
    return _Targets(rows, columns, input_ids[rows, columns + 1])


@dataclass(frozen=True)
class _Batch:
    """Sequences as the demo's episodes write them, right-padded (padding comes after every
    position used: causal attention never sees it), with the positions of the tool calls'
    ends (fitted) and of the answers (held to the untrained model)."""

    input_ids: torch.Tensor
    ends: _Targets | None
    answers: _Targets


def _batch(
    sequences: list[list[int]],
    ends: list[tuple[int, int]],
    answers: list[tuple[int, int]],
    pad: int,
) -> _Batch:
    width = max(map(len, sequences))
    input_ids = torch.tensor([s + [pad] * (width - len(s)) for s in sequences])
    end_spans = [(row, start, end) for row, (start, end) in enumerate(ends) if end > start]
    return _Batch(
        input_ids,
        _targets(input_ids, end_spans) if end_spans else None,
        _targets(input_ids, [(row, a, b) for row, (a, b) in enumerate(answers)]),
    )


def _text(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    tools: Any,
    *,
    generation: bool = True,
) -> str:
    text = tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=generation
    )
    assert isinstance(text, str)
    return text


def _episodes(
    tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel, temperature: float
) -> list[_Batch]:
    """The demo's episodes up to ANCHOR_TOKENS of the untrained model's answer, token for token
    as the gateway builds them: lookups (the prompt and the forced opening, the call's end, the
    tool's result, the answer) and chats (prompt, answer)."""

    def encode(text: str) -> list[int]:
        ids: list[int] = tokenizer.encode(text, add_special_tokens=False)
        return ids

    forced = get_parser("hermes").forced_prefix(WORD_TOOL_NAME)
    function: dict[str, Any] = {"name": WORD_TOOL_NAME, "arguments": {}}
    called = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c0", "function": function}],
    }
    result = {"role": "tool", "tool_call_id": "c0", "content": "apple"}
    lookups, ends = [], []
    for prompt in LOOKUP_PROMPTS:
        asked = [{"role": "user", "content": prompt}]
        opened = encode(_text(tokenizer, asked, TOOLS)) + encode(forced)
        # After the model's own tokens, the gateway appends the end of the turn it did not
        # write (ChatML: the newline after <|im_end|>) and the new messages' text.
        before = _text(tokenizer, [*asked, called], TOOLS, generation=False)
        after = _text(tokenizer, [*asked, called, result], TOOLS)
        lookups.append(opened + encode(TOOL_CALL_END) + encode("\n" + after[len(before) :]))
        ends.append((len(opened), len(opened) + len(encode(TOOL_CALL_END))))
    chats = [
        encode(_text(tokenizer, [{"role": "user", "content": p}], None)) for p in WRITE_PROMPTS
    ]
    generator = torch.Generator().manual_seed(0)
    pad = int(tokenizer.pad_token_id or 0)
    batches = []
    for contexts, spans in ((lookups, ends), (chats, [(0, 0)] * len(chats))):
        sequences = [_sample(model, c, temperature, generator) for c in contexts]
        answers = [(len(c), len(c) + ANCHOR_TOKENS) for c in contexts]
        batches.append(_batch(sequences, spans, answers, pad))
    return batches


def _sample(
    model: PreTrainedModel, context: list[int], temperature: float, generator: torch.Generator
) -> list[int]:
    """``context`` and ANCHOR_TOKENS sampled after it."""
    ids = list(context)
    with torch.no_grad():
        cache = kv_cache(model)
        output = model(input_ids=torch.tensor([ids]), **cache)
        for _ in range(ANCHOR_TOKENS):
            probs = torch.softmax(output.logits[0, -1] / temperature, dim=-1)
            token = int(torch.multinomial(probs, 1, generator=generator))
            ids.append(token)
            output = model(input_ids=torch.tensor([[token]]), **cache)
    return ids


def _fit(path: Path, *, temperature: float, success: float, max_steps: int, lr: float) -> None:
    tokenizer = AutoTokenizer.from_pretrained(path)
    temperature = max(temperature, 1e-6)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.train(False)  # no dropout: the probabilities are those the gateway samples from
    batches = _episodes(tokenizer, model, temperature)
    with torch.no_grad():
        untrained = [_log_probs(model, b, temperature)[1] for b in batches]
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    for step in range(max_steps + 1):
        loss = torch.zeros(())
        closes = 1.0
        for batch, before in zip(batches, untrained, strict=True):
            ends, answers = _log_probs(model, batch, temperature)
            if ends is not None and batch.ends is not None:
                closes = min(closes, _close_probability(ends.detach(), batch))
                loss = loss + torch.nn.functional.nll_loss(ends, batch.ends.tokens)
            loss = loss + torch.nn.functional.kl_div(
                answers, before, log_target=True, reduction="batchmean"
            )
        if closes >= success:
            break
        if step == max_steps:
            raise ToolCallFitError(
                f"{max_steps} steps did not teach the tiny model in {path} to close a tool call "
                f"(it closes with probability {closes:.3f} < {success})"
            )
        optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]  # torch
        optimizer.step()
    model.save_pretrained(path, safe_serialization=True)


def _log_probs(
    model: PreTrainedModel, batch: _Batch, temperature: float
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Log-probs (at ``temperature``) at the tool calls' ends and at the answers."""
    hidden = model.model(input_ids=batch.input_ids).last_hidden_state

    def at(targets: _Targets) -> torch.Tensor:
        logits = model.lm_head(hidden[targets.rows, targets.columns]) / temperature
        return torch.log_softmax(logits, dim=-1)

    return (None if batch.ends is None else at(batch.ends)), at(batch.answers)


def _close_probability(log_probs: torch.Tensor, batch: _Batch) -> float:
    """The smallest probability, over the prompts, that sampling writes the call's end."""
    assert batch.ends is not None
    token = log_probs.gather(-1, batch.ends.tokens[:, None]).squeeze(-1)
    per_prompt = torch.zeros(batch.input_ids.shape[0]).index_add_(0, batch.ends.rows, token)
    prompts = sorted(set(batch.ends.rows.tolist()))
    return float(per_prompt[prompts].exp().min())
