"""The demo's agents: honest ``openai`` SDK clients, two episode types, one reward.

The task the tiny model is trained on: **write lowercase letters**. Whatever the prompt, an
answer earns the share of its token budget spent on the letters a-z, one token each
(``lowercase_reward``; the agents read the tokens from the response's ``logprobs``, so a
multi-letter token such as ``</tool_call>`` earns nothing). A random model scores about 0.08 (26
byte tokens out of a vocabulary of 320), and nothing but GRPO's comparisons within a group tells
it what scores more.

Each GRPO group is ``group_size`` episodes of one prompt, each episode a session of the gateway:

- ``write``: two turns of chat ("Write a word." ... "Another one."), reward over both answers;
- ``lookup``: a real tool call. The agent offers the ``dictionary_word`` tool and asks for it by
  name (``tool_choice``); the model writes the call, the gateway returns it as ``tool_calls``,
  the agent runs the tool and sends the result back as a ``role: tool`` message with its
  ``tool_call_id``, and the model answers. Reward over the answer; ``NO_CALL`` (-0.5) when no
  call came back. The penalty keeps the call alive: what GRPO teaches the answers bends the
  whole tiny model, the call's end included, and only a group in which some calls fail gives
  it something to push back with (a call every member makes has advantage 0).

Batches are on-policy: batch ``b`` is generated once the gateway serves policy version ``b``
(``/health``), and the trainer publishes version ``b + 1`` only after training on it. Every
sample of a step is then drawn from exactly the weights the trainer holds, so each step checks
the log-probs of all of them, and the reward of step ``b + 1`` is that of version ``b``.

Sampling is seeded (the request's ``seed``, derived from ``--seed`` and the episode's place), so a
demo with the same settings on the same machine replays the same episodes.
"""

from __future__ import annotations

import asyncio
import random
import string
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import httpx
import httpx2
import openai

from schemas.errors import TurnstreamError

__all__ = [
    "CHANCE",
    "KEEPALIVE_EXPIRY_S",
    "LOOKUP_PROMPTS",
    "NO_CALL",
    "TOOLS",
    "TURN_TIMEOUT_S",
    "WORDS",
    "WORD_TOOL",
    "WORD_TOOL_NAME",
    "WRITE_PROMPTS",
    "AgentPlan",
    "Answer",
    "DemoAgentError",
    "Episode",
    "lowercase_reward",
    "run_agents",
]

EpisodeKind = Literal["write", "lookup"]

WORD_TOOL_NAME = "dictionary_word"
WORD_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": WORD_TOOL_NAME,
        "description": "A word from the dictionary, for the user to write down.",
        "parameters": {"type": "object", "properties": {}},
    },
}
TOOLS = [WORD_TOOL]
WORDS = ("apple", "river", "garden", "candle", "window", "pepper", "meadow", "violin")

WRITE_PROMPTS = ("Write a word.", "Name a colour.", "Say hello.", "Spell a name.")
# Few lookup prompts: ``demo.model`` fits the end of the call after each (long: the tools).
LOOKUP_PROMPTS = ("Look up a word and write it.", "Ask the dictionary for a word.")
FOLLOW_UP = "Another one."
NO_CALL = -0.5  # the reward of a lookup whose tool call did not come back (see above)
TURN_TIMEOUT_S = 120.0  # one turn, queued behind a whole batch on a busy machine included
# Idle connections are dropped by the client before the server's keep-alive (uvicorn: 5 s)
# closes them: a request sent on a connection the server is closing dies with a ReadError.
KEEPALIVE_EXPIRY_S = 1.0
LOWERCASE = frozenset(string.ascii_lowercase)
CHANCE = 26 / 320  # the reward of uniform noise over the tiny model's 320 token ids


class DemoAgentError(TurnstreamError):
    """The demo's agents could not go on (the trainer stalled, the gateway refused a turn)."""


def lowercase_reward(answers: Sequence[Sequence[str]], budget: int) -> float:
    """The share of the answers' token budget spent on tokens that are one letter a-z.

    >>> lowercase_reward([["a", "b", "!"], ["c", "call"]], budget=4)
    0.375
    """
    if not answers:
        return 0.0
    letters = sum(token in LOWERCASE for tokens in answers for token in tokens)
    return letters / (budget * len(answers))


@dataclass(frozen=True)
class AgentPlan:
    """What the agents run: ``steps`` batches of ``groups_per_step`` groups of ``group_size``."""

    steps: int
    group_size: int
    groups_per_step: int
    max_tokens: int
    temperature: float
    seed: int

    def kind(self, batch: int, group: int) -> EpisodeKind:
        return "write" if (batch * self.groups_per_step + group) % 2 == 0 else "lookup"

    def prompt(self, batch: int, group: int) -> str:
        number = (batch * self.groups_per_step + group) // 2
        prompts = WRITE_PROMPTS if self.kind(batch, group) == "write" else LOOKUP_PROMPTS
        return prompts[number % len(prompts)]

    def request_seed(self, *place: object) -> int:
        """The sampling seed of one request, a function of ``--seed`` and its place only."""
        return random.Random("/".join(map(str, (self.seed, *place)))).getrandbits(63)


@dataclass(frozen=True)
class Answer:
    text: str
    tokens: tuple[str, ...]  # as the response's logprobs name them


def _answer(reply: Any) -> Answer:
    choice = reply.choices[0]
    content = choice.logprobs.content if choice.logprobs is not None else None
    return Answer(choice.message.content or "", tuple(t.token for t in content or []))


@dataclass(frozen=True)
class Episode:
    batch: int  # generated by policy version ``batch``
    group: str
    kind: EpisodeKind
    session: str
    reward: float
    answers: tuple[Answer, ...]
    tool_calls: int  # tool calls the model made (and the agent answered)


class Agents:
    """The episodes of one demo run, against one gateway (``http``: its base URL)."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        sdk_http: openai.DefaultAsyncHttpxClient,
        plan: AgentPlan,
        model: str,
    ) -> None:
        self.http = http  # the gateway's session API
        self.sdk_http = sdk_http  # the connection pool the SDK's clients share
        self.plan = plan
        self.model = model

    async def episode(self, batch: int, group: int, member: int) -> Episode:
        plan = self.plan
        group_id = f"b{batch}-g{group}"
        kind = plan.kind(batch, group)
        opened = await self._post(
            "/v1/sessions", {"group": group_id, "metadata": {"task": kind, "batch": batch}}
        )
        session = str(opened["session_id"])
        # The SDK on the session's own base URL; the connection pool is shared.
        client = openai.AsyncOpenAI(
            base_url=opened["base_url"], api_key="unused", max_retries=0, http_client=self.sdk_http
        )
        seeds = [plan.request_seed(batch, group, member, turn) for turn in range(2)]
        prompt = plan.prompt(batch, group)
        if kind == "write":
            answers, calls = await self._write(client, prompt, seeds), 0
        else:
            word = WORDS[random.Random(seeds[0]).randrange(len(WORDS))]
            answers, calls = await self._lookup(client, prompt, word, seeds)
        tokens = [a.tokens for a in answers]
        reward = lowercase_reward(tokens, plan.max_tokens) if kind == "write" or calls else NO_CALL
        await self._post(f"/v1/sessions/{session}/close", {"reward": reward})
        return Episode(batch, group_id, kind, session, reward, tuple(answers), calls)

    async def _write(
        self, client: openai.AsyncOpenAI, prompt: str, seeds: Sequence[int]
    ) -> list[Answer]:
        messages: list[Any] = [{"role": "user", "content": prompt}]
        answers: list[Answer] = []
        for turn, seed in enumerate(seeds):
            if turn:
                messages.append({"role": "user", "content": FOLLOW_UP})
            answer = _answer(await self._create(client, messages, seed))
            answers.append(answer)
            messages.append({"role": "assistant", "content": answer.text})
        return answers

    async def _lookup(
        self, client: openai.AsyncOpenAI, prompt: str, word: str, seeds: Sequence[int]
    ) -> tuple[list[Answer], int]:
        """Ask for the tool by name, run it, send its result back, take the answer."""
        messages: list[Any] = [{"role": "user", "content": prompt}]
        forced = {"type": "function", "function": {"name": WORD_TOOL_NAME}}
        reply = await self._create(client, messages, seeds[0], tools=TOOLS, tool_choice=forced)
        message = reply.choices[0].message
        calls = [c for c in message.tool_calls or [] if c.type == "function"]
        if not calls:
            return [_answer(reply)], 0
        messages.append(
            {
                "role": "assistant",
                "content": message.content,
                "tool_calls": [
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {
                            "name": call.function.name,
                            "arguments": call.function.arguments,
                        },
                    }
                    for call in calls
                ],
            }
        )
        for call in calls:
            result = word if call.function.name == WORD_TOOL_NAME else "unknown tool"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        reply = await self._create(client, messages, seeds[1], tools=TOOLS)
        return [_answer(reply)], len(calls)

    async def _create(
        self, client: openai.AsyncOpenAI, messages: list[Any], seed: int, **tools: Any
    ) -> Any:
        try:
            return await client.chat.completions.create(
                model=self.model,
                messages=messages,
                temperature=self.plan.temperature,
                max_tokens=self.plan.max_tokens,
                seed=seed,
                logprobs=True,
                **tools,
            )
        except openai.APIError as exc:
            raise DemoAgentError(f"the gateway refused a demo turn: {exc}") from exc

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = await self.http.post(path, json=body)
        if response.status_code != 200:
            raise DemoAgentError(f"POST {path} answered {response.status_code}: {response.text}")
        answer: dict[str, Any] = response.json()
        return answer

    async def served_version(self) -> int:
        return int((await self.http.get("/health")).json()["weight_version"])

    async def wait_for_version(
        self, version: int, training: asyncio.Task[Any], timeout_s: float
    ) -> None:
        """Until the gateway serves ``version``; the trainer's error if it failed meanwhile."""
        deadline = time.monotonic() + timeout_s
        while await self.served_version() < version:
            if training.done():
                training.result()  # raises the trainer's error
                raise DemoAgentError(
                    f"the trainer stopped before publishing policy version {version}"
                )
            if time.monotonic() > deadline:
                raise DemoAgentError(
                    f"the gateway did not serve policy version {version} within {timeout_s:.0f} "
                    f"s: is the trainer stuck (see the log above)?"
                )
            await asyncio.sleep(0.02)


async def run_agents(
    http: httpx.AsyncClient,
    plan: AgentPlan,
    training: asyncio.Task[Any],
    on_batch: Callable[[int, list[Episode]], None] = lambda batch, episodes: None,
    *,
    version_timeout_s: float = 120.0,
) -> list[Episode]:
    """Run ``plan.steps`` on-policy batches (see the module docstring); ``on_batch`` hears of
    each batch once its episodes are closed."""
    models = (await http.get("/v1/models")).json()["data"]
    episodes: list[Episode] = []
    async with openai.DefaultAsyncHttpxClient(
        timeout=TURN_TIMEOUT_S, limits=httpx2.Limits(keepalive_expiry=KEEPALIVE_EXPIRY_S)
    ) as sdk_http:
        agents = Agents(http, sdk_http, plan, str(models[0]["id"]))
        for batch in range(plan.steps):
            await agents.wait_for_version(batch, training, version_timeout_s)
            done = await asyncio.gather(
                *(
                    agents.episode(batch, group, member)
                    for group in range(plan.groups_per_step)
                    for member in range(plan.group_size)
                )
            )
            episodes += done
            on_batch(batch, list(done))
    return episodes
