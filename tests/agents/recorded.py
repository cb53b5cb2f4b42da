"""What an agent session must have left in the shards, checked against what the backend served."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.agents.conftest import API_KEY
from tests.agents.script import ANSWER_FILE, ANSWER_TEXT, FINAL_TEXT, NOTE_TEXT, STEPS
from tests.agents.scripted_backend import scored_logprobs

__all__ = ["check_session", "message_text"]


def message_text(message: dict[str, Any]) -> str:
    """A canonical message's content as text (a string, or a list of text parts)."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


def _tool_calls(message: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function", call)
        arguments = function.get("arguments")
        calls.append(
            (function["name"], json.loads(arguments) if isinstance(arguments, str) else arguments)
        )
    return calls


def check_session(
    rows: Sequence[dict[str, Any]],
    served: Sequence[dict[str, Any]],
    *,
    agent: str,
    shell_tool: str,
    command_key: str,
    workdir: Path,
    model_dir: Path,
) -> None:
    """One trajectory of exactly the served model calls, their tokens, log-probs and messages.

    ``served``: the scripted backend's records of this session's model calls, in order.
    """
    assert [call["step"] for call in served] == [1, 2, 3], served
    assert {call["agent"] for call in served} == {agent}, served
    assert (workdir / ANSWER_FILE).read_text().strip() == ANSWER_TEXT, "the tool did not run"

    # Every model call is one turn of one trajectory: no fork, no extra or missing turn.
    assert len(rows) == 1, [(row["trajectory_id"], row["num_turns"]) for row in rows]
    [row] = rows
    assert row["num_turns"] == len(served)
    assert json.loads(row["metadata"]).get("forks", 0) == 0, row["metadata"]
    assert row["status"] == "completed"

    # The loss mask covers exactly the tokens the backend returned, with its log-probs.
    input_ids, mask = row["input_ids"], row["loss_mask"]
    logprobs = row["logprobs"]
    assert sum(mask) == sum(call["completion_tokens"] for call in served)
    generated = [token for token, bit in zip(input_ids, mask, strict=True) if bit]
    assert generated == [token for call in served for token in call["completion_ids"]]
    recorded = [lp for lp, bit in zip(logprobs, mask, strict=True) if bit]
    expected = [lp for call in served for lp in call["logprobs"]]
    np.testing.assert_allclose(recorded, expected, rtol=1e-5, atol=1e-5)
    assert row["turn_ends"][-1] == len(input_ids)

    # They are the tiny model's: recompute the last turn's from the recorded tokens.
    last = served[-1]
    start = row["turn_ends"][-1] - last["completion_tokens"]
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    again, _ = scored_logprobs(
        model, input_ids[:start], input_ids[start:], temperature=last["temperature"], window=None
    )
    np.testing.assert_allclose(recorded[-len(again) :], again, rtol=1e-4, atol=1e-4)

    # Nothing but the conversation went into the tokens: no credential, no request header.
    text = AutoTokenizer.from_pretrained(model_dir).decode(input_ids, skip_special_tokens=False)
    for leaked in (API_KEY, "x-api-key", "anthropic-beta", "X-Claude-Code-Session-Id", "x-codex-"):
        assert leaked not in text, f"{leaked!r} is in the trajectory's tokens"

    # The conversation: both tool calls, the results the CLI really got, the final answer.
    messages = json.loads(row["messages"])
    assert API_KEY not in row["messages"] and API_KEY not in row["tools"]
    calls = [call for message in messages for call in _tool_calls(message)]
    assert [(name, arguments.get(command_key)) for name, arguments in calls] == [
        (shell_tool, STEPS[0]),
        (shell_tool, STEPS[1]),
    ], calls
    results = [message_text(message) for message in messages if message.get("role") == "tool"]
    assert len(results) == 2, messages[-6:]
    assert NOTE_TEXT in results[0], results  # the file's content: the command really ran
    assert ANSWER_FILE in results[1], results  # `ls` after writing it
    assert messages[-1]["role"] == "assistant"
    assert message_text(messages[-1]) == FINAL_TEXT
    tool_names = {(tool.get("function") or tool).get("name") for tool in json.loads(row["tools"])}
    assert shell_tool in tool_names, tool_names
