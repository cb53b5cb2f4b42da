"""An ATIF document as a session's events (PURE): ``turnstream import-atif``.

The reverse of ``consumers.atif``: a document whose agent steps carry their token ids becomes
the events the gateway would have published for it — ``SessionOpened``, one ``TurnCompleted``
per agent step, ``RewardAssigned`` for the rewards it names, ``SessionClosed`` — so a fold
(a fold worker, ``turnstream refold``) makes trajectories of it and the trainer sink and
``turnstream export`` read them like any other: SFT or off-policy data from an eval harness's
runs.

- Each agent step (one LLM call: ``llm_call_count`` 1 or unsaid) must carry
  ``metrics.prompt_token_ids`` (the call's whole prompt), ``completion_token_ids`` and one
  ``logprobs`` entry per completion token. A document lacking them is refused whole, naming the
  file, the trajectory and the step: re-tokenizing text would not give the tokens the model saw
  (the drift ATIF's token ids exist to avoid). Steps marked ``is_copied_context``, and agent
  steps with ``llm_call_count`` 0 (no LLM call), are conversation, not turns.
- A step continues the previous agent step of its trajectory: its prompt is delta-encoded
  against that step's prompt + completion (the longest shared prefix), so the fold appends it
  when the prompt extends that context and forks where it does not, as it does for served
  sessions. Embedded ``subagent_trajectories`` (nested ones too) are turns of the same session
  that start their own chains, their agent named by their ``trajectory_id``.
- The conversation (``new_messages``) is rebuilt in the OpenAI chat shape: system and user
  steps, each agent step's reply with its tool calls, and its observation's results as ``tool``
  messages.
- **Not on-policy samples.** An imported turn's tokens were sampled by some policy at some
  time, not by this run's at a version it published: every completion token records an unknown
  policy version (``version_spans`` ``[[null, n]]``, which the sink's staleness bound never
  takes as fresh), and its log-probs ``logprobs_kind: "imported"`` (whose distribution they are
  is unknown; the fold carries the kind into the sample's metadata and the sink flags the
  sample ``raw_logprobs``, so no importance ratio is taken against them by mistake).
- Rewards: the document's ``extra.reward`` (what ``turnstream export --kind atif`` writes) as
  the episode reward, each step's ``extra.reward`` as its turn's. The session's metadata is the
  document's ``extra.metadata`` less what a fold derives, plus ``atif``: where it came from.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeGuard, get_args

import numpy as np

from consumers.errors import AtifRefused
from schemas.events import (
    RewardAssigned,
    SessionClosed,
    SessionOpened,
    SessionStatus,
    TurnCompleted,
)

__all__ = ["IMPORTED_LOGPROBS", "ImportedSession", "session_events"]

JSON = dict[str, Any]
Event = SessionOpened | TurnCompleted | RewardAssigned | SessionClosed

IMPORTED_LOGPROBS = "imported"
"""``TurnCompleted.logprobs_kind`` of an imported turn: log-probs of an unknown distribution."""

# Metadata keys the fold derives for each sample: a new fold says them again, where they apply.
_FOLD_KEYS = frozenset(
    {
        *("model", "forks", "segments", "side_calls", "side", "client_gone", "branch_of"),
        *("turns", "temperatures", "sampling", "logprobs_kind", "agent_id", "parent_agent"),
        *("agent_kind", "agent_type", "request_class", "agent_source", "agent_mismatch"),
    }
)
_STATUSES: dict[object, SessionStatus] = {status: status for status in get_args(SessionStatus)}
_TICK = 1e-3  # seconds between the events of a session: their order, not a measured time


@dataclass
class ImportedSession:
    """The events of one document, and what they hold."""

    run: str
    session: str
    events: list[Event] = field(default_factory=list)
    turns: int = 0
    trajectories: int = 0  # the root and its embedded sub-agents


@dataclass
class _Chain:
    """The previous agent step of one trajectory: what the next one is delta-encoded against."""

    turn: int = -1
    context: np.ndarray = field(default_factory=lambda: np.empty(0, np.int32))
    messages: int = 0  # its conversation + its reply


def session_events(
    document: object,
    *,
    run: str,
    session: str,
    source: str,
    now: float,
    attached: Sequence[tuple[str, object]] = (),
    reward: float | None = None,
) -> ImportedSession:
    """The events of ``document`` (parsed JSON) as session ``session`` of ``run``.

    ``source`` names the document in errors and metadata (its path); ``now`` is the time given
    to the events when the document's steps have no timestamps. ``attached``: ``(source,
    document)`` of the files it refers to (its continuation, sub-agents stored as files), their
    trajectories chains of the same session. ``reward``: the episode's, where the document says
    none (Harbor keeps it in the trial's result.json). Raises AtifRefused."""
    root = _object(document, f"{source}: an ATIF trajectory is a JSON object")
    imported = ImportedSession(run, session)
    start = _first_time(root) or now
    turns: list[TurnCompleted] = []
    rewards: list[tuple[int, float]] = []
    files = [(source, root), *((s, _object(d, f"{s}: not a JSON object")) for s, d in attached)]
    for file_source, file_root in files:
        for nested, trajectory in enumerate(_trajectories(file_root, file_source)):
            number = imported.trajectories
            imported.trajectories += 1
            where = file_source if not nested else None
            _turns(trajectory, number, where or file_source, run, session, turns, rewards,
                   nested=bool(nested))  # fmt: skip
    if not turns:
        raise AtifRefused(
            f"{source}: no agent step with token ids (an ATIF trajectory of LLM calls is what "
            f"import-atif takes); nothing was imported"
        )
    extra = _dict(root.get("extra"))
    agent = _dict(root.get("agent"))
    metadata = (
        {k: v for k, v in (extra.get("metadata") or {}).items() if k not in _FOLD_KEYS}
        if isinstance(extra.get("metadata"), dict)
        else {}
    )
    metadata["atif"] = {
        "source": source,
        "session_id": root.get("session_id"),
        "trajectory_id": root.get("trajectory_id"),
        "agent": agent.get("name"),
        "schema_version": root.get("schema_version"),
    }
    group = extra.get("group")
    if not isinstance(group, str) or group == root.get("session_id"):
        group = None  # the session's own id: the new session's, by default
    model = agent.get("model_name")
    events: list[Event] = [
        SessionOpened(
            run=run,
            session=session,
            created_at=start,
            group=group,
            metadata=metadata,
            model=model if isinstance(model, str) else "",
        )
    ]
    for turn in turns:
        turn.created_at = start + (turn.turn + 1) * _TICK
        events.append(turn)
    at = start + (len(turns) + 1) * _TICK
    for turn_index, value in rewards:
        events.append(
            RewardAssigned(run=run, session=session, created_at=at, value=value, turn=turn_index,
                           source="atif")
        )  # fmt: skip
    reward = extra.get("reward") if _number(extra.get("reward")) else reward
    if _number(reward):
        events.append(
            RewardAssigned(run=run, session=session, created_at=at, value=float(reward),
                           source="atif")
        )  # fmt: skip
    status = extra.get("status")
    events.append(
        SessionClosed(
            run=run,
            session=session,
            created_at=at + _TICK,
            status=_STATUSES.get(status, "completed"),
            num_turns=len(turns),
        )
    )
    imported.events, imported.turns = events, len(turns)
    return imported


def _object(value: object, why: str) -> JSON:
    if not isinstance(value, dict):
        raise AtifRefused(why)
    return value


def _number(value: object) -> TypeGuard[float]:
    return isinstance(value, int | float) and not isinstance(value, bool) and np.isfinite(value)


def _trajectories(root: JSON, source: str) -> Iterator[JSON]:
    """The root, then its embedded sub-agent trajectories, depth first."""
    yield root
    for i, sub in enumerate(root.get("subagent_trajectories") or ()):
        yield from _trajectories(
            _object(sub, f"{source}: subagent_trajectories[{i}] is not an object"), source
        )


def _first_time(root: JSON) -> float | None:
    for step in root.get("steps") or ():
        stamp = step.get("timestamp") if isinstance(step, dict) else None
        if isinstance(stamp, str):
            try:
                when = dt.datetime.fromisoformat(stamp.replace("Z", "+00:00"))
            except ValueError:
                continue
            return (when if when.tzinfo else when.replace(tzinfo=dt.UTC)).timestamp()
    return None


def _turns(
    trajectory: JSON,
    number: int,
    source: str,
    run: str,
    session: str,
    turns: list[TurnCompleted],
    rewards: list[tuple[int, float]],
    *,
    nested: bool,
) -> None:
    """Append ``trajectory``'s agent steps as turns (one chain) and their rewards; ``number``
    counts the session's trajectories (0: the root), ``nested``: embedded in its file."""
    name = trajectory.get("trajectory_id") or trajectory.get("session_id") or f"#{number}"
    where = f"{source}: trajectory {name}" if nested else source
    steps = trajectory.get("steps")
    if not isinstance(steps, list) or not steps:
        raise AtifRefused(f"{where}: no steps (ATIF's `steps` is a non-empty list)")
    agent = _dict(trajectory.get("agent"))
    tools = agent.get("tool_definitions")
    identity = {"id": str(name), "source": "atif"} if number else {}
    conversation: list[JSON] = []
    chain = _Chain()
    for i, raw in enumerate(steps):
        step = _object(raw, f"{where}: steps[{i}] is not an object")
        step_id = step.get("step_id", i + 1)
        source_kind = step.get("source")
        text = _text(step.get("message"))
        if source_kind != "agent":
            conversation.append({"role": "system" if source_kind == "system" else "user",
                                 "content": text})  # fmt: skip
            conversation += _tool_messages(step)
            continue
        reply: JSON = {"role": "assistant", "content": text or None}
        if calls := _tool_calls(step.get("tool_calls")):
            reply["tool_calls"] = calls
        if step.get("is_copied_context") or step.get("llm_call_count") == 0:
            conversation.append(reply)  # context, not a call sampled here
            conversation += _tool_messages(step)
            continue
        prompt, completion, logprobs = _tokens(step, f"{where}: step {step_id}")
        shared = _shared_prefix(prompt, chain.context)
        index = len(turns)
        metrics = step["metrics"]
        usage = {
            key: metrics[key]
            for key in ("prompt_tokens", "completion_tokens", "cached_tokens")
            if isinstance(metrics.get(key), int) and not isinstance(metrics.get(key), bool)
        }
        turns.append(
            TurnCompleted(
                run=run,
                session=session,
                turn=index,
                parent_turn=chain.turn,
                prefix_len=shared,
                prompt_ids=prompt[shared:],
                completion_ids=completion,
                logprobs=logprobs,
                message_prefix_len=chain.messages if chain.turn >= 0 else 0,
                new_messages=conversation[chain.messages if chain.turn >= 0 else 0 :],
                tools=(tools if isinstance(tools, list) else []) if chain.turn < 0 else None,
                finish_reason=str((metrics.get("extra") or {}).get("finish_reason") or "stop"),
                text=text,
                tool_calls=calls,
                weight_version=0,
                version_spans=[(None, len(completion))] if len(completion) else None,
                backend="atif",
                usage=usage,
                request={"api": "atif", "source": source, "step_id": step_id},
                logprobs_kind=IMPORTED_LOGPROBS,
                agent=identity,
            )
        )
        conversation.append(reply)
        chain = _Chain(index, np.concatenate([prompt, completion]), len(conversation))
        conversation += _tool_messages(step)
        step_extra = step.get("extra")
        if isinstance(step_extra, dict) and _number(step_extra.get("reward")):
            rewards.append((index, float(step_extra["reward"])))


def _tokens(step: JSON, where: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    metrics = step.get("metrics")
    if not isinstance(metrics, dict):
        metrics = {}
    missing = [
        key
        for key in ("prompt_token_ids", "completion_token_ids", "logprobs")
        if not isinstance(metrics.get(key), list)
    ]
    if missing:
        raise AtifRefused(
            f"{where} has no metrics.{', metrics.'.join(missing)}: import-atif takes "
            f"trajectories whose agent steps carry the token ids the model saw and sampled and "
            f"their log-probs (Harbor records them when its agent collects rollout details), "
            f"and never re-tokenizes text; nothing was imported"
        )
    count = step.get("llm_call_count")
    if isinstance(count, int) and count > 1:
        raise AtifRefused(
            f"{where} aggregates {count} LLM calls (llm_call_count): its token ids are not one "
            f"call's prompt and completion; nothing was imported"
        )
    try:
        prompt = np.asarray(metrics["prompt_token_ids"], dtype=np.int64)
        completion = np.asarray(metrics["completion_token_ids"], dtype=np.int64)
        logprobs = np.asarray(metrics["logprobs"], dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise AtifRefused(f"{where}: token ids and log-probs must be numbers ({exc})") from exc
    if prompt.ndim != 1 or completion.ndim != 1 or logprobs.ndim != 1:
        raise AtifRefused(f"{where}: token ids and log-probs must be flat lists of numbers")
    if len(logprobs) != len(completion):
        raise AtifRefused(
            f"{where}: {len(logprobs)} logprobs for {len(completion)} completion_token_ids; "
            f"ATIF gives one per generated token; nothing was imported"
        )
    ids = np.concatenate([prompt, completion])
    if len(ids) and (ids.min() < 0 or ids.max() >= 2**31):
        raise AtifRefused(f"{where}: a token id is not an int32 >= 0")
    return prompt.astype(np.int32), completion.astype(np.int32), logprobs.astype(np.float32)


def _shared_prefix(prompt: np.ndarray, context: np.ndarray) -> int:
    n = min(len(prompt), len(context))
    unequal = np.flatnonzero(prompt[:n] != context[:n])
    return int(unequal[0]) if len(unequal) else n


def _tool_calls(calls: object) -> list[JSON]:
    out = []
    for call in calls if isinstance(calls, list) else ():
        if not isinstance(call, dict):
            continue
        extra = _dict(call.get("extra"))
        arguments = extra.get("arguments")  # text that was no JSON object (consumers.atif)
        if not isinstance(arguments, str):
            arguments = json.dumps(call.get("arguments") or {}, ensure_ascii=False)
        out.append(
            {
                "id": str(call.get("tool_call_id") or ""),
                "type": "function",
                "function": {"name": str(call.get("function_name") or ""), "arguments": arguments},
            }
        )
    return out


def _tool_messages(step: JSON) -> list[JSON]:
    observation = step.get("observation")
    results = observation.get("results") if isinstance(observation, dict) else None
    messages = []
    for result in results if isinstance(results, list) else ():
        if not isinstance(result, dict) or (
            result.get("content") is None and result.get("subagent_trajectory_ref")
        ):
            continue  # a reference to a sub-agent: its turns are its own trajectory's
        extra = _dict(result.get("extra"))
        call_id = result.get("source_call_id") or extra.get("tool_call_id")
        message: JSON = {"role": "tool", "content": _text(result.get("content"))}
        if isinstance(call_id, str):
            message["tool_call_id"] = call_id
        messages.append(message)
    return messages


def _text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # ATIF content parts: the text ones
        return "".join(
            part["text"]
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""


def _dict(value: object) -> JSON:
    """``value`` when it is a JSON object, else an empty one (absent or malformed alike)."""
    return value if isinstance(value, dict) else {}
