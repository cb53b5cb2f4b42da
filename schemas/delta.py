"""Delta encoding of a turn's prompt against its parent turn's full context (DESIGN §3): the one
encoder and the one decoder.

A multi-turn session's prompt usually repeats everything before it; storing only the length of
the shared prefix and the new tokens makes the log grow with a session's unique tokens, not with
its turns squared. The same rule applies to the conversation's messages:

    context(t)      = context(p)[:prefix_len] + prompt_ids + completion_ids
    conversation(t) = conversation(p)[:message_prefix_len] + new_messages + [reply(t)]

where p is the turn's parent (``TurnCompleted.parent``; -1: none, an empty context). The gateway
encodes every turn it publishes with ``encode_delta`` and rebuilds the contexts it keeps with
``context_ids`` / ``conversation_items`` (the rule on one array, one turn at a time); the fold
rebuilds a session's turns with ``decode_context`` / ``decode_conversation``, the same rule on
contexts held as chunks linked to their parent's (``Context``, ``Linked``): a turn
that extends its parent copies nothing, so rebuilding a chain of n turns costs O(total tokens),
not O(n * context length); the chunks are joined (``Context.ids``) only where a caller needs
the tokens in one array.

>>> first = TurnCompleted(run="r", session="s", turn=0, prompt_ids=[1, 2], completion_ids=[3],
...                       logprobs=[-0.5])
>>> delta = encode_delta([1, 2, 3], [], [1, 2, 3, 4], [])
>>> delta.prefix_len, delta.prompt_ids.tolist()
(3, [4])
>>> second = TurnCompleted(run="r", session="s", turn=1, prefix_len=delta.prefix_len,
...                        prompt_ids=delta.prompt_ids, completion_ids=[5], logprobs=[-0.1])
>>> decode_context(decode_context(EMPTY_CONTEXT, first), second).ids().tolist()
[1, 2, 3, 4, 5]
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, NamedTuple, TypeVar

import numpy as np

from schemas.events import Int32Array, TurnCompleted

__all__ = [
    "EMPTY_CONTEXT",
    "Context",
    "Linked",
    "PromptDelta",
    "common_message_prefix_len",
    "common_prefix_len",
    "context_ids",
    "conversation_items",
    "decode_context",
    "decode_conversation",
    "delta_fits",
    "encode_delta",
    "replay_context",
]

_T = TypeVar("_T")
_NO_TOKENS: Int32Array = np.empty(0, dtype=np.int32)


def common_prefix_len(a: Sequence[int] | np.ndarray, b: Sequence[int] | np.ndarray) -> int:
    """Length of the longest common prefix of two token sequences (vectorized).

    >>> common_prefix_len([1, 2, 3, 9], [1, 2, 3, 4, 5])
    3
    """
    x = np.asarray(a, dtype=np.int64)
    y = np.asarray(b, dtype=np.int64)
    n = min(len(x), len(y))
    mismatch = np.flatnonzero(x[:n] != y[:n])
    return int(mismatch[0]) if len(mismatch) else n


def common_message_prefix_len(a: Iterable[object], b: Iterable[object]) -> int:
    """Length of the longest common prefix of two message lists (or of their keys), compared
    as values; an iterator is read only as far as the two agree (one more item)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class PromptDelta(NamedTuple):
    """A turn's prompt and conversation as TurnCompleted stores them."""

    prefix_len: int
    prompt_ids: np.ndarray  # int32: the tokens after the shared prefix (a copy, not a view)
    message_prefix_len: int
    new_messages: list[Any]


def encode_delta(
    context: Sequence[int] | np.ndarray,
    conversation: Sequence[object],
    prompt: Sequence[int] | np.ndarray,
    messages: Sequence[Any],
    *,
    message_keys: Iterable[object] | None = None,
    shared: int | None = None,
) -> PromptDelta:
    """Delta-encode ``prompt``/``messages`` against the parent turn's full ``context`` (its
    prompt + completion) and ``conversation`` (its messages + its reply).

    ``conversation`` is compared with ``message_keys`` where given, one per message of
    ``messages`` (a client re-serializes its history, so the gateway compares the canonical
    keys it keeps for its turns; an iterator is read only as far as they agree), else with
    ``messages`` themselves. ``shared``: the tokens the caller knows ``prompt`` shares with
    ``context`` (a prompt built by extending it); trusted, after an O(1) check of the last one,
    when it is the whole context (the most a prompt can share), else the prefix is compared
    token by token. ``prompt_ids`` is a copy: an event kept in memory does not hold the prompt.
    """
    ids = np.asarray(prompt, dtype=np.int32)  # once: a long prompt is a long list
    whole = len(context)
    if shared == whole <= len(ids) and (not whole or ids[whole - 1] == context[whole - 1]):
        prefix_len = whole  # the prompt continues the parent's whole context
    else:
        prefix_len = common_prefix_len(context, ids)
    compared = messages if message_keys is None else message_keys
    message_prefix_len = common_message_prefix_len(conversation, compared)
    return PromptDelta(
        prefix_len,
        ids[prefix_len:].copy(),
        message_prefix_len,
        list(messages[message_prefix_len:]),
    )


@dataclass(frozen=True, slots=True, eq=False)
class Linked(Generic[_T]):
    """A sequence as its own ``parts`` after those of the sequence it extends, which it shares:
    extending one copies nothing, so n turns that each extend their parent hold O(n) parts.
    Compared by identity (equality or a repr would walk every ancestor)."""

    before: Linked[_T] | None = field(repr=False)
    parts: tuple[_T, ...]
    size: int = field(init=False)
    """How many parts, the ancestors' included."""

    def __post_init__(self) -> None:
        inherited = self.before.size if self.before is not None else 0
        object.__setattr__(self, "size", inherited + len(self.parts))

    @classmethod
    def of(cls, parts: Iterable[_T]) -> Linked[_T]:
        return cls(None, tuple(parts))

    def all(self) -> list[_T]:
        """Every part, the ancestors' first."""
        links: list[Linked[_T]] = []
        link: Linked[_T] | None = self
        while link is not None:
            links.append(link)
            link = link.before
        return [part for link in reversed(links) for part in link.parts]

    def prefix(self, n: int) -> Linked[_T]:
        """The first ``n`` parts: this sequence itself when that is all of it."""
        if n == self.size:
            return self
        if not 0 <= n <= self.size:
            raise ValueError(f"a prefix of {n} of a sequence of {self.size}")
        return Linked(None, tuple(self.all()[:n]))

    def extend(self, parts: Iterable[_T]) -> Linked[_T]:
        return Linked(self, tuple(parts))


@dataclass(frozen=True, slots=True, eq=False)
class Context:
    """A turn's full context (its full prompt + its completion ids) as int32 chunks linked to
    its parent's, and its length in tokens."""

    chunks: Linked[Int32Array]
    length: int

    @classmethod
    def of(cls, ids: Int32Array) -> Context:
        """The context of these ids (one chunk, not copied)."""
        return cls(Linked(None, (ids,)), len(ids))

    def ids(self) -> Int32Array:
        """The tokens in one array: the chunk itself where there is one, else a join."""
        chunks = self.chunks.all()
        if len(chunks) == 1:
            return chunks[0]
        return np.concatenate(chunks) if chunks else _NO_TOKENS

    def prefix(self, n: int) -> Context:
        """The first ``n`` tokens: this context itself when that is all of it."""
        if n == self.length:
            return self
        if not 0 <= n <= self.length:
            raise ValueError(f"a prefix of {n} tokens of a context of {self.length}")
        return Context.of(self.ids()[:n])

    def extend(self, *chunks: Int32Array) -> Context:
        return Context(self.chunks.extend(chunks), self.length + sum(len(c) for c in chunks))


EMPTY_CONTEXT = Context(Linked(None, ()), 0)
"""The context of no turn: what a turn without a parent (-1) extends."""


def delta_fits(turn: TurnCompleted, context_len: int, conversation_len: int) -> bool:
    """Whether ``turn``'s delta can be taken against a parent context of ``context_len`` tokens
    and a parent conversation of ``conversation_len`` messages (its reply included)."""
    return turn.prefix_len <= context_len and turn.message_prefix_len <= conversation_len


def context_ids(parent: Int32Array, turn: TurnCompleted) -> Int32Array:
    """``decode_context`` for a parent held in one array, into one array: the gateway's path,
    one turn at a time, where the chunked form's objects cost more than the join they save."""
    return np.concatenate([parent[: turn.prefix_len], turn.prompt_ids, turn.completion_ids]).astype(
        np.int32, copy=False
    )


def conversation_items(parent: Sequence[Any], turn: TurnCompleted) -> tuple[Any, ...]:
    """``decode_conversation`` for a parent held in one sequence, as a tuple."""
    return (*parent[: turn.message_prefix_len], *turn.new_messages, turn.assistant_message)


def decode_context(parent: Context, turn: TurnCompleted) -> Context:
    """``turn``'s full context from its parent's: ``parent[:prefix_len] + prompt_ids +
    completion_ids`` (ValueError where prefix_len is beyond it: see ``delta_fits``)."""
    return parent.prefix(turn.prefix_len).extend(turn.prompt_ids, turn.completion_ids)


def decode_conversation(
    parent: Linked[Any], turn: TurnCompleted, key: Callable[[Any], object] | None = None
) -> Linked[Any]:
    """``turn``'s conversation (its messages + its reply) from its parent's:
    ``parent[:message_prefix_len] + new_messages + [reply]``; given ``key``, the same for the
    messages' keys (``parent`` then holds the parent's keys)."""
    new = (*turn.new_messages, turn.assistant_message)
    return parent.prefix(turn.message_prefix_len).extend(new if key is None else map(key, new))


def replay_context(turns: Sequence[TurnCompleted]) -> tuple[Int32Array, list[Any]]:
    """The full context (prompt + completion ids) and the conversation (messages + reply)
    after the last of ``turns`` (TurnCompleted events of turns 0..n-1, in order): what a turn
    whose parent is that last turn extends. Each turn's delta is taken against its parent's
    (``TurnCompleted.parent``), so only the last turn's line of ancestors is decoded; the
    context of turn p is ``replay_context(turns[: p + 1])``, and -1 (no parent) is empty."""
    line: list[TurnCompleted] = []
    index = len(turns) - 1
    while index >= 0:  # parents are earlier turns (TurnCompleted checks it): this ends
        line.append(turns[index])
        index = turns[index].parent
    context, conversation = EMPTY_CONTEXT, Linked[Any].of(())
    for turn in reversed(line):
        context = decode_context(context, turn)
        conversation = decode_conversation(conversation, turn)
    return context.ids(), conversation.all()
