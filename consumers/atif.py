"""A session's trajectories as one ATIF document (PURE): ``turnstream export --kind atif``.

ATIF, the Agent Trajectory Interchange Format, is what Harbor and other agent tools write and
read (``harbor.models.trajectories``: one ``trajectory.json`` per trial). A document is a list of
steps — ``system`` / ``user`` messages and ``agent`` steps, an agent step being one LLM call with
its message, tool calls, the observations its tools returned, and its ``metrics``: the call's
full prompt ids (``prompt_token_ids``, chat history included), its sampled ids
(``completion_token_ids``) and their ``logprobs``, which is exactly what a turn is here.

One document per session. The session's first sample (its lowest segment: the main agent's
conversation) is the root; every other sample of the session (a sub-agent, a fork, a side call)
is embedded whole in the root's ``subagent_trajectories`` under its own ``trajectory_id`` (ours,
``<run>/<session>/<segment>``), each an ATIF trajectory of its own. Where the fold knows which
turn a sample branched off (metadata ``branch_of``) and that turn is a step of an exported
sample, that step's observation holds a ``subagent_trajectory_ref`` to it.

A sample becomes steps from its conversation (``messages``, OpenAI-shaped) and its tokens. Its
turns are the last ``num_turns`` assistant messages; an assistant message before them was
written by the client, not sampled in this sample (few-shot examples, a fork's rewritten
history), and is an agent step marked ``is_copied_context`` with no metrics, which ATIF says
not to train on. Turn k's completion is the generated run (loss mask 1) that ends at
``turn_ends[k]``; its prompt is every token before it, as the backend was sent it. ``tool``
messages become the observation of the agent step whose calls they answer. Rewards and what the
shape has no field for (weight versions, status, the session's metadata) go under ``extra``.

>>> t = TrajectoryReady(run="r", session="s", trajectory_id="r/s/0", group="g", segment=0,
...     status="completed", input_ids=[1, 2, 3], loss_mask=[0, 1, 1], logprobs=[0, -0.5, -1],
...     versions=[-1, 4, 4], prompt_len=1, turn_ends=[3], turn_rewards=[None], reward=1.0,
...     num_turns=1, finish_reason="stop", metadata={}, fold_version=1, messages=[
...     {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}])
>>> doc = session_document([t])
>>> doc["schema_version"], doc["session_id"], [s["source"] for s in doc["steps"]]
('ATIF-v1.7', 's', ['user', 'agent'])
>>> metrics = doc["steps"][1]["metrics"]
>>> metrics["prompt_token_ids"], metrics["completion_token_ids"], metrics["logprobs"]
([1], [2, 3], [-0.5, -1.0])
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from schemas.events import TrajectoryReady

__all__ = ["ATIF_SCHEMA_VERSION", "session_document", "turn_spans"]

ATIF_SCHEMA_VERSION = "ATIF-v1.7"
"""The oldest ATIF version that has all this writes (``trajectory_id``, embedded
``subagent_trajectories``, ``extra`` on tool calls and observation results)."""

JSON = dict[str, Any]
_SYSTEM_ROLES = frozenset({"system", "developer"})
_TOOL_ROLES = frozenset({"tool", "function"})


def turn_spans(
    loss_mask: np.ndarray, turn_ends: np.ndarray, prompt_len: int
) -> list[tuple[int, int]]:
    """``(start, end)`` of each turn's completion: the generated run ending at its turn end,
    never reaching into the turn before (nor, for the first, into the sample's prompt).

    >>> turn_spans(np.array([0, 1, 1, 0, 0, 1, 1]), np.array([3, 6, 7]), 1)
    [(1, 3), (5, 6), (6, 7)]
    """
    spans = []
    lower = prompt_len
    for end in (int(e) for e in turn_ends):
        start = end
        while start > lower and loss_mask[start - 1] == 1:
            start -= 1
        spans.append((start, end))
        lower = end
    return spans


def session_document(rows: Sequence[TrajectoryReady]) -> JSON:
    """The ATIF document of one session's samples (any order; at least one)."""
    ordered = sorted(rows, key=lambda row: row.segment)
    root, others = ordered[0], ordered[1:]
    documents = {row.segment: _trajectory(row) for row in ordered}
    for row in others:
        _link(row, ordered, documents)
    document = documents[root.segment]
    if others:
        document["subagent_trajectories"] = [documents[row.segment] for row in others]
    return document


def _trajectory(row: TrajectoryReady) -> JSON:
    steps = _steps(row)
    metadata = row.metadata
    agent_name = metadata.get("agent_type") or metadata.get("agent_id") or "agent"
    agent: JSON = {"name": str(agent_name), "version": "unknown"}
    if isinstance(metadata.get("model"), str) and metadata["model"]:  # as the session named it
        agent["model_name"] = metadata["model"]
    if row.tools:
        agent["tool_definitions"] = row.tools
    metrics = [step["metrics"] for step in steps if "metrics" in step]
    extra: JSON = {
        "run": row.run,
        "group": row.group,
        "segment": row.segment,
        "status": row.status,
        "finish_reason": row.finish_reason,
        "reward": row.reward,
        "turn_rewards": row.turn_rewards,
        "min_weight_version": row.min_weight_version,
        "max_weight_version": row.max_weight_version,
        "fold_version": row.fold_version,
        "metadata": metadata,
    }
    if metadata.get("logprobs_kind"):
        extra["logprobs_kind"] = metadata["logprobs_kind"]
    return {
        "schema_version": ATIF_SCHEMA_VERSION,
        "session_id": row.session,
        "trajectory_id": row.trajectory_id,
        "agent": agent,
        "steps": steps,
        "final_metrics": {
            "total_prompt_tokens": sum(m["prompt_tokens"] for m in metrics),
            "total_completion_tokens": sum(m["completion_tokens"] for m in metrics),
            "total_steps": len(steps),
        },
        "extra": extra,
    }


def _steps(row: TrajectoryReady) -> list[JSON]:
    messages = [m for m in row.messages if isinstance(m, dict)]
    spans = turn_spans(row.loss_mask, row.turn_ends, row.prompt_len)
    replies = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    sampled = dict(zip(replies[-len(spans) :] if spans else [], range(len(spans)), strict=False))
    # Turns with no assistant message of their own (a conversation shorter than its tokens):
    # still steps, before the first matched one, so no sampled token is left out.
    unmatched = len(spans) - len(sampled)
    steps: list[JSON] = [_agent_step(row, {}, spans[k], k) for k in range(unmatched)]
    last_agent: JSON | None = steps[-1] if steps else None
    for i, message in enumerate(messages):
        role = message.get("role")
        if role in _TOOL_ROLES:
            owner = last_agent if last_agent is not None else _new_system_step(steps)
            _observe(owner, message)
            continue
        if role == "assistant":
            k = sampled.get(i)
            step = (
                _agent_step(row, message, spans[k + unmatched], k + unmatched)
                if k is not None
                else _copied_step(message)
            )
            steps.append(step)
            last_agent = step
            continue
        source = "system" if role in _SYSTEM_ROLES else "user"
        steps.append({"source": source, "message": _text(message.get("content"))})
        last_agent = None
    if not steps:  # ATIF wants one step at least: a sample with no conversation recorded
        steps.append({"source": "system", "message": ""})
    agent_steps = [s for s in steps if "metrics" in s]
    if agent_steps:  # the sample's finish reason is its last turn's
        agent_steps[-1]["metrics"]["extra"]["finish_reason"] = row.finish_reason
    for number, step in enumerate(steps, start=1):
        step["step_id"] = number
    return [{"step_id": s.pop("step_id"), **s} for s in steps]


def _new_system_step(steps: list[JSON]) -> JSON:
    """The step a tool result with no agent step before it (a rewritten history) goes on."""
    step: JSON = {"source": "system", "message": ""}
    steps.append(step)
    return step


def _agent_step(row: TrajectoryReady, message: JSON, span: tuple[int, int], k: int) -> JSON:
    start, end = span
    step: JSON = {"source": "agent", "message": _text(message.get("content"))}
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if isinstance(reasoning, str) and reasoning:
        step["reasoning_content"] = reasoning
    if calls := _tool_calls(message.get("tool_calls")):
        step["tool_calls"] = calls
    versions = sorted({int(v) for v in row.versions[start:end]})
    step["metrics"] = {
        "prompt_tokens": start,
        "completion_tokens": end - start,
        "prompt_token_ids": row.input_ids[:start].tolist(),
        "completion_token_ids": row.input_ids[start:end].tolist(),
        "logprobs": row.logprobs[start:end].tolist(),
        "extra": {"turn": k, "weight_versions": versions},
    }
    step["llm_call_count"] = 1
    if k < len(row.turn_rewards) and row.turn_rewards[k] is not None:
        step["extra"] = {"reward": row.turn_rewards[k]}
    return step


def _copied_step(message: JSON) -> JSON:
    step: JSON = {"source": "agent", "message": _text(message.get("content"))}
    if calls := _tool_calls(message.get("tool_calls")):
        step["tool_calls"] = calls
    step["is_copied_context"] = True
    return step


def _observe(step: JSON, message: JSON) -> None:
    call_id = message.get("tool_call_id")
    known = {c["tool_call_id"] for c in step.get("tool_calls", ())}
    result: JSON = {"content": _text(message.get("content"))}
    if isinstance(call_id, str) and call_id in known:
        result["source_call_id"] = call_id
    elif call_id is not None:  # answers no call of this step: kept, unlinked
        result["extra"] = {"tool_call_id": call_id}
    step.setdefault("observation", {"results": []})["results"].append(result)


def _tool_calls(calls: object) -> list[JSON]:
    out = []
    for j, call in enumerate(calls if isinstance(calls, list) else ()):
        call = call if isinstance(call, dict) else {}
        function = _dict(call.get("function"))
        atif: JSON = {
            "tool_call_id": str(call.get("id") or f"call_{j}"),
            "function_name": str(function.get("name") or ""),
            "arguments": {},
        }
        arguments = function.get("arguments")
        parsed = _arguments(arguments)
        if parsed is not None:
            atif["arguments"] = parsed
        elif arguments not in (None, ""):  # not a JSON object: ATIF has no room, extra keeps it
            atif["extra"] = {"arguments": arguments}
        out.append(atif)
    return out


def _arguments(arguments: object) -> JSON | None:
    if isinstance(arguments, dict):
        return arguments
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return None
        return parsed if isinstance(parsed, dict) else None
    return None


def _text(content: object) -> str:
    """A message's content as ATIF's text: parts joined (as the gateway renders them)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part["text"]
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return json.dumps(content, ensure_ascii=False)


def _link(
    row: TrajectoryReady, rows: Sequence[TrajectoryReady], documents: dict[int, JSON]
) -> None:
    """The ``subagent_trajectory_ref`` to ``row`` on the step of the turn it branched off, when
    the fold said which (``branch_of``) and that turn is a step of an exported sample."""
    branch = row.metadata.get("branch_of")
    if not isinstance(branch, dict):
        return
    parent = next((r for r in rows if r.segment == branch.get("segment")), None)
    if parent is None:
        return
    turns = parent.metadata.get("turns")
    if not isinstance(turns, list):  # consecutive turns: known only for the first chain's
        turns = list(range(parent.num_turns)) if parent.segment == 0 else []
    if branch.get("turn") not in turns:
        return
    k = turns.index(branch["turn"])
    step = next(
        (
            s
            for s in documents[parent.segment]["steps"]
            if s.get("metrics", {}).get("extra", {}).get("turn") == k
        ),
        None,
    )
    if step is None:
        return
    ref = {"trajectory_id": row.trajectory_id, "session_id": row.session}
    result: JSON = {"subagent_trajectory_ref": [ref], "extra": {"branch_of": branch}}
    step.setdefault("observation", {"results": []})["results"].append(result)


def _dict(value: object) -> JSON:
    """``value`` when it is a JSON object, else an empty one (absent or malformed alike)."""
    return value if isinstance(value, dict) else {}
