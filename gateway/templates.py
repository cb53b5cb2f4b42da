"""Chat templates and tokenization, owned by the gateway (DESIGN §4, tokens in / tokens out).

When a request extends the session's previous turn, its prompt ids are

    previous prompt ids + the completion ids the model sampled
    + encode(end-of-turn text the model did not produce + the new messages' text)

so the tokens of a turn the model produced are never re-tokenized. The new messages' text is
found by rendering the conversation with and without them and taking the difference; the
end-of-turn text is what the template writes after an assistant message's content (for ChatML,
``<|im_end|>\\n``), minus the stop token the model sampled itself.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from gateway.conversation import arguments_object
from gateway.errors import InvalidRequest

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["ChatTemplate", "load_tokenizer", "template_messages"]

# What tokenizer_config.json's "tokenizer_class" names when the tokenizer is tokenizer.json as the
# tokenizers library runs it: AutoTokenizer resolves both names to TokenizersBackend.
_PLAIN_TOKENIZER_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})

JSON = dict[str, Any]
_SENTINEL = "\x00turnstream-sentinel\x00"


def template_messages(messages: Sequence[JSON]) -> list[JSON]:
    """Messages as HF chat templates expect them (arguments as objects, text content)."""
    out = []
    for message in messages:
        m = {k: v for k, v in message.items() if v is not None}
        if m.get("tool_calls"):
            m["tool_calls"] = [
                {
                    **call,
                    "function": {
                        **call["function"],
                        "arguments": arguments_object(call["function"].get("arguments")),
                    },
                }
                for call in m["tool_calls"]
            ]
        out.append(m)
    return out


class ChatTemplate:
    """A tokenizer and its chat template, with the text arithmetic of prefix extension."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        stop_token_ids: Sequence[int] = (),
        *,
        max_context: int | None = None,
    ) -> None:
        """``max_context``: the served context length. The serving code refuses longer prompts
        itself (413, ``ContextLengthExceeded``), so the tokenizer's own limit is lifted: with it
        transformers warned about any longer encoding ("30994 > 4096" where the model served
        takes 32k, or a refused over-context prompt: "running this sequence through the model
        will result in indexing errors", though nothing ran)."""
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat_template; serve a chat model")
        if max_context is not None:
            tokenizer.model_max_length = sys.maxsize
        self.tokenizer = tokenizer
        self.hash = hashlib.sha256(str(tokenizer.chat_template).encode()).hexdigest()[:16]
        eos = tokenizer.eos_token_id
        ids = list(stop_token_ids) + ([eos] if isinstance(eos, int) else [])
        self.stop_token_ids: tuple[int, ...] = tuple(dict.fromkeys(ids))
        self._rust_decode = _rust_decode(tokenizer)
        self.turn_end_text = self._turn_end_text()
        # No token stands for more characters than its vocabulary string has (byte-level
        # vocabularies write one character per byte), so text of n characters needs at least
        # n / longest tokens: a prompt far over the context is refused before it is rendered.
        vocab = tokenizer.get_vocab()
        self.vocab_size = max(len(tokenizer), max(vocab.values(), default=-1) + 1)
        self._longest_token = max((len(t) for t in vocab), default=1) or 1

    def _turn_end_text(self) -> str:
        """The template's text between an assistant message's content and the next message."""
        convo = [{"role": "user", "content": "hi"}]
        base = self.render(convo, None, generation=True)
        full = self.render(
            [*convo, {"role": "assistant", "content": _SENTINEL}], None, generation=False
        )
        if not full.startswith(base) or _SENTINEL not in full:
            raise ValueError("chat template does not render an assistant reply after its prompt")
        return full[full.index(_SENTINEL) + len(_SENTINEL) :]

    def render(
        self, messages: Sequence[JSON], tools: list[JSON] | None, *, generation: bool
    ) -> str:
        try:
            text = self.tokenizer.apply_chat_template(
                template_messages(messages),
                tools=tools,  # type: ignore[arg-type]  # list[dict] is what HF documents
                add_generation_prompt=generation,
                tokenize=False,
            )
        except Exception as exc:  # jinja raises anything: a template error is the request's
            raise InvalidRequest(f"the chat template cannot render these messages: {exc}") from exc
        return str(text)

    def min_tokens(self, chars: int) -> int:
        """A lower bound on the tokens of ``chars`` characters of text."""
        return chars // self._longest_token

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        if self._rust_decode is not None:
            return self._rust_decode(ids, skip_special_tokens)
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def prompt_ids(self, messages: Sequence[JSON], tools: list[JSON] | None) -> list[int]:
        """The full render of a conversation, ready for the model's reply."""
        return self.encode(self.render(messages, tools, generation=True))

    def extension_ids(
        self, context_text: str, messages: Sequence[JSON], tools: list[JSON] | None
    ) -> tuple[list[int] | None, str]:
        """The render of ``messages`` (ready for the reply), and the ids to append after a
        context whose ids stand for ``context_text`` so that the prompt's text is exactly that
        render: where the render starts with ``context_text`` (the template renders the kept
        turns, the model's replies included, as they are), the ids of the rest; else None.

        One render, where ``continuation_ids`` needs two; when both apply they give the same
        ids (the rest of the render is the end of turn the model did not sample + the new
        messages' text)."""
        full = self.render(messages, tools, generation=True)
        if not full.startswith(context_text):
            return None, full
        return self.encode(full[len(context_text) :]), full

    def continuation_ids(
        self,
        conversation: Sequence[JSON],
        completion_ids: Sequence[int] | np.ndarray,
        new_messages: Sequence[JSON],
        tools: list[JSON] | None,
    ) -> list[int] | None:
        """Token ids to append after the previous prompt + ``completion_ids`` so the prompt
        holds ``new_messages``; None when the template does not render them as a pure suffix
        (then the caller renders the whole conversation, and the turn forks)."""
        base = self.render(conversation, tools, generation=False)
        full = self.render([*conversation, *new_messages], tools, generation=True)
        if not full.startswith(base):
            return None
        tail = self.turn_end_text
        last = int(completion_ids[-1]) if len(completion_ids) else -1
        if last in self.stop_token_ids:
            sampled = self.decode([last], skip_special_tokens=False)
            if tail.startswith(sampled):
                tail = tail[len(sampled) :]
        return self.encode(tail + full[len(base) :])


def load_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    """The tokenizer ``AutoTokenizer.from_pretrained(model_dir)`` loads: the same class, loaded
    the same way. Where the directory's tokenizer_config.json names the plain fast tokenizer,
    that class is loaded directly: AutoTokenizer's module imports torch through transformers'
    model utilities (~3 s of CPU and ~300 MB at start), which a gateway in front of vLLM,
    ``inspect`` and ``export`` do not need. Anything else goes through AutoTokenizer."""
    try:
        config = json.loads((Path(model_dir) / "tokenizer_config.json").read_text("utf-8"))
        named = config.get("tokenizer_class") if isinstance(config, dict) else None
    except (OSError, ValueError):
        named = None
    if named in _PLAIN_TOKENIZER_CLASSES and (Path(model_dir) / "tokenizer.json").is_file():
        from transformers import TokenizersBackend

        loaded: PreTrainedTokenizerBase = TokenizersBackend.from_pretrained(model_dir)
        return loaded
    from transformers import AutoTokenizer

    auto: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(model_dir)
    return auto


def _rust_decode(tokenizer: PreTrainedTokenizerBase) -> Callable[[Sequence[int], bool], str] | None:
    """The ``tokenizers`` library's decode, where transformers' decode is exactly that call.

    The detokenizer decodes twice per streamed chunk; transformers' wrapper around the Rust call
    (argument conversion, batch detection, cleanup options) cost 2-3 times the decode itself.
    Only a plain fast tokenizer without ``clean_up_tokenization_spaces`` qualifies: a subclass
    may override decoding, and the cleanup is Python-side; those keep transformers' path."""
    from transformers import PreTrainedTokenizerBase, TokenizersBackend

    cls = type(tokenizer)
    if (
        not isinstance(tokenizer, TokenizersBackend)
        or cls.decode is not PreTrainedTokenizerBase.decode
        or cls._decode is not TokenizersBackend._decode
        or tokenizer.clean_up_tokenization_spaces
        or tokenizer._tokenizer is None
    ):
        return None
    rust = tokenizer._tokenizer.decode

    def decode(ids: Sequence[int], skip_special_tokens: bool) -> str:
        return str(rust(ids if isinstance(ids, list) else list(ids), skip_special_tokens))

    return decode
