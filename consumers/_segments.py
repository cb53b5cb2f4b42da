"""Rebuilding a session's prompts from their deltas, its chains, and the token arrays of a sample.

Private to the fold: ``consumers.fold`` decides which turns are folded and what the samples are
worth; this module does the token arithmetic, with numpy and no per-token Python loop.

A session is a tree (DESIGN §5): each turn's delta is taken against its parent turn
(``TurnCompleted.parent``; -1: none, an empty context). A turn's full context (its full prompt +
its completion) is kept as array chunks linked to its parent's (``Linked``), not one array: in
an append-only chain every prompt is "all of the parent's context + new tokens", so linking
chunks rebuilds n turns in O(total tokens) time and memory instead of O(n * context length), and
holds O(n) chunks, not a copy of every ancestor's per turn. The chunks are only joined where a
delta cuts into its parent's context, and once per sample. A turn's conversation is linked to
its parent's the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import numpy as np

from consumers.errors import FoldError
from schemas.delta import common_prefix_len
from schemas.events import JSON, Float32Array, Int8Array, Int32Array, TurnCompleted

_NO_TOKENS: Int32Array = np.empty(0, dtype=np.int32)
_INT32_MIN, _INT32_MAX = int(np.iinfo(np.int32).min), int(np.iinfo(np.int32).max)
_T = TypeVar("_T")


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

    def all(self) -> list[_T]:
        """Every part, the ancestors' first."""
        links: list[Linked[_T]] = []
        link: Linked[_T] | None = self
        while link is not None:
            links.append(link)
            link = link.before
        return [part for link in reversed(links) for part in link.parts]


@dataclass(frozen=True, slots=True)
class RebuiltTurn:
    """One turn with its delta decoded against its parent."""

    event: TurnCompleted
    context: Linked[Int32Array]  # chunks of full prompt + completion
    prompt_len: int  # tokens in the full prompt
    appended: int  # prompt tokens after the parent's full context (when ``extends``)
    extends: bool  # the full prompt starts with the parent's whole full context
    shared: int  # leading tokens of the full prompt equal to the parent's full context
    first_generated: int | None  # where the first token any turn generated lies in ``context``
    messages: Linked[JSON]  # the messages the model answered, before its own reply

    @property
    def conversation(self) -> list[JSON]:
        """The messages the model answered, before its own reply."""
        return self.messages.all()

    @property
    def inside_generated(self) -> bool:
        """The prefix shared with the parent holds a generated token (an edit, a retry)."""
        return self.first_generated is not None and self.first_generated < self.shared


@dataclass(frozen=True, slots=True)
class Chains:
    """How the turns were cut into samples, and where the session's tree branches."""

    samples: list[list[RebuiltTurn]]
    turn_samples: tuple[int, ...]  # the sample of each turn, indexed by turn
    chain_starts: frozenset[int]  # the turns that start a chain
    fork_turns: tuple[int, ...]  # chain starts that diverge inside generated history


@dataclass(frozen=True, slots=True)
class SampleArrays:
    input_ids: Int32Array
    loss_mask: Int8Array
    logprobs: Float32Array
    versions: Int32Array
    turn_ends: Int32Array


def _join(chunks: Sequence[Int32Array]) -> Int32Array:
    return np.concatenate(chunks) if chunks else _NO_TOKENS


def _check(run: str, session: str, event: TurnCompleted, context_len: int, messages: int) -> None:
    where = f"run={run} session={session} turn {event.turn}"
    parent = event.parent
    if event.prefix_len > context_len:
        raise FoldError(
            f"{where}: prefix_len={event.prefix_len} but "
            + (
                "it has no parent turn (parent -1), so no context to share (it must be 0)"
                if parent < 0
                else f"its parent turn {parent}'s full context has only {context_len} tokens"
            )
            + "; the delta encoding is inconsistent, dead-letter the session"
        )
    if event.message_prefix_len > messages:
        raise FoldError(
            f"{where}: message_prefix_len={event.message_prefix_len} but the conversation of "
            f"its parent turn {parent} (with its reply) has only {messages} messages; the delta "
            f"encoding is inconsistent, dead-letter the session"
        )
    if not _INT32_MIN <= event.weight_version <= _INT32_MAX:
        raise FoldError(
            f"{where}: weight_version={event.weight_version} does not fit the int32 "
            f"versions column; dead-letter the session"
        )


def rebuild(run: str, session: str, turns: Sequence[TurnCompleted]) -> list[RebuiltTurn]:
    """Decode the deltas of turns 0..n-1 (in that order), each against its parent's context;
    FoldError names a turn whose delta does not fit its parent."""
    rebuilt: list[RebuiltTurn] = []
    for event in turns:
        parent = rebuilt[event.parent] if event.parent >= 0 else None
        context_len = parent.prompt_len + len(parent.event.completion_ids) if parent else 0
        history_len = parent.messages.size + 1 if parent else 0  # its messages and its reply
        _check(run, session, event, context_len, history_len)
        if event.prefix_len == context_len:
            extends, shared = True, context_len
            before = parent.context if parent is not None else None
            context = Linked(before, (event.prompt_ids, event.completion_ids))
        else:
            assert parent is not None  # prefix_len > 0 = context_len is refused by _check
            whole = _join(parent.context.all())
            dropped = whole[event.prefix_len :]
            # A client that resends history with a shorter prefix_len (no delta encoding) still
            # shares it, and extends the context when it resends all of it: decide on the
            # tokens, not on prefix_len alone.
            shared = event.prefix_len + common_prefix_len(dropped, event.prompt_ids)
            extends = shared == context_len
            parts = (whole[: event.prefix_len], event.prompt_ids, event.completion_ids)
            context = Linked(None, parts)
        prompt_len = event.prefix_len + len(event.prompt_ids)
        inherited = parent.first_generated if parent is not None else None
        if inherited is None or inherited >= shared:
            inherited = prompt_len if len(event.completion_ids) else None
        new_messages = tuple(event.new_messages)
        if parent is None:
            messages = Linked(None, new_messages)
        elif event.message_prefix_len == history_len:
            messages = Linked(parent.messages, (parent.event.assistant_message, *new_messages))
        else:
            history = [*parent.conversation, parent.event.assistant_message]
            messages = Linked(None, (*history[: event.message_prefix_len], *new_messages))
        rebuilt.append(
            RebuiltTurn(
                event=event,
                context=context,
                prompt_len=prompt_len,
                appended=prompt_len - context_len,
                extends=extends,
                shared=shared,
                first_generated=inherited,
                messages=messages,
            )
        )
    return rebuilt


def split(turns: Sequence[RebuiltTurn], per_turn: bool) -> Chains:
    """Cut the turns into chains: a turn joins its parent's chain when it extends the parent
    and the parent is still that chain's last turn (the first continuing child carries the
    chain on); any other turn starts a chain. The samples are the chains, numbered by their
    first turn, or (``per_turn``) one per turn; forks are counted on the chains either way."""
    chain_of: list[int] = []
    last_of: list[int] = []  # the last turn of each chain so far
    starts: list[int] = []
    for turn in turns:
        parent = turn.event.parent
        if parent >= 0 and turn.extends and last_of[chain_of[parent]] == parent:
            chain = chain_of[parent]
            last_of[chain] = turn.event.turn
        else:
            chain = len(last_of)
            last_of.append(turn.event.turn)
            starts.append(turn.event.turn)
        chain_of.append(chain)
    # A fork is a true divergence: a chain start that does not extend its parent but shares
    # generated tokens with it (an edited or truncated history). A chain start that extends its
    # parent (a retry of that turn, a second sub-agent started from one context) is a branch:
    # nothing was rewritten. Chain 0 starts at turn 0, whose parent is -1.
    forks = tuple(
        t
        for t in starts
        if turns[t].event.parent >= 0 and not turns[t].extends and turns[t].inside_generated
    )
    if per_turn:
        samples = [[turn] for turn in turns]
        return Chains(samples, tuple(range(len(turns))), frozenset(starts), forks)
    chains: list[list[RebuiltTurn]] = [[] for _ in last_of]
    for turn, chain in zip(turns, chain_of, strict=True):
        chains[chain].append(turn)
    return Chains(chains, tuple(chain_of), frozenset(starts), forks)


def sample_arrays(sample: Sequence[RebuiltTurn]) -> SampleArrays:
    """The token arrays of one sample whose turns each extend the one before (their parent).

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
        input_ids=_join(sample[-1].context.all()),
        loss_mask=np.repeat(np.tile(np.array([0, 1], dtype=np.int8), n), runs),
        logprobs=logprobs.astype(np.float32, copy=False),
        versions=np.repeat(run_versions, runs),
        turn_ends=np.cumsum(runs)[1::2].astype(np.int32),
    )
