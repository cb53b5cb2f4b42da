"""A session as an aggregate: its state changes only by applying its own events (PURE).

The live path builds a ``TurnCompleted`` with ``turn_event``, publishes it and applies it;
recovering a session from the log is the same ``apply`` folded over its stored events, so both
paths agree by construction::

    state = fold(events)                    # recovery: reduce(apply, events)
    event = turn_event(state, prompt, ...)  # the next turn, delta-encoded against ``state``
    state = apply(state, event)             # after JetStream acknowledged ``event``

A worked example (token ids only; one message per turn):

>>> opened = SessionOpened(run="r", session="s", group="g")
>>> state = apply(None, opened)
>>> first = turn_event(state, TurnDraft(prompt_ids=[1, 2], messages=[{"role": "user",
...     "content": "hi"}], tools=None, completion_ids=[3], logprobs=[-0.5], text="yo"))
>>> state = apply(state, first)
>>> state.turns, state.context_ids.tolist()
(1, [1, 2, 3])
>>> second = turn_event(state, TurnDraft(prompt_ids=[1, 2, 3, 4], messages=[*state.conversation,
...     {"role": "user", "content": "again"}], tools=None, completion_ids=[5], logprobs=[-0.1]))
>>> second.prefix_len, second.prompt_ids.tolist(), len(second.new_messages)
(3, [4], 1)
>>> apply(apply(state, second), first).turns  # a redelivered turn is a no-op
2

Turns apply in index order: a turn whose index is not the session's next one (a duplicate, or
one past a gap) changes nothing. Events of another session are a programming error.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gateway.conversation import message_key, same_messages
from schemas.delta import encode_delta
from schemas.events import SessionClosed, SessionEvent, SessionOpened, TurnCompleted

__all__ = ["SessionState", "TurnDraft", "apply", "fold", "resent_turn", "turn_event"]

JSON = dict[str, Any]
_NO_IDS = np.empty(0, dtype=np.int32)


@dataclass(frozen=True)
class SessionState:
    """What the log says about one session: enough to continue it token for token."""

    run: str
    id: str
    group: str | None = None
    metadata: JSON = field(default_factory=dict)
    created_at: float = 0.0
    turns: int = 0  # turns applied so far: the next turn's index
    context_ids: np.ndarray = field(default_factory=lambda: _NO_IDS)  # last prompt + completion
    completion_len: int = 0  # the last turn's sampled tokens are context_ids[-completion_len:]
    conversation: tuple[JSON, ...] = ()  # last turn's messages + the reply the client received
    tools: list[JSON] | None = None
    closed: bool = False
    status: str = "open"
    last_turn: TurnCompleted | None = None  # the event of the turn applied last

    @property
    def last_completion_ids(self) -> list[int]:
        if not self.completion_len:
            return []
        return self.context_ids[-self.completion_len :].tolist()  # type: ignore[no-any-return]

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

    prompt_ids: Sequence[int]
    messages: Sequence[JSON]  # the turn's whole conversation (chat); () for text completions
    tools: list[JSON] | None
    completion_ids: Sequence[int]
    logprobs: Sequence[float]
    text: str = ""
    tool_calls: list[JSON] = field(default_factory=list)
    finish_reason: str = "stop"
    sampling: JSON = field(default_factory=dict)
    weight_version: int = 0
    template_hash: str = ""
    backend: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    created_at: float = 0.0
    request: JSON = field(default_factory=dict)  # TurnRequest.record


def turn_event(state: SessionState, draft: TurnDraft) -> TurnCompleted:
    """``draft`` as the session's next turn, delta-encoded against ``state``."""
    delta = encode_delta(
        state.context_ids, state.conversation, draft.prompt_ids, draft.messages, message_key
    )
    first = state.turns == 0
    return TurnCompleted(
        run=state.run,
        session=state.id,
        turn=state.turns,
        created_at=draft.created_at,
        prefix_len=delta.prefix_len,
        prompt_ids=delta.prompt_ids,
        completion_ids=np.asarray(draft.completion_ids, dtype=np.int32),
        logprobs=np.asarray(draft.logprobs, dtype=np.float32),
        message_prefix_len=delta.message_prefix_len,
        new_messages=delta.new_messages,
        # None: the same tools as the previous turn; []: tools removed.
        tools=(draft.tools or []) if first or draft.tools != state.tools else None,
        sampling=draft.sampling,
        finish_reason=draft.finish_reason,
        text=draft.text,
        tool_calls=draft.tool_calls,
        weight_version=draft.weight_version,
        template_hash=draft.template_hash,
        backend=draft.backend,
        timings=draft.timings,
        request=draft.request,
        usage={
            "prompt_tokens": len(draft.prompt_ids),
            "completion_tokens": len(draft.completion_ids),
        },
    )


def apply(state: SessionState | None, event: SessionEvent) -> SessionState | None:
    """The session after ``event``; ``None`` stands for a session with no events yet."""
    if state is None:
        state = SessionState(run=event.run, id=event.session, created_at=event.created_at)
    elif (event.run, event.session) != (state.run, state.id):
        raise ValueError(
            f"event of session {event.run}/{event.session} applied to {state.run}/{state.id}"
        )
    if isinstance(event, TurnCompleted):
        return _apply_turn(state, event)
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


def _apply_turn(state: SessionState, event: TurnCompleted) -> SessionState:
    if event.turn != state.turns:
        return state
    conversation = (
        *state.conversation[: event.message_prefix_len],
        *event.new_messages,
        event.assistant_message,
    )
    tools = state.tools if event.tools is None else (event.tools or None)
    # Built directly, not with dataclasses.replace: this runs once per turn on the hot path.
    return SessionState(
        state.run,
        state.id,
        state.group,
        state.metadata,
        state.created_at,
        state.turns + 1,
        np.concatenate(
            [state.context_ids[: event.prefix_len], event.prompt_ids, event.completion_ids]
        ).astype(np.int32, copy=False),
        len(event.completion_ids),
        conversation,
        tools,
        state.closed,
        state.status,
        event,
    )


def resent_turn(
    state: SessionState, messages: Sequence[JSON], tools: list[JSON] | None, record: JSON
) -> TurnCompleted | None:
    """The session's last turn if a request for ``messages``/``tools``/``record`` is that turn's
    request again (a client's retry: after a 5xx, a cut stream, a lost reply), else None.

    Clients resend the same request when they did not get (all of) the answer; answering it
    with the recorded turn keeps one model call one turn. Only the last turn qualifies: a
    request equal to an earlier one is a new turn that forks the conversation."""
    last = state.last_turn
    if last is None or not last.request or last.request != record:
        return None
    if (tools or None) != state.tools:
        return None
    if not same_messages(messages, state.conversation[:-1]):
        return None
    return last


def fold(events: Iterable[SessionEvent]) -> SessionState | None:
    """The state after ``events`` (one session's, in stream order); None if there are none."""
    state: SessionState | None = None
    for event in events:
        state = apply(state, event)
    return state
