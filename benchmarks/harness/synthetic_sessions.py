"""Seeded synthetic agent sessions (``storage.py``, ``subagents.py``, ``export.py``): turns of
random int32 token ids with text of ~4 characters a token, a system prompt and a task, then
tool calls (85% of turns) and their results or user replies, ``TURNS`` turns a session."""

from __future__ import annotations

import argparse
import base64
import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from harness.reporting import arguments

JSON = dict[str, Any]

TURNS = 30
VOCAB = 151_000
CHARS_PER_TOKEN = 4
MESSAGE_TEMPLATE_TOKENS = 5  # <|im_start|> role \n ... <|im_end|> \n
GENERATION_PROMPT_TOKENS = 3  # <|im_start|> assistant \n
TOOL_CALL_SHARE = 0.85
TOOLS: list[JSON] = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {arg: {"type": "string", "description": f"the {arg}"}},
                "required": [arg],
            },
        },
    }
    for name, description, arg in [
        ("bash", "Run a shell command in the sandbox and return stdout and stderr.", "command"),
        ("read_file", "Read a file of the repository, with line numbers.", "path"),
        ("write_file", "Replace a file of the repository with new content.", "content"),
        ("search", "Search the repository for a regular expression.", "pattern"),
    ]
]


@dataclass(frozen=True)
class Turn:
    """One turn as the model lived it: its full prompt and conversation, not their delta."""

    prompt: np.ndarray  # int32
    messages: list[JSON]
    completion: np.ndarray  # int32
    logprobs: np.ndarray  # float32
    text: str
    tool_calls: list[JSON]
    finish_reason: str

    @property
    def context(self) -> np.ndarray:
        return np.concatenate([self.prompt, self.completion])

    @property
    def assistant_message(self) -> JSON:
        """As ``TurnCompleted.assistant_message`` renders the reply."""
        message: JSON = {"role": "assistant", "content": self.text or None}
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return message


@dataclass(frozen=True)
class Session:
    id: str
    task: str
    turns: list[Turn]

    def unique_tokens(self, num_turns: int) -> int:
        """Distinct token positions after ``num_turns`` turns: the final full context."""
        last = self.turns[num_turns - 1]
        return len(last.prompt) + len(last.completion)


class SessionMaker:
    """Seeded synthetic agent sessions with text sized ~4 characters per token."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
        words = ["".join(rng.choice(letters, int(rng.integers(2, 9)))) for _ in range(2_000)] + [
            "\n",
            "def",
            "return",
            "self",
            "=",
            "()",
            "{",
            "}",
            "import",
            "test",
        ]
        self.corpus = " ".join(rng.choice(words, 120_000).tolist())

    def tokens(self, n: int) -> np.ndarray:
        return self.rng.integers(0, VOCAB, n, dtype=np.int32)

    def text(self, n_tokens: int) -> str:
        n_chars = n_tokens * CHARS_PER_TOKEN
        start = int(self.rng.integers(0, len(self.corpus) - n_chars))
        return self.corpus[start : start + n_chars]

    def message(self, role: str, n_tokens: int, **extra: str) -> tuple[JSON, np.ndarray]:
        """A message and its prompt tokens (content + chat template)."""
        return (
            {"role": role, "content": self.text(n_tokens), **extra},
            self.tokens(n_tokens + MESSAGE_TEMPLATE_TOKENS),
        )

    def session(self) -> Session:
        rng = self.rng
        session_id = base64.urlsafe_b64encode(rng.bytes(16)).rstrip(b"=").decode()
        system, system_ids = self.message("system", int(rng.integers(900, 1_601)))
        task, task_ids = self.message("user", int(rng.integers(150, 401)))
        new_messages = [system, task]
        new_ids = [system_ids, task_ids]
        context = np.empty(0, dtype=np.int32)
        conversation: list[JSON] = []
        turns: list[Turn] = []
        for t in range(TURNS):
            prompt = np.concatenate([context, *new_ids, self.tokens(GENERATION_PROMPT_TOKENS)])
            messages = [*conversation, *new_messages]
            n_completion = int(rng.integers(100, 301))
            calls_tool = t < TURNS - 1 and rng.random() < TOOL_CALL_SHARE
            if calls_tool:
                thought = n_completion // 4
                tool = TOOLS[int(rng.integers(len(TOOLS)))]["function"]
                arg = next(iter(tool["parameters"]["properties"]))
                call_id = f"call_{rng.bytes(12).hex()}"
                arguments = json.dumps({arg: self.text(n_completion - thought)})
                text = self.text(thought)
                tool_calls = [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": tool["name"], "arguments": arguments},
                    }
                ]
            else:
                text, tool_calls = self.text(n_completion), []
            turn = Turn(
                prompt=prompt,
                messages=messages,
                completion=self.tokens(n_completion),
                logprobs=-rng.exponential(0.4, n_completion).astype(np.float32),
                text=text,
                tool_calls=tool_calls,
                finish_reason="tool_calls" if calls_tool else "stop",
            )
            turns.append(turn)
            context = turn.context
            conversation = [*messages, turn.assistant_message]
            if calls_tool:
                reply, reply_ids = self.message(
                    "tool", int(rng.integers(100, 801)), tool_call_id=call_id
                )
            else:
                reply, reply_ids = self.message("user", int(rng.integers(20, 201)))
            new_messages = [reply]
            new_ids = [self.tokens(1), reply_ids]  # the "\n" the template puts after <|im_end|>
        return Session(session_id, task["content"][:80], turns)


def session_arguments(doc: str | None) -> argparse.ArgumentParser:
    """``--quick``, ``--seed`` and ``--store-dir`` of the benchmarks on these sessions."""
    return arguments(
        doc,
        "8 sessions instead of 128 (< 30 s)",
        seed="seed of the synthetic sessions",
        store_dir=True,
    )
