"""The session aggregate (gateway.core.aggregate): the live path and recovery agree by
construction."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.core.aggregate import SessionState, TurnDraft, apply, fold, turn_event
from schemas.codec import Codec
from schemas.events import RewardAssigned, SessionClosed, SessionOpened

USER = {"role": "user", "content": "hi"}


def draft(prompt: list[int], messages: list[dict[str, object]], out: list[int]) -> TurnDraft:
    return TurnDraft(
        prompt_ids=prompt,
        messages=messages,
        tools=None,
        completion_ids=out,
        logprobs=[-0.5] * len(out),
        text="x" * len(out),
    )


def live_session(turns: int) -> tuple[SessionState, list[object]]:
    """A session built the way the gateway builds it: event, publish, apply."""
    opened = SessionOpened(run="r", session="s", group="g", metadata={"task": 1})
    state = apply(None, opened)
    assert state is not None
    events: list[object] = [opened]
    for t in range(turns):
        prompt = [*state.context_ids.tolist(), 100 + t]
        messages = [*state.conversation, {"role": "user", "content": f"turn {t}"}]
        event = turn_event(state, draft(prompt, messages, [200 + t, 201 + t]))
        # what the log holds is what the codec gives back
        stored = Codec().decode(Codec().encode(event))
        events.append(stored)
        state = apply(state, event)  # type: ignore[assignment]
    return state, events


def test_recovery_from_the_log_is_the_live_state() -> None:
    live, events = live_session(4)
    recovered = fold(events)  # type: ignore[arg-type]
    assert recovered is not None
    assert recovered.turns == live.turns == 4
    assert recovered.context_ids.tolist() == live.context_ids.tolist()
    assert recovered.conversation == live.conversation
    assert recovered.last_completion_ids == [203, 204]
    assert (recovered.group, recovered.metadata) == ("g", {"task": 1})


def test_each_turn_stores_only_what_is_new() -> None:
    _, events = live_session(3)
    turns = events[1:]
    assert [t.prefix_len for t in turns] == [0, 3, 6]  # type: ignore[attr-defined]
    assert [len(t.new_messages) for t in turns] == [1, 1, 1]  # type: ignore[attr-defined]


@given(st.permutations(range(1, 5)), st.integers(0, 4))
def test_duplicates_and_out_of_order_turns_never_change_the_state(
    order: list[int], repeat: int
) -> None:
    live, events = live_session(4)
    # a turn redelivered, or one whose index is not next, is a no-op
    state = fold([events[0], *events[1:], *(events[i] for i in order)])  # type: ignore[list-item]
    assert state is not None and state.turns == 4
    assert state.context_ids.tolist() == live.context_ids.tolist()
    skipped = fold([events[0], events[1], events[3]])  # type: ignore[list-item]
    assert skipped is not None and skipped.turns == 1


def test_close_and_rewards() -> None:
    live, events = live_session(1)
    closed = fold(
        [
            *events,  # type: ignore[list-item]
            RewardAssigned(run="r", session="s", value=1.0),
            SessionClosed(run="r", session="s", status="aborted", num_turns=1),
        ]
    )
    assert closed is not None and closed.closed and closed.status == "aborted"
    assert closed.turns == live.turns


def test_events_of_another_session_are_refused() -> None:
    state = apply(None, SessionOpened(run="r", session="s"))
    with pytest.raises(ValueError, match="r/other"):
        apply(state, SessionOpened(run="r", session="other"))


def test_tools_are_recorded_only_when_they_change() -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    state = apply(None, SessionOpened(run="r", session="s"))
    assert state is not None
    first = turn_event(state, TurnDraft([1], [USER], tools, [2], [-0.1]))
    state = apply(state, first)  # type: ignore[assignment]
    same = turn_event(state, TurnDraft([1, 2, 3], [*state.conversation, USER], tools, [4], [0.0]))
    removed = turn_event(state, TurnDraft([1, 2, 3], [USER], None, [4], [0.0]))
    assert first.tools == tools and same.tools is None and removed.tools == []
    assert np.array_equal(apply(state, removed).context_ids, [1, 2, 3, 4])  # type: ignore[union-attr]
