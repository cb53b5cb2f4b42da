"""Events of test sessions that are trees (issue 18): each turn names its parent.

A test describes a turn by its parent and its *full* prompt and conversation; ``tree_events``
delta-encodes them against the parent's full context and conversation, as the gateway does
once it has chosen the parent (``TurnCompleted.parent_turn``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from schemas.delta import encode_delta
from schemas.events import JSON, SessionEvent, TurnCompleted
from tests.helpers.sessions import RUN, SESSION, closed, opened


@dataclass(frozen=True)
class TreeTurn:
    """One turn as the model lived it, under ``parent`` (-1: none)."""

    parent: int
    prompt: Sequence[int]
    completion: Sequence[int]
    messages: Sequence[JSON] = ()
    text: str = ""
    weight_version: int = 0
    finish_reason: str = "stop"
    extra: JSON = field(default_factory=dict)  # any other TurnCompleted field

    @property
    def context(self) -> list[int]:
        return [*self.prompt, *self.completion]

    @property
    def assistant_message(self) -> JSON:
        return {"role": "assistant", "content": self.text or None}


def tree_events(
    turns: Sequence[TreeTurn], *, run: str = RUN, session: str = SESSION
) -> list[TurnCompleted]:
    """Each turn delta-encoded against its parent's full context (the longest common prefix)."""
    events: list[TurnCompleted] = []
    for index, spec in enumerate(turns):
        parent = turns[spec.parent] if spec.parent >= 0 else None
        context = parent.context if parent is not None else []
        history = [*parent.messages, parent.assistant_message] if parent is not None else []
        delta = encode_delta(context, history, spec.prompt, spec.messages)
        events.append(
            TurnCompleted(
                run=run,
                session=session,
                turn=index,
                parent_turn=spec.parent,
                prefix_len=delta.prefix_len,
                prompt_ids=delta.prompt_ids,
                completion_ids=np.array(spec.completion, dtype=np.int32),
                logprobs=np.full(len(spec.completion), -0.5, dtype=np.float32),
                message_prefix_len=delta.message_prefix_len,
                new_messages=delta.new_messages,
                text=spec.text,
                weight_version=spec.weight_version,
                finish_reason=spec.finish_reason,
                **spec.extra,
            )
        )
    return events


def tree_session(
    turns: Sequence[TreeTurn],
    *,
    run: str = RUN,
    session: str = SESSION,
    extra: Sequence[SessionEvent] = (),
    final_reward: float | None = None,
) -> list[SessionEvent]:
    """A whole tree session in publication order: open, turns, ``extra`` (rewards), close."""
    return [
        opened(run=run, session=session),
        *tree_events(turns, run=run, session=session),
        *extra,
        closed(run=run, session=session, reward=final_reward, num_turns=len(turns)),
    ]
