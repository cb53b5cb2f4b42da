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

from gateway.core.conversation import arguments_object
from gateway.errors import InvalidRequest
from gateway.kept_json import KeptJson, kept_json_of
from schemas.images import image_parts

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from gateway.images.vision import VisionSpec

__all__ = ["ChatTemplate", "load_tokenizer", "template_messages"]

# What tokenizer_config.json's "tokenizer_class" names when the tokenizer is tokenizer.json as the
# tokenizers library runs it: AutoTokenizer resolves both names to TokenizersBackend.
_PLAIN_TOKENIZER_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})

JSON = dict[str, Any]
# Message fields transformers copies under each other's names before rendering (its
# _alias_reasoning_fields): a message holding one is rendered through apply_chat_template.
_REASONING_FIELDS = frozenset({"reasoning_content", "thinking", "reasoning"})
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
        vision: VisionSpec | None = None,
    ) -> None:
        """``max_context``: the served context length. The serving code refuses longer prompts
        itself (413, ``ContextLengthExceeded``), so the tokenizer's own limit is lifted: with it
        transformers warned about any longer encoding ("30994 > 4096" where the model served
        takes 32k, or a refused over-context prompt: "running this sequence through the model
        will result in indexing errors", though nothing ran).

        ``vision``: the served model's image placeholder (None: a text model, which refuses
        image parts): every id this template returns has each image's placeholder expanded as
        the model's processor expands it (``gateway.images.vision``)."""
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat_template; serve a chat model")
        if max_context is not None:
            tokenizer.model_max_length = sys.maxsize
        self.tokenizer = tokenizer
        self.vision = vision
        self.hash = hashlib.sha256(str(tokenizer.chat_template).encode()).hexdigest()[:16]
        eos = tokenizer.eos_token_id
        ids = list(stop_token_ids) + ([eos] if isinstance(eos, int) else [])
        self.stop_token_ids: tuple[int, ...] = tuple(dict.fromkeys(ids))
        self._rust_decode = _rust_decode(tokenizer)
        self._rust_encode = _rust_encode(tokenizer)
        self._jinja = _jinja_render(tokenizer)
        self._kept_json = _kept_json(tokenizer) if self._jinja is not None else None
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

    def keep_json(self, tools: list[JSON] | None) -> None:
        """Write the JSON of a kept turn's tools once: renders of these very objects (not
        equal ones) take the text written the first time (``gateway.kept_json``)."""
        if tools and self._kept_json is not None:
            self._kept_json.keep([tools, *tools])

    def render(
        self, messages: Sequence[JSON], tools: list[JSON] | None, *, generation: bool
    ) -> str:
        chat = template_messages(messages)
        try:
            text: object = None if self._jinja is None else self._jinja(chat, tools, generation)
            if text is None:
                text = self.tokenizer.apply_chat_template(
                    chat,
                    tools=tools,  # type: ignore[arg-type]  # list[dict] is what HF documents
                    add_generation_prompt=generation,
                    tokenize=False,
                )
        except Exception as exc:  # jinja raises anything: a template error is the request's
            raise InvalidRequest(f"the chat template cannot render these messages: {exc}") from exc
        rendered = str(text)
        if self.vision is not None:
            self._check_placeholders(rendered, messages)
        return rendered

    def _check_placeholders(self, rendered: str, messages: Sequence[JSON]) -> None:
        """Each image placeholder of a render stands for an image part: text holding the
        model's image token would take an image's place (and its pixels another's)."""
        assert self.vision is not None
        token = self.vision.image_token
        found = rendered.count(token)
        images = sum(1 for _ in image_parts(messages))
        if found != images:
            raise InvalidRequest(
                f"the messages render {found} image placeholders ({token}) for {images} "
                f"images: a message's text holds the model's image token {token!r}; remove it "
                "from the text",
                param="messages",
            )

    def _expanded(self, ids: list[int], messages: Sequence[JSON]) -> list[int]:
        """``ids`` (the encoding of a render's tail, or of all of it) with their image
        placeholders expanded: the tail's k placeholders are the conversation's last k images
        (a render's tail is its last messages)."""
        if self.vision is None:
            return ids
        pad = self.vision.image_token_id
        k = ids.count(pad)
        if not k:
            return ids
        parts = list(image_parts(messages))
        return self.vision.expand(ids, parts[len(parts) - k :] if k <= len(parts) else parts)

    def min_tokens(self, chars: int) -> int:
        """A lower bound on the tokens of ``chars`` characters of text."""
        return chars // self._longest_token

    def encode(self, text: str) -> list[int]:
        ids = None if self._rust_encode is None else self._rust_encode(text)
        if ids is None:
            ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        if self._rust_decode is not None:
            return self._rust_decode(ids, skip_special_tokens)
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def prompt_ids(self, messages: Sequence[JSON], tools: list[JSON] | None) -> list[int]:
        """The full render of a conversation, ready for the model's reply."""
        return self.prompt_ids_of(self.render(messages, tools, generation=True), messages)

    def prompt_ids_of(self, rendered: str, messages: Sequence[JSON]) -> list[int]:
        """The ids of ``rendered``, the render of ``messages`` (images expanded)."""
        return self._expanded(self.encode(rendered), messages)

    def extension_ids(
        self, context_text: Sequence[bytes], messages: Sequence[JSON], tools: list[JSON] | None
    ) -> tuple[list[int] | None, str, bytes]:
        """The render of ``messages`` (ready for the reply) as text and as UTF-8, and the ids to
        append after a context whose ids stand for the text ``context_text`` (its UTF-8, in
        parts, not joined) so that the prompt's text is exactly that render: where the render
        starts with that text (the template renders the kept turns, the model's replies
        included, as they are), the ids of the rest; else None.

        One render, where ``continuation_ids`` needs two; when both apply they give the same
        ids (the rest of the render is the end of turn the model did not sample + the new
        messages' text). Compared as UTF-8 so that the kept text costs a byte a character: one
        emoji in a system text makes Python hold a whole ~100k-character render at 4 bytes a
        character (the encode costs ~0.1 ms at 100k characters; the new render's UTF-8 is the
        next turn's kept text)."""
        full = self.render(messages, tools, generation=True)
        utf8 = full.encode("utf-8")
        at = 0
        for part in context_text:
            if not utf8.startswith(part, at):
                return None, full, utf8
            at += len(part)
        # Parts end on characters (each is a whole text's UTF-8), so the rest decodes.
        rest = utf8[at:].decode("utf-8")
        return self._expanded(self.encode(rest), messages), full, utf8

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
        messages = [*conversation, *new_messages]
        full = self.render(messages, tools, generation=True)
        if not full.startswith(base):
            return None
        tail = self.turn_end_text
        last = int(completion_ids[-1]) if len(completion_ids) else -1
        if last in self.stop_token_ids:
            sampled = self.decode([last], skip_special_tokens=False)
            if tail.startswith(sampled):
                tail = tail[len(sampled) :]
        return self._expanded(self.encode(tail + full[len(base) :]), messages)


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
        not _plain_fast(tokenizer)
        or cls.decode is not PreTrainedTokenizerBase.decode
        or cls._decode is not TokenizersBackend._decode
        or tokenizer.clean_up_tokenization_spaces
    ):
        return None
    rust = tokenizer._tokenizer.decode

    def decode(ids: Sequence[int], skip_special_tokens: bool) -> str:
        return str(rust(ids if isinstance(ids, list) else list(ids), skip_special_tokens))

    return decode


def _plain_fast(tokenizer: PreTrainedTokenizerBase) -> bool:
    """A plain fast tokenizer (``TokenizersBackend``) with the Rust tokenizer loaded."""
    from transformers import TokenizersBackend

    return isinstance(tokenizer, TokenizersBackend) and tokenizer._tokenizer is not None


# From this length on, a text is encoded with the GIL released (``_rust_encode``): a longer one
# costs more than the one-item batch's overhead, and is the one that stalls the event loop.
UNLOCKED_ENCODE_CHARS = 16_384


def _rust_encode(tokenizer: PreTrainedTokenizerBase) -> Callable[[str], list[int] | None] | None:
    """The ``tokenizers`` library's encode, where transformers' ``encode(text,
    add_special_tokens=False)`` is exactly that call: its wrapper (argument resolution, batch
    detection, the BatchEncoding) cost as much again as encoding a turn's new messages. A
    subclass that overrides encoding keeps transformers' path. transformers sets the Rust
    tokenizer's truncation, padding and special-token splitting before each call; where they are
    not what an encode without options leaves (no truncation, no padding, special tokens whole),
    this returns None and the caller takes transformers' path."""
    from transformers import PreTrainedTokenizerBase, TokenizersBackend

    cls = type(tokenizer)
    if (
        not _plain_fast(tokenizer)
        or cls.encode is not PreTrainedTokenizerBase.encode
        or cls._encode_plus is not TokenizersBackend._encode_plus
    ):
        return None
    rust = tokenizer._tokenizer
    tokenizer.encode("", add_special_tokens=False)  # transformers configures it as it encodes

    def encode(text: str) -> list[int] | None:
        if (
            rust.truncation is not None
            or rust.padding is not None
            or rust.encode_special_tokens
            or tokenizer.split_special_tokens
        ):
            return None
        if len(text) < UNLOCKED_ENCODE_CHARS:
            ids: list[int] = rust.encode(text, add_special_tokens=False).ids
            return ids
        # ``encode`` holds the GIL throughout (~1 ms per 1,000 characters): a 100k-token first
        # turn, tokenized on a worker thread so as to leave the event loop free, stopped it for
        # as long (issue 40's fleet: 100-200 ms stalls). ``encode_batch`` releases the GIL
        # while Rust works; for one text it gives the same ids.
        batch: list[int] = rust.encode_batch([text], add_special_tokens=False)[0].ids
        return batch

    return encode


def _kept_json(tokenizer: PreTrainedTokenizerBase) -> KeptJson | None:
    """The ``KeptJson`` behind the ``tojson`` filter of the template ``_jinja_render`` renders
    (transformers' cached compile: the same environment)."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    return kept_json_of(_compile_jinja_template(tokenizer.chat_template).environment)


def _jinja_render(
    tokenizer: PreTrainedTokenizerBase,
) -> Callable[[list[JSON], list[JSON] | None, bool], str | None] | None:
    """transformers' render of the tokenizer's one chat template, without the conversions
    ``apply_chat_template`` makes first: turning message objects (dataclasses, pydantic models)
    into dicts and rebuilding every value from plain JSON types, twice, which cost as much as
    the render itself. The gateway's messages are dicts of JSON values already (parsed request
    bodies, through ``template_messages``), so the same compiled template (transformers' cached
    compile: its sandbox, filters and globals) gets the same inputs. Only for a tokenizer whose
    ``apply_chat_template`` is transformers' own and whose template is a single string (a dict
    of named templates picks one by the request's tools). The render returns None, for the
    caller to take transformers' path, where that does more than render: an empty conversation
    (refused), messages with reasoning fields (copied under each other's names), a template
    changed since. ``tests/unit/test_chat_render.py`` holds the two renders equal."""
    from transformers import PreTrainedTokenizerBase

    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # a transformers that moved it: its own path
        return None
    source = tokenizer.chat_template
    own = type(tokenizer).apply_chat_template is PreTrainedTokenizerBase.apply_chat_template
    if not own or not isinstance(source, str):
        return None
    compiled = _compile_jinja_template(source)
    special: dict[str, Any] = dict(tokenizer.special_tokens_map)
    if not all(isinstance(v, str) for v in special.values()):
        return None  # transformers rebuilds anything else on every render

    def render(messages: list[JSON], tools: list[JSON] | None, generation: bool) -> str | None:
        if (
            not messages
            or tokenizer.chat_template is not source
            or any(_REASONING_FIELDS & m.keys() for m in messages)
        ):
            return None
        return str(
            compiled.render(
                messages=messages,
                tools=tools,
                documents=None,
                add_generation_prompt=generation,
                **special,
            )
        )

    return render
