"""Rebuilding a session's turns from their deltas, its chains, and the token spans of a sample.

Private to the fold: ``consumers.fold`` decides which turns are folded and what the samples are
worth; this module does the token arithmetic, with numpy and no per-token Python loop.

A session is a tree (DESIGN §5): each turn's delta is taken against its parent turn
(``TurnCompleted.parent``; -1: none, an empty context), and decoded by ``schemas.delta``, the
gateway's decoder, on contexts held as array chunks linked to the parent's (``Context``): in an
append-only chain every prompt is "all of the parent's context + new tokens", so n turns are
rebuilt in O(total tokens) time and memory instead of O(n * context length), holding O(n)
chunks. The chunks are only joined where a delta cuts into its parent's context, and once per
sample. A turn's conversation is linked to its parent's the same way.

A sample comes out as the wire form stores it (``SampleSpans``: its ids once, the generated
tokens as spans of one weight version each, their logprobs), straight from the turns'
boundaries: no per-token mask is made to be scanned back into spans.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from consumers.errors import FoldError
from schemas.agents import is_side_class
from schemas.delta import (
    EMPTY_CONTEXT,
    Context,
    Linked,
    common_prefix_len,
    decode_context,
    decode_conversation,
)
from schemas.events import JSON, UNKNOWN_VERSION, Float32Array, Int32Array, TurnCompleted
from schemas.images import ImageRef, prompt_images
from schemas.spans import merge_spans

_INT32_MIN, _INT32_MAX = int(np.iinfo(np.int32).min), int(np.iinfo(np.int32).max)
_NO_MESSAGES: Linked[JSON] = Linked(None, ())


@dataclass(frozen=True, slots=True)
class RebuiltTurn:
    """One turn with its delta decoded against its parent."""

    event: TurnCompleted
    context: Context  # its full prompt + completion
    prompt_len: int  # tokens in the full prompt
    appended: int  # prompt tokens after the parent's full context (when ``extends``)
    extends: bool  # the full prompt starts with the parent's whole full context
    shared: int  # leading tokens of the full prompt equal to the parent's full context
    first_generated: int | None  # where the first token any turn generated lies in ``context``
    conversation: Linked[JSON]  # the messages the model answered and its own reply
    images: tuple[ImageRef, ...] = ()  # its full prompt's images (schemas.images.prompt_images)

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
class SampleSpans:
    """A sample's tokens in ``CompactTrajectory``'s terms."""

    input_ids: Int32Array
    spans: Int32Array  # (start, end) of each maximal run of generated tokens of one version
    span_versions: Int32Array
    gen_logprobs: Float32Array  # one per generated token, in order
    turn_ends: Int32Array


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
        before = parent.context if parent is not None else EMPTY_CONTEXT
        history = parent.conversation if parent is not None else _NO_MESSAGES
        context_len = before.length
        _check(run, session, event, context_len, history.size)
        if event.prefix_len == context_len:
            extends, shared = True, context_len
        else:
            whole = before.ids()
            before = Context.of(whole)  # joined once
            # A client that resends history with a shorter prefix_len (no delta encoding) still
            # shares it, and extends the context when it resends all of it: decide on the
            # tokens, not on prefix_len alone.
            shared = event.prefix_len + common_prefix_len(
                whole[event.prefix_len :], event.prompt_ids
            )
            extends = shared == context_len
        prompt_len = event.prefix_len + len(event.prompt_ids)
        inherited = parent.first_generated if parent is not None else None
        if inherited is None or inherited >= shared:
            inherited = prompt_len if len(event.completion_ids) else None
        rebuilt.append(
            RebuiltTurn(
                event=event,
                context=decode_context(before, event),
                prompt_len=prompt_len,
                appended=prompt_len - context_len,
                extends=extends,
                shared=shared,
                first_generated=inherited,
                conversation=decode_conversation(history, event),
                images=tuple(
                    prompt_images(
                        parent.images if parent is not None else (), event.prefix_len, event.images
                    )
                ),
            )
        )
    return rebuilt


def split(turns: Sequence[RebuiltTurn], per_turn: bool) -> Chains:
    """Cut the turns into chains: a turn joins its parent's chain when it extends the parent,
    the parent is still that chain's last turn (the first continuing child carries the chain
    on), both were asked for by one agent (the same ``agent`` id, or neither has one: a
    client that names no agents) and the chain is not ended; any other turn starts a chain.
    A side request (``schemas.agents.SIDE_CLASSES``) starts a chain it ends at once, and a
    turn whose client went away (``client_gone``) ends its chain: nothing continues either.
    A turn whose client went away carries its parent's chain on only where no turn of its agent
    whose client stayed extends that parent: a client that retries after a cut stream goes on
    from the retry, which carries the conversation; the cut turn is a branch of its own.
    The samples are the chains, numbered by their first turn, or (``per_turn``) one per turn;
    forks are counted on the chains either way."""
    # (parent, agent) of the turns that extend their parent and whose client stayed: where one
    # exists, it carries the chain on, not a sibling whose client went away.
    stayed = {
        (turn.event.parent, agent_id(turn.event))
        for turn in turns
        if turn.extends and not turn.event.client_gone and not is_side(turn.event)
    }
    chain_of: list[int] = []
    last_of: list[int] = []  # the last turn of each chain so far
    ended: list[bool] = []  # nothing may continue the chain
    starts: list[int] = []
    for turn in turns:
        event = turn.event
        parent = event.parent
        side = is_side(event)
        if (
            parent >= 0
            and turn.extends
            and not side
            and last_of[chain_of[parent]] == parent
            and not ended[chain_of[parent]]
            and agent_id(turns[parent].event) == agent_id(event)
            and not (event.client_gone and (parent, agent_id(event)) in stayed)
        ):
            chain = chain_of[parent]
            last_of[chain] = event.turn
        else:
            chain = len(last_of)
            last_of.append(event.turn)
            ended.append(False)
            starts.append(event.turn)
        ended[chain] = side or event.client_gone
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


def agent_id(event: TurnCompleted) -> str | None:
    """The agent the turn's client named (``TurnCompleted.agent["id"]``); None: it named none."""
    value = event.agent.get("id")
    return value if isinstance(value, str) and value else None


def is_side(event: TurnCompleted) -> bool:
    """A side request (compaction, auxiliary, side reply, count_tokens): not the agent's own
    turn, so it continues no chain and no chain continues it."""
    return is_side_class(event.agent.get("request_class"))


def _version_runs(
    sample: Sequence[RebuiltTurn], starts: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The runs of generated tokens of one version each (starts, ends, versions): a turn's
    completion is one run, or one per pair of its ``version_spans`` (null: UNKNOWN_VERSION)."""
    run_starts: list[int] = []
    run_ends: list[int] = []
    run_versions: list[int] = []
    for turn, start in zip(sample, starts.tolist(), strict=True):
        event = turn.event
        pairs = event.version_spans
        if pairs is None:
            pairs = [(event.weight_version, len(event.completion_ids))]
        for version, count in pairs:
            run_starts.append(start)
            run_ends.append(start + count)
            run_versions.append(UNKNOWN_VERSION if version is None else version)
            start += count
    return (
        np.asarray(run_starts, dtype=np.int64),
        np.asarray(run_ends, dtype=np.int64),
        np.asarray(run_versions, dtype=np.int32),
    )


def sample_spans(sample: Sequence[RebuiltTurn]) -> SampleSpans:
    """The tokens and generated spans of one sample whose turns each extend the one before
    (their parent).

    The sample's tokens are then exactly the last turn's full context, read as alternating runs:
    prompt tokens the model read, then the completion it generated (its logprobs, its turn's
    weight_version). Completions that touch and share a version are one span, as the wire
    form's spans are maximal.
    """
    n = len(sample)
    runs = np.empty(2 * n, dtype=np.int64)
    runs[0] = sample[0].prompt_len
    runs[2::2] = [turn.appended for turn in sample[1:]]
    runs[1::2] = [len(turn.event.completion_ids) for turn in sample]
    bounds = np.cumsum(runs)
    ends = bounds[1::2]
    if all(turn.event.version_spans is None for turn in sample):
        versions = np.array([turn.event.weight_version for turn in sample], dtype=np.int32)
        spans, span_versions = merge_spans(bounds[0::2], ends, versions)
    else:  # a turn sampled by several versions (continued after an abort): a run per version
        spans, span_versions = merge_spans(*_version_runs(sample, bounds[0::2]))
    logprobs = [turn.event.logprobs for turn in sample]
    return SampleSpans(
        input_ids=sample[-1].context.ids(),
        spans=spans,
        span_versions=span_versions,
        gen_logprobs=np.concatenate(logprobs).astype(np.float32, copy=False),
        turn_ends=ends.astype(np.int32),
    )
