"""A session as an aggregate: its state changes only by applying its own events (PURE).

The live path builds a ``TurnCompleted`` with ``turn_event``, publishes it and applies it;
recovering a session from the log is the same ``apply`` folded over its stored events, so both
paths agree by construction::

    state = fold(events, kept=Kept())      # recovery: reduce(apply, events)
    event = turn_event(state, draft)        # the next turn, delta-encoded against its parent
    state = apply(state, event)             # after JetStream acknowledged ``event``

A session is a tree (DESIGN §5): a main agent and its sub-agents take turns on one session, each
continuing its own conversation. The state keeps up to ``Kept.turns`` turns (``TurnNode``: the
full context ids, the conversation, the tools); a request continues, token for token, the kept
turn whose conversation it extends furthest (``gateway.core.branches.continued_turn``), and a
request that extends none is delta-encoded against the turn sharing the longest token prefix
(``prefix_parent``).
A side request (``TurnCompleted.agent["request_class"]`` in ``SIDE_CLASSES``: a compaction, an
auxiliary call) is a turn like any other but leaves its parent the tip of its conversation
(``TurnNode.continued`` stays False). Applying turn t touches t and its parent; beyond
``Kept.turns`` turns, or ``Kept.tokens`` tokens in the arrays they hold, the least recently
touched turn is forgotten (still counted, no longer continuable), the same way live and in
recovery.

A worked example (token ids only; one message per turn):

>>> opened = SessionOpened(run="r", session="s", group="g")
>>> state = apply(None, opened)
>>> hi = {"role": "user", "content": "hi"}
>>> first = turn_event(state, TurnDraft(prompt_ids=[1, 2], messages=[hi], tools=None,
...     completion_ids=[3], logprobs=[-0.5], text="yo"))
>>> state = apply(state, first)
>>> first.parent_turn, state.turns, state.nodes[0].context_ids.tolist()
(-1, 1, [1, 2, 3])
>>> again = [*state.nodes[0].conversation, {"role": "user", "content": "again"}]
>>> from gateway.core.branches import continued_turn
>>> continued_turn(state, again, None).turn  # the kept turn this conversation extends
0
>>> second = turn_event(state, TurnDraft(prompt_ids=[1, 2, 3, 4], messages=again, tools=None,
...     completion_ids=[5], logprobs=[-0.1], parent_turn=0))
>>> second.parent_turn, second.prefix_len, second.prompt_ids.tolist(), len(second.new_messages)
(0, 3, [4], 1)
>>> state = apply(state, second)
>>> bool(np.shares_memory(state.nodes[0].context_ids, state.nodes[1].context_ids))  # one array
True
>>> prefix_parent(state, [1, 2, 9])  # a prompt that continues no turn: the longest shared prefix
1
>>> apply(state, first).turns  # a redelivered turn is a no-op
2

The state is data only: what a turn leaves for the one that continues it (its render, the JSON
text of its ids) is a cache the live ``Session`` holds beside the state
(``gateway.core.session_store.ContextCache``), never written into a node. One thing is
changed in place, not copied: a kept turn's event, whose ``prompt_ids`` are pointed at their
place in the chain's array (the same values, held once; the one event object everywhere).

Turns apply in index order: a turn whose index is not the session's next one (a duplicate, or
one past a gap) changes nothing. Events of another session are a programming error.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gateway.core.agents import SIDE_CLASSES
from gateway.core.conversation import MessageKey, message_key, message_keys
from gateway.frozen import evolved
from schemas.delta import (
    PromptDelta,
    common_prefix_len,
    context_ids,
    conversation_items,
    delta_fits,
    encode_delta,
)
from schemas.events import SessionClosed, SessionEvent, SessionOpened, TurnCompleted
from schemas.images import ImageRef, prompt_images

__all__ = [
    "Kept",
    "SessionState",
    "TurnDraft",
    "TurnNode",
    "apply",
    "fold",
    "prefix_parent",
    "turn_event",
]

JSON = dict[str, Any]
_NO_IDS = np.empty(0, dtype=np.int32)


@dataclass(frozen=True)
class Kept:
    """How much of a session stays continuable token for token (GatewaySettings
    ``session_turns_kept``, ``session_tokens_kept``). Turns beyond either bound, least recently
    touched first, are forgotten: still counted, no longer continuable. The token bound keeps a
    client that branches a session many times at full context from holding as many contexts."""

    turns: int = 64
    tokens: int = 1 << 20  # 4 MiB of int32 ids per session

    def __post_init__(self) -> None:
        if self.turns < 1 or self.tokens < 1:
            raise ValueError(f"a session keeps >= 1 turn and >= 1 token, not {self}")


@dataclass(frozen=True)
class TurnNode:
    """A kept turn: what a later turn needs to continue it token for token."""

    event: TurnCompleted
    # Its full prompt + completion (int32). Where a later turn extends it, a view into that turn's
    # array: a chain of turns holds one array, its tip's, not one copy per turn.
    context_ids: np.ndarray
    conversation: tuple[JSON, ...]  # the turn's messages + the reply the client received
    keys: tuple[MessageKey, ...]  # message_key of each message of ``conversation``
    tools: list[JSON] | None
    continued: bool = False  # a later turn extends it: no longer the tip of a conversation
    # The images of its full prompt, in order (schemas.images.prompt_images); () for text.
    images: tuple[ImageRef, ...] = ()

    @property
    def turn(self) -> int:
        return self.event.turn

    @property
    def completion_ids(self) -> np.ndarray:
        return self.context_ids[len(self.context_ids) - len(self.event.completion_ids) :]


@dataclass(frozen=True)
class SessionState:
    """What the log says about one session: enough to continue any kept turn token for token."""

    run: str
    id: str
    group: str | None = None
    metadata: JSON = field(default_factory=dict)
    created_at: float = 0.0
    turns: int = 0  # turns applied so far: the next turn's index
    closed: bool = False
    status: str = "open"
    last_turn: TurnCompleted | None = None  # the event of the turn applied last
    kept: Kept = field(default_factory=Kept)  # how many nodes, how many tokens
    # The kept turns by index, least recently touched first (the eviction order).
    nodes: Mapping[int, TurnNode] = field(default_factory=dict)

    @property
    def last(self) -> TurnNode | None:
        """The node of the turn applied last (None before the first turn)."""
        return None if self.last_turn is None else self.nodes.get(self.last_turn.turn)

    @property
    def context_ids(self) -> np.ndarray:
        """The last turn's full context (a linear session's whole token history)."""
        last = self.last
        return _NO_IDS if last is None else last.context_ids

    @property
    def conversation(self) -> tuple[JSON, ...]:
        """The last turn's messages + its reply."""
        last = self.last
        return () if last is None else last.conversation

    @property
    def last_completion_ids(self) -> list[int]:
        last = self.last
        return [] if last is None else last.completion_ids.tolist()

    def describe(self) -> JSON:
        return {
            "session_id": self.id,
            "run": self.run,
            "group": self.group,
            "metadata": self.metadata,
            "turns": self.turns,
            "status": self.status,
            "closed": self.closed,
            "created_at": self.created_at,
        }


@dataclass(frozen=True)
class TurnDraft:
    """A generated turn before it is an event: what the prompt was and what was sampled."""

    prompt_ids: Sequence[int] | np.ndarray
    messages: Sequence[JSON]  # the turn's whole conversation (chat); () for text completions
    tools: list[JSON] | None
    completion_ids: Sequence[int]
    logprobs: Sequence[float]
    text: str = ""
    tool_calls: list[JSON] = field(default_factory=list)
    finish_reason: str = "stop"
    sampling: JSON = field(default_factory=dict)
    weight_version: int = 0
    version_spans: list[tuple[int | None, int]] | None = None  # TurnCompleted.version_spans
    template_hash: str = ""
    backend: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    created_at: float = 0.0
    request: JSON = field(default_factory=dict)  # TurnRequest.record
    # The turn it continues or shares the most with (-1: none); None, or a turn no longer
    # kept: the kept turn sharing the longest token prefix with prompt_ids.
    parent_turn: int | None = None
    logprobs_kind: str = "sampled"  # TurnCompleted.logprobs_kind
    # Where known, the tokens prompt_ids shares with parent_turn's context: a prompt that
    # continues the parent holds its whole context (not compared again, token by token).
    prefix_len: int | None = None
    # ``message_key`` of each of ``messages``, where the caller has them (the request's,
    # ``TurnRequest.keys``); None: computed here.
    keys: Sequence[MessageKey] | None = None
    reply_id: str = ""  # TurnCompleted.reply_id: the request's own id, made before its index
    agent: JSON = field(default_factory=dict)  # TurnCompleted.agent
    client_gone: bool = False  # TurnCompleted.client_gone
    images: Sequence[ImageRef] = ()  # the images of the whole prompt, in order


# -- the delta base of a turn that continues none ------------------------------------------


def prefix_parent(state: SessionState, prompt_ids: Sequence[int] | np.ndarray) -> int:
    """The kept turn whose context shares the longest token prefix with ``prompt_ids`` (the
    delta base of a turn that continues none); ties go to the most recent; -1: none shares a
    token."""
    prompt = np.asarray(prompt_ids, dtype=np.int32)
    shared_with: dict[int, int] = {}  # id(array owner) -> shared tokens
    best, best_shared = -1, 0
    for node in state.nodes.values():
        ids = node.context_ids
        # Views are prefixes of their owner (see _apply_turn): one comparison per owned array.
        owner = ids if ids.base is None else ids.base
        if id(owner) not in shared_with:
            shared_with[id(owner)] = common_prefix_len(owner, prompt)
        shared = min(len(ids), shared_with[id(owner)])
        if shared > best_shared or (shared and shared == best_shared and node.turn > best):
            best, best_shared = node.turn, shared
    return best


# -- the events ---------------------------------------------------------------------------------


def turn_event(state: SessionState, draft: TurnDraft) -> TurnCompleted:
    """``draft`` as the session's next turn, delta-encoded against its parent turn."""
    parent = draft.parent_turn
    if parent is None or (parent >= 0 and parent not in state.nodes):
        parent = prefix_parent(state, draft.prompt_ids)  # none chosen, or no longer kept
    node = state.nodes.get(parent)
    delta = encode_delta(
        _NO_IDS if node is None else node.context_ids,
        () if node is None else node.keys,
        draft.prompt_ids,
        draft.messages,
        # The request's keys, computed once at the edge; else each only as far as they agree.
        message_keys=map(message_key, draft.messages) if draft.keys is None else draft.keys,
        shared=draft.prefix_len if parent == draft.parent_turn else None,
    )
    own: list[ImageRef] = []
    if draft.images or (node is not None and node.images):
        delta, own = _with_images(delta, draft, () if node is None else node.images)
    return TurnCompleted(
        run=state.run,
        session=state.id,
        turn=state.turns,
        parent_turn=-1 if node is None else parent,
        created_at=draft.created_at,
        prefix_len=delta.prefix_len,
        prompt_ids=delta.prompt_ids,  # a copy, not a view of the draft; apply re-points it
        completion_ids=np.asarray(draft.completion_ids, dtype=np.int32),
        logprobs=np.asarray(draft.logprobs, dtype=np.float32),
        message_prefix_len=delta.message_prefix_len,
        new_messages=delta.new_messages,
        # None: the same tools as the parent turn; []: none.
        tools=(draft.tools or []) if node is None or draft.tools != node.tools else None,
        sampling=draft.sampling,
        finish_reason=draft.finish_reason,
        text=draft.text,
        tool_calls=draft.tool_calls,
        weight_version=draft.weight_version,
        version_spans=draft.version_spans,
        template_hash=draft.template_hash,
        backend=draft.backend,
        timings=draft.timings,
        request=draft.request,
        logprobs_kind=draft.logprobs_kind,
        usage={
            "prompt_tokens": len(draft.prompt_ids),
            "completion_tokens": len(draft.completion_ids),
        },
        reply_id=draft.reply_id,
        agent=draft.agent,
        client_gone=draft.client_gone,
        images=own,
    )


def _with_images(
    delta: PromptDelta, draft: TurnDraft, parent: Sequence[ImageRef]
) -> tuple[PromptDelta, list[ImageRef]]:
    """The delta and the turn's own images (those after its prefix), the prefix cut before the
    first image it does not share with the parent: two images of one size are the same
    placeholder tokens, so a prefix shared by tokens alone may hold another image than the
    parent's (or end inside one)."""
    cut = delta.prefix_len
    inherited = {(r.offset, r.sha256, r.length) for r in parent if r.end <= cut}
    for ref in draft.images:
        if ref.offset >= cut:
            break
        if ref.end > cut or (ref.offset, ref.sha256, ref.length) not in inherited:
            cut = ref.offset
            break
    if cut < delta.prefix_len:
        ids = np.asarray(draft.prompt_ids, dtype=np.int32)
        delta = delta._replace(prefix_len=cut, prompt_ids=ids[cut:].copy())
    return delta, [ref for ref in draft.images if ref.offset >= cut]


def apply(
    state: SessionState | None,
    event: SessionEvent,
    *,
    kept: Kept | None = None,
    keys: Sequence[MessageKey] | None = None,
) -> SessionState | None:
    """The session after ``event``; ``None`` stands for a session with no events yet (then
    ``kept`` bounds the new state: default ``Kept()``). ``keys``: the ``message_key`` of each
    message of a turn's conversation (``TurnDraft.keys``), where the live path has them from the
    request; recovery computes them from the event: the same keys either way."""
    if state is None:
        state = SessionState(
            run=event.run, id=event.session, created_at=event.created_at, kept=kept or Kept()
        )
    elif (event.run, event.session) != (state.run, state.id):
        raise ValueError(
            f"event of session {event.run}/{event.session} applied to {state.run}/{state.id}"
        )
    if isinstance(event, TurnCompleted):
        return _apply_turn(state, event, keys)
    if isinstance(event, SessionOpened):
        return dataclasses.replace(
            state,
            group=event.group,
            metadata=dict(event.metadata),
            created_at=event.created_at,
        )
    if isinstance(event, SessionClosed):
        if state.closed:
            return state
        return dataclasses.replace(state, closed=True, status=event.status)
    return state  # rewards do not change what the next turn extends


def _apply_turn(
    state: SessionState, event: TurnCompleted, keys: Sequence[MessageKey] | None
) -> SessionState:
    if event.turn != state.turns:
        return state
    nodes = dict(state.nodes)
    parent = nodes.pop(event.parent, None)  # re-inserted below: applying a turn touches it
    node, parent = _node(event, parent, nodes, keys)
    if parent is not None:
        nodes[parent.turn] = parent
    if node is not None:
        nodes[node.turn] = node
    kept = state.kept
    while len(nodes) > kept.turns or (len(nodes) > 1 and _held_tokens(nodes) > kept.tokens):
        del nodes[next(iter(nodes))]  # the least recently touched
    # Built directly, not with dataclasses.replace: this runs once per turn on the hot path.
    return SessionState(
        state.run,
        state.id,
        state.group,
        state.metadata,
        state.created_at,
        state.turns + 1,
        state.closed,
        state.status,
        event,
        kept,
        nodes,
    )


def _held_tokens(nodes: Mapping[int, TurnNode]) -> int:
    """Tokens in the arrays the nodes hold: a chain's nodes view one array, counted once."""
    owners: dict[int, int] = {}
    for node in nodes.values():
        ids = node.context_ids
        owner = ids if ids.base is None else ids.base
        owners[id(owner)] = len(owner)
    return sum(owners.values())


def _node(
    event: TurnCompleted,
    parent: TurnNode | None,
    nodes: dict[int, TurnNode],
    asked: Sequence[MessageKey] | None,
) -> tuple[TurnNode | None, TurnNode | None]:
    """The node of ``event`` built on its ``parent``'s (None where the parent is no longer kept:
    the turn is counted but cannot be continued), and the parent as it is after it."""
    context = _NO_IDS if parent is None else parent.context_ids
    conversation = () if parent is None else parent.conversation
    if (parent is None and event.parent >= 0) or not delta_fits(
        event, len(context), len(conversation)
    ):
        return None, parent
    ids = context_ids(context, event)
    kept_messages = event.message_prefix_len
    # The parent's keys for the messages it holds (a chain of nodes shares them), the request's
    # for the new ones where the live path carried them.
    keys = () if parent is None else parent.keys[:kept_messages]
    if asked is not None and len(asked) == kept_messages + len(event.new_messages):
        new_keys = tuple(asked[kept_messages:])
    else:
        new_keys = message_keys(event.new_messages)
    inherited = None if parent is None else parent.tools
    _view_prompt(event, ids)
    node = TurnNode(
        event,
        ids,
        conversation_items(conversation, event),
        (*keys, *new_keys, message_key(event.assistant_message)),
        inherited if event.tools is None else (event.tools or None),
        images=_turn_images(parent, event),
    )
    if parent is not None and event.prefix_len == len(context):
        shared = context
        if context.base is None:  # the parent's array is its own: it and its viewers view ids
            shared = ids[: len(context)]
            for turn, other in nodes.items():
                if other.context_ids.base is context:
                    nodes[turn] = _viewing(other, ids)
            _view_prompt(parent.event, shared)
        # A side request (compaction, an auxiliary call) leaves its parent the tip of its
        # conversation: the agent's next own turn continues it, a resend still finds it.
        side = event.agent.get("request_class") in SIDE_CLASSES
        parent = evolved(parent, context_ids=shared, continued=parent.continued or not side)
    return node, parent


def _view_prompt(event: TurnCompleted, ids: np.ndarray) -> None:
    """Points ``event.prompt_ids`` at their place in ``ids``, the turn's whole context or a
    longer one that begins with it: a kept turn holds its prompt once, in its chain's array, not
    again as the event's own copy (400 KB for a 100k-token first turn; issue 40).

    The one impure step of ``apply``, on purpose: the event object is changed, not copied, so
    that the kept node's event stays the very event the state's ``last_turn``, a resent
    request's answer and the caller hold. Its values do not change; only where they live."""
    start = event.prefix_len
    event.prompt_ids = ids[start : start + len(event.prompt_ids)]


def _viewing(node: TurnNode, ids: np.ndarray) -> TurnNode:
    """``node`` with its context, and its event's prompt, views into ``ids``, a longer context
    that begins with its own: the array it viewed is no longer held through it."""
    own = ids[: len(node.context_ids)]
    _view_prompt(node.event, own)
    return evolved(node, context_ids=own)


def _turn_images(parent: TurnNode | None, event: TurnCompleted) -> tuple[ImageRef, ...]:
    """A turn's whole prompt's images: its parent's inside its prefix, then its own."""
    if not event.images and (parent is None or not parent.images):
        return ()
    return tuple(
        prompt_images(() if parent is None else parent.images, event.prefix_len, event.images)
    )


def fold(events: Iterable[SessionEvent], *, kept: Kept | None = None) -> SessionState | None:
    """The state after ``events`` (one session's, in stream order); None if there are none."""
    state: SessionState | None = None
    for event in events:
        state = apply(state, event, kept=kept)
    return state
