"""Rebuilding a session's prompts from their deltas, and the token arrays of one sample.

Private to the fold: ``consumers.fold`` decides which turns are folded and what the samples are
worth; this module does the token arithmetic, with numpy and no per-token Python loop.

A turn's full context (its full prompt + its completion) is kept as a tuple of array chunks, not
one array: in an append-only session every prompt is "all of the previous context + new tokens",
so chaining chunks rebuilds n turns in O(total tokens) instead of O(n * context length). The
chunks are only joined where a delta cuts into the previous context, and once per sample.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from consumers.errors import FoldError
from schemas.events import JSON, Float32Array, Int8Array, Int32Array, TurnCompleted

_NO_TOKENS: Int32Array = np.empty(0, dtype=np.int32)
_INT32_MIN, _INT32_MAX = int(np.iinfo(np.int32).min), int(np.iinfo(np.int32).max)


@dataclass(frozen=True, slots=True)
class RebuiltTurn:
    """One turn with its delta decoded."""

    event: TurnCompleted
    context: tuple[Int32Array, ...]  # chunks of full prompt + completion
    prompt_len: int  # tokens in the full prompt
    appended: int  # prompt tokens after the previous turn's full context (when ``extends``)
    extends: bool  # the full prompt starts with the previous turn's whole full context
    conversation: list[JSON]  # the messages the model answered, before its own reply


@dataclass(frozen=True, slots=True)
class SampleArrays:
    input_ids: Int32Array
    loss_mask: Int8Array
    logprobs: Float32Array
    versions: Int32Array
    turn_ends: Int32Array


def _join(chunks: Sequence[Int32Array]) -> Int32Array:
    return np.concatenate(chunks) if chunks else _NO_TOKENS


def rebuild(run: str, session: str, turns: Sequence[TurnCompleted]) -> list[RebuiltTurn]:
    """Decode the deltas of turns 0..n-1 (in that order); FoldError names a turn that lies."""
    rebuilt: list[RebuiltTurn] = []
    context: tuple[Int32Array, ...] = ()
    context_len = 0
    history: list[JSON] = []  # conversation of the previous turn + its assistant reply
    for event in turns:
        where = f"run={run} session={session} turn {event.turn}"
        if event.prefix_len > context_len:
            raise FoldError(
                f"{where}: prefix_len={event.prefix_len} but "
                + (
                    "turn 0 has no previous context (it must be 0)"
                    if event.turn == 0
                    else f"turn {event.turn - 1}'s full context has only {context_len} tokens"
                )
                + "; the delta encoding is inconsistent, dead-letter the session"
            )
        if event.message_prefix_len > len(history):
            raise FoldError(
                f"{where}: message_prefix_len={event.message_prefix_len} but the previous "
                f"conversation has only {len(history)} messages; the delta encoding is "
                f"inconsistent, dead-letter the session"
            )
        if not _INT32_MIN <= event.weight_version <= _INT32_MAX:
            raise FoldError(
                f"{where}: weight_version={event.weight_version} does not fit the int32 "
                f"versions column; dead-letter the session"
            )
        if event.prefix_len == context_len:
            extends = True
            prompt = (*context, event.prompt_ids)
        else:
            whole = _join(context)
            dropped = whole[event.prefix_len :]
            # A client that resends history with a shorter prefix_len (no delta encoding) still
            # extends the context: decide on the tokens, not on prefix_len alone.
            resent = event.prompt_ids[: len(dropped)]
            extends = len(resent) == len(dropped) and bool(np.array_equal(resent, dropped))
            prompt = (whole[: event.prefix_len], event.prompt_ids)
        prompt_len = event.prefix_len + len(event.prompt_ids)
        conversation = [*history[: event.message_prefix_len], *event.new_messages]
        rebuilt.append(
            RebuiltTurn(
                event=event,
                context=(*prompt, event.completion_ids),
                prompt_len=prompt_len,
                appended=prompt_len - context_len,
                extends=extends,
                conversation=conversation,
            )
        )
        context = (*prompt, event.completion_ids)
        context_len = prompt_len + len(event.completion_ids)
        history = [*conversation, event.assistant_message]
    return rebuilt


def split(turns: Sequence[RebuiltTurn], per_turn: bool) -> list[list[RebuiltTurn]]:
    """Cut the turns into samples: one per turn, or one per run of context-extending turns."""
    if per_turn:
        return [[turn] for turn in turns]
    samples: list[list[RebuiltTurn]] = []
    for turn in turns:
        if samples and turn.extends:
            samples[-1].append(turn)
        else:
            samples.append([turn])
    return samples


def sample_arrays(sample: Sequence[RebuiltTurn]) -> SampleArrays:
    """The token arrays of one sample whose turns each extend the previous one's context.

    The sample's tokens are then exactly the last turn's full context, read as alternating runs:
    prompt tokens the model read (mask 0, logprob 0, version -1), then the completion it
    generated (mask 1, its logprobs, its turn's weight_version).
    """
    n = len(sample)
    runs = np.empty(2 * n, dtype=np.int64)
    runs[0] = sample[0].prompt_len
    runs[2::2] = [turn.appended for turn in sample[1:]]
    runs[1::2] = [len(turn.event.completion_ids) for turn in sample]
    run_versions = np.full(2 * n, -1, dtype=np.int32)
    run_versions[1::2] = [turn.event.weight_version for turn in sample]
    logprobs = np.concatenate(
        [
            part
            for turn, read in zip(sample, runs[0::2].tolist(), strict=True)
            for part in (np.zeros(read, dtype=np.float32), turn.event.logprobs)
        ]
    )
    return SampleArrays(
        input_ids=_join(sample[-1].context),
        loss_mask=np.repeat(np.tile(np.array([0, 1], dtype=np.int8), n), runs),
        logprobs=logprobs.astype(np.float32, copy=False),
        versions=np.repeat(run_versions, runs),
        turn_ends=np.cumsum(runs)[1::2].astype(np.int32),
    )
