"""Events of test sessions, built from what each turn's model saw and produced.

A test describes a turn by its *full* prompt and conversation; ``turn_events`` delta-encodes them
the way the gateway does (the longest common prefix with the previous turn's full context), so
tests state intent ("turn 3 rewrites the history") and the encoding follows. ``turn_specs`` is
the hypothesis strategy for random multi-turn sessions, some turns extending the previous
context and some rewriting it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from hypothesis import strategies as st

from schemas.delta import encode_delta
from schemas.events import (
    JSON,
    RewardAssigned,
    SessionClosed,
    SessionEvent,
    SessionOpened,
    SessionStatus,
    TurnCompleted,
)

RUN = "run-1"
SESSION = "sess-1"


@dataclass(frozen=True)
class TurnSpec:
    """One turn as the model lived it: the full prompt, not its delta."""

    prompt: Sequence[int]
    completion: Sequence[int]
    logprobs: Sequence[float] | None = None  # None: -(i + 1) / 8 for the i-th completion token
    messages: Sequence[JSON] = ()  # the full conversation the model answered
    text: str = ""
    weight_version: int = 0
    finish_reason: str = "stop"
    created_at: float = 0.0
    prefix_len: int | None = None  # None: the longest possible, as the gateway encodes
    extra: JSON = field(default_factory=dict)  # any other TurnCompleted field

    @property
    def context(self) -> list[int]:
        """This turn's full context: its full prompt and its completion."""
        return [*self.prompt, *self.completion]

    @property
    def completion_logprobs(self) -> list[float]:
        if self.logprobs is not None:
            return list(self.logprobs)
        return [-(i + 1) / 8 for i in range(len(self.completion))]

    @property
    def assistant_message(self) -> JSON:
        """The reply as TurnCompleted.assistant_message renders it (no tool calls here)."""
        return {"role": "assistant", "content": self.text or None}


def turn_events(
    specs: Sequence[TurnSpec], *, run: str = RUN, session: str = SESSION
) -> list[TurnCompleted]:
    """Delta-encode the turns: prefix into the previous full context, then the new tokens."""
    events: list[TurnCompleted] = []
    context: list[int] = []
    history: list[JSON] = []
    for index, spec in enumerate(specs):
        delta = encode_delta(context, history, spec.prompt, spec.messages)
        if spec.prefix_len is not None:
            assert spec.prefix_len <= delta.prefix_len, "a forced prefix_len must share tokens"
            forced = np.asarray(spec.prompt, dtype=np.int32)[spec.prefix_len :]
            delta = delta._replace(prefix_len=spec.prefix_len, prompt_ids=forced)
        events.append(
            TurnCompleted(
                run=run,
                session=session,
                turn=index,
                created_at=spec.created_at,
                prefix_len=delta.prefix_len,
                prompt_ids=delta.prompt_ids,
                completion_ids=np.array(spec.completion, dtype=np.int32),
                logprobs=np.array(spec.completion_logprobs, dtype=np.float32),
                message_prefix_len=delta.message_prefix_len,
                new_messages=delta.new_messages,
                text=spec.text,
                weight_version=spec.weight_version,
                finish_reason=spec.finish_reason,
                **spec.extra,
            )
        )
        context = spec.context
        history = [*spec.messages, spec.assistant_message]
    return events


def opened(
    *,
    run: str = RUN,
    session: str = SESSION,
    group: str | None = None,
    metadata: JSON | None = None,
    model: str = "tiny",
    created_at: float = 0.0,
) -> SessionOpened:
    return SessionOpened(
        run=run,
        session=session,
        group=group,
        metadata=dict(metadata or {}),
        model=model,
        created_at=created_at,
    )


def closed(
    *,
    run: str = RUN,
    session: str = SESSION,
    status: SessionStatus = "completed",
    reward: float | None = None,
    num_turns: int | None = None,
    created_at: float = 0.0,
) -> SessionClosed:
    return SessionClosed(
        run=run,
        session=session,
        status=status,
        reward=reward,
        num_turns=num_turns,
        created_at=created_at,
    )


def reward(
    value: float,
    *,
    turn: int | None = None,
    key: str = "default",
    run: str = RUN,
    session: str = SESSION,
    created_at: float = 0.0,
) -> RewardAssigned:
    return RewardAssigned(
        run=run, session=session, value=value, turn=turn, key=key, created_at=created_at
    )


def session_events(
    specs: Sequence[TurnSpec],
    *,
    run: str = RUN,
    session: str = SESSION,
    group: str | None = None,
    metadata: JSON | None = None,
    rewards: Sequence[RewardAssigned] = (),
    close: bool = True,
    status: SessionStatus = "completed",
    final_reward: float | None = None,
    created_at: float = 0.0,
) -> list[SessionEvent]:
    """A whole session in publication order: open, turns, rewards, close (num_turns = all)."""
    events: list[SessionEvent] = [
        opened(run=run, session=session, group=group, metadata=metadata, created_at=created_at),
        *turn_events(specs, run=run, session=session),
        *rewards,
    ]
    if close:
        events.append(
            closed(
                run=run,
                session=session,
                status=status,
                reward=final_reward,
                num_turns=len(specs),
                created_at=created_at,
            )
        )
    return events


def append_only(num_turns: int, *, prompt0: Sequence[int] = (1, 2, 3)) -> list[TurnSpec]:
    """Turns that each add one observation token and two generated tokens to the context."""
    specs: list[TurnSpec] = []
    context: list[int] = []
    history: list[JSON] = []
    for t in range(num_turns):
        prompt = [*context, *(prompt0 if t == 0 else [100 + t])]
        messages = [*history, {"role": "user" if t == 0 else "tool", "content": f"obs {t}"}]
        spec = TurnSpec(
            prompt=prompt,
            completion=[10 * t + 1, 10 * t + 2],
            messages=messages,
            text=f"reply {t}",
            weight_version=t,
        )
        specs.append(spec)
        context = spec.context
        history = [*messages, spec.assistant_message]
    return specs


_TOKENS = st.lists(st.integers(0, 5), max_size=4)  # a tiny vocabulary: accidental prefixes happen


@st.composite
def turn_specs(draw: st.DrawFn, *, max_turns: int = 6, rewrites: bool = True) -> list[TurnSpec]:
    """Random sessions: each later turn extends the previous context, or (if ``rewrites``)
    keeps only part of it, which is usually a fork."""
    specs: list[TurnSpec] = []
    context: list[int] = []
    history: list[JSON] = []
    for t in range(draw(st.integers(1, max_turns))):
        if t == 0 or not rewrites or draw(st.booleans()):
            prompt = [*context, *draw(_TOKENS)]
            messages = [*history, {"role": "tool", "content": f"obs {t}"}]
        else:
            prompt = [*context[: draw(st.integers(0, len(context)))], *draw(_TOKENS)]
            kept = history[: draw(st.integers(0, len(history)))]
            messages = [*kept, {"role": "user", "content": f"summary {t}"}]
        completion = draw(_TOKENS)
        logprobs = draw(
            st.lists(
                st.floats(-20.0, 0.0, width=32),
                min_size=len(completion),
                max_size=len(completion),
            )
        )
        spec = TurnSpec(
            prompt=prompt,
            completion=completion,
            logprobs=logprobs,
            messages=messages,
            text=draw(st.sampled_from(["", f"reply {t}"])),
            weight_version=draw(st.integers(0, 3)),
            finish_reason=draw(st.sampled_from(["stop", "tool_calls", "length"])),
            created_at=float(t),
        )
        specs.append(spec)
        context = spec.context
        history = [*messages, spec.assistant_message]
    return specs


@st.composite
def reward_events(draw: st.DrawFn, num_turns: int) -> list[RewardAssigned]:
    """Episode and per-turn rewards under a few keys; some name turns that do not exist."""
    turn = st.none() | st.integers(0, num_turns)
    return draw(
        st.lists(
            st.builds(
                reward,
                st.floats(-4.0, 4.0, width=32),
                turn=turn,
                key=st.sampled_from(["default", "tests", "style"]),
                created_at=st.sampled_from([0.0, 50.0, 200.0]),
            ),
            max_size=5,
            unique_by=lambda r: (r.key, r.turn),
        )
    )
