"""A tiny chat model whose tokenizer is a byte-level BPE trained here, on generated text.

The built-in tiny model's tokenizer has no merges: any text re-tokenizes to the ids sampled.
With merges it does not: a model samples "t", "h", "e" where the tokenizer would write "the",
so a prompt rebuilt from a reply's text holds other ids than the ones the model sampled. Tests
of token-exact continuation need that difference, and a real vocabulary is not downloaded
(DESIGN §4): a few hundred merges are learned in a second from seeded random text.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from gateway.model.tiny import (
    CHATML_TOOLS_TEMPLATE,
    ENDOFTEXT,
    IM_END,
    IM_START,
    TOOL_CALL_END,
    TOOL_CALL_START,
    _build_model,  # the built-in tiny model's architecture, over this vocabulary
)

__all__ = ["bpe_model_dir"]

_SYLLABLES = ("ka", "to", "re", "mi", "su", "lo", "an", "the", "ing", "er", "st", " ", "\n")


def _corpus(seed: int, lines: int = 2000) -> Iterator[str]:
    """Seeded pseudo-words, plus the ChatML scaffolding the template writes around them."""
    rng = random.Random(seed)
    for _ in range(lines):
        words = ("".join(rng.choices(_SYLLABLES, k=rng.randint(1, 4))) for _ in range(12))
        yield f"system\nYou are a helpful assistant.\nuser\n{' '.join(words)}\nassistant\n"


def _tokenizer(seed: int, merges: int) -> PreTrainedTokenizerFast:
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    specials = [ENDOFTEXT, IM_START, IM_END]
    trainer = trainers.BpeTrainer(
        vocab_size=len(specials) + len(alphabet) + merges,
        initial_alphabet=alphabet,
        special_tokens=specials,
        show_progress=False,
    )
    core.train_from_iterator(_corpus(seed), trainer)
    # As in the built-in tiny model: the tool-call markers are tokens, but not special ones.
    core.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t in (TOOL_CALL_START, TOOL_CALL_END)]
    )
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]  # untyped __init__
        tokenizer_object=core, eos_token=IM_END, pad_token=ENDOFTEXT, model_max_length=4096
    )
    tokenizer.chat_template = CHATML_TOOLS_TEMPLATE
    return tokenizer


def bpe_model_dir(path: Path, *, seed: int = 0, merges: int = 300) -> Path:
    """Write the model (tokenizer with ``merges`` learned merges, seeded random weights) to
    ``path``; every consumer loads it with ``from_pretrained`` like a real one."""
    tokenizer = _tokenizer(seed, merges)
    tokenizer.save_pretrained(path)
    _build_model(tokenizer, seed, 16).save_pretrained(path, safe_serialization=True)
    return path
