"""Delta encoding of a turn's prompt against its parent turn's full context (DESIGN §3).

A multi-turn session's prompt usually repeats everything before it; storing only the length of
the shared prefix and the new tokens makes the log grow with a session's unique tokens, not with
its turns squared. The same rule applies to the conversation's messages.

>>> common_prefix_len([1, 2, 3, 9], [1, 2, 3, 4, 5])
3
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

__all__ = ["common_message_prefix_len", "common_prefix_len"]


def common_prefix_len(a: Sequence[int] | np.ndarray, b: Sequence[int] | np.ndarray) -> int:
    """Length of the longest common prefix of two token sequences (vectorized)."""
    x = np.asarray(a, dtype=np.int64)
    y = np.asarray(b, dtype=np.int64)
    n = min(len(x), len(y))
    mismatch = np.flatnonzero(x[:n] != y[:n])
    return int(mismatch[0]) if len(mismatch) else n


def common_message_prefix_len(
    a: Sequence[Any], b: Sequence[Any], key: Callable[[Any], object] | None = None
) -> int:
    """Length of the longest common prefix of two message lists, compared as values (or as
    their ``key``)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if (x != y) if key is None else (key(x) != key(y)):
            break
        n += 1
    return n


class PromptDelta(NamedTuple):
    """A turn's prompt and conversation as TurnCompleted stores them."""

    prefix_len: int
    prompt_ids: np.ndarray  # int32: the tokens after the shared prefix
    message_prefix_len: int
    new_messages: list[Any]


def encode_delta(
    context: Sequence[int] | np.ndarray,
    conversation: Sequence[Any],
    prompt: Sequence[int] | np.ndarray,
    messages: Sequence[Any],
    message_key: Callable[[Any], object] | None = None,
) -> PromptDelta:
    """Delta-encode ``prompt``/``messages`` against the parent turn's full ``context`` (its
    prompt + completion) and ``conversation`` (its messages + its assistant reply). Messages
    equal under ``message_key`` count as shared (a client re-serializes its history)."""
    prefix_len = common_prefix_len(context, prompt)
    message_prefix_len = common_message_prefix_len(conversation, messages, message_key)
    return PromptDelta(
        prefix_len,
        np.asarray(prompt, dtype=np.int32)[prefix_len:],
        message_prefix_len,
        list(messages[message_prefix_len:]),
    )


def replay_context(turns: Sequence[Any]) -> tuple[np.ndarray, list[Any]]:
    """The full context (prompt + completion ids) and the conversation (messages + reply)
    after the last of ``turns`` (TurnCompleted events of turns 0..n-1, in order): what a turn
    whose parent is that last turn extends. Each turn's delta is taken against its parent's
    (``TurnCompleted.parent``), so only the last turn's line of ancestors is replayed; the
    context of turn p is ``replay_context(turns[: p + 1])``, and -1 (no parent) is empty. The
    fold does the same with validation and per-token arrays."""
    line: list[Any] = []
    index = len(turns) - 1
    while index >= 0:  # parents are earlier turns (TurnCompleted checks it): this ends
        line.append(turns[index])
        index = turns[index].parent
    context = np.empty(0, dtype=np.int32)
    conversation: list[Any] = []
    for turn in reversed(line):
        prompt = np.concatenate([context[: turn.prefix_len], turn.prompt_ids])
        context = np.concatenate([prompt, turn.completion_ids]).astype(np.int32)
        conversation = [*conversation[: turn.message_prefix_len], *turn.new_messages]
        conversation.append(turn.assistant_message)
    return context, conversation
