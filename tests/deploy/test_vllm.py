"""The real vLLM (its CPU build) behind ``turnstream gateway --backend vllm``, two replicas.

Two vLLM servers on the head_dim-64 tiny model, fitted to call ``get_weather``
(``tests/deploy/vllm_server.py``), a NATS container (testcontainers), the gateway (no
``--model-name`` nor ``--max-context``: it asks the replicas' ``/v1/models``), a fold worker and
the shard writer, all real processes. Agents on the ``openai`` SDK run two 4-turn sessions, one
streamed and one not: the weather question (answered greedily with a ``<tool_call>``), the
tool's result in the history (answered greedily), then two user turns sampled at temperature 1.

What is checked, each against what the other side recorded:

* **token-exact**: every turn's prompt, rebuilt from EVENTS, is the previous turn's context plus
  what the chat template renders for the new messages; vLLM's own counters grew by exactly that
  many prompt tokens and that many generated tokens; the shard row is the last context, its
  loss mask on the generated tokens only, its log-probs those the SDK received;
* **sticky routing, server side**: which vLLM counted each turn (``vllm:request_success_total``):
  all four turns of a session on one replica, the two sessions on different ones;
* **log-prob agreement**: the reference trainer's ``response_log_probs`` (one padded forward pass
  of the same weights in float32, ``turnstream.trainer.objective``) against the rollout log-probs
  vLLM returned, read back from the shards. Measured max |Δ|: 4.5e-06 over 344 generated tokens
  (greedy and temperature-1 turns, ``--logprobs-mode processed_logprobs``); the bound is 1e-3;
* **a tool call round trip**: the model's ``<tool_call>`` comes back as an OpenAI ``tool_calls``
  message, the agent answers it with a ``tool`` message, and the model's next turn reads it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from eventlog import connect, read_session
from eventlog.server import free_ports
from schemas import TurnCompleted
from schemas.events import TrajectoryReady
from schemas.shards import table_to_trajectories
from shardstore import open_shards_dataset
from tests.deploy.conftest import SINGLE_NODE_CONFIG
from tests.deploy.containers import NatsContainer
from tests.deploy.vllm_server import VLLMServer, vllm_python, vllm_tool_model
from tests.helpers.services import WORKER_FLAGS, WRITER_FLAGS, Service
from tests.helpers.tiny_model import WEATHER_QUESTION, WEATHER_RESULT, WEATHER_TOOLS, render_ids
from tests.helpers.waiting import wait_for
from trainer_sink.assembly import assemble
from turnstream.trainer.objective import max_logprob_delta, response_log_probs

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]

RUN = "vllm-deploy"
REPLICAS = 2
LOGPROB_BOUND = 1e-3  # measured 4.5e-06 (2026-11-25); see the module docstring
SAMPLED_TOKENS = 40  # max_tokens of the temperature-1 turns
# WORKER_FLAGS but a reaper that waits: its 3 s idle timeout closed sessions between turns that
# take longer on vLLM's CPU backend (plus the /metrics reads) on a busy 2-core machine.
_IDLE = WORKER_FLAGS.index("--reaper.idle-timeout-s") + 1
SLOW_TURN_WORKER_FLAGS = (*WORKER_FLAGS[:_IDLE], "300", *WORKER_FLAGS[_IDLE + 1 :])


@dataclass
class Stack:
    servers: list[VLLMServer]
    gateway: Service
    gateway_url: str
    services: list[Service]  # the fold worker and the shard writer
    nats: NatsContainer
    shards: Path
    model_dir: Path


@dataclass
class Turn:
    messages: list[dict[str, Any]]  # what the agent sent
    reply: dict[str, Any]  # the assistant message it got (as it sends it back)
    finish_reason: str
    logprobs: list[float]  # what the SDK received
    replica: int  # the vLLM that counted the request
    prompt_tokens: float  # vLLM's own counters' growth
    generation_tokens: float


@dataclass
class Session:
    id: str
    streamed: bool
    turns: list[Turn]


@pytest.fixture(scope="module")
def stack(nats_image: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("vllm")
    python = vllm_python()
    model_dir = vllm_tool_model()
    servers = [
        VLLMServer(python, model_dir, tmp / "logs", name=f"vllm-{i}") for i in range(REPLICAS)
    ]
    client_port, monitor_port, port = free_ports(3)
    nats = NatsContainer(
        nats_image,
        SINGLE_NODE_CONFIG,
        client_port=client_port,
        monitor_port=monitor_port,
        name="nats-vllm",
    )
    services: list[Service] = []
    try:
        for server in servers:  # concurrently: each takes 1.5-3 min on 2 cores
            server.start()
        for server in servers:
            server.wait_ready()
        print(f"vLLM replicas ready in {[round(s.ready_s or 0) for s in servers]} s")
        nats.start()
        gateway = Service(
            "gateway",
            nats.url,
            tmp / "data",
            *("--port", str(port), "--run", RUN, "--backend", "vllm"),
            *("--backend-urls", ",".join(s.url for s in servers), "--model", str(model_dir)),
        )
        services = [
            gateway.start(),
            Service("worker", nats.url, tmp / "data", *SLOW_TURN_WORKER_FLAGS).start(),
            Service("shard-writer", nats.url, tmp / "data", *WRITER_FLAGS).start(),
        ]
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: _healthy(url, gateway), 120, f"the gateway at {url} to answer /health")
        yield Stack(servers, gateway, url, services[1:], nats, tmp / "data" / "shards", model_dir)
    finally:
        for service in services:
            service.kill()
        for server in servers:
            server.stop()
        nats.stop()  # the container, removed


def _healthy(url: str, gateway: Service) -> bool:
    assert gateway.running, f"the gateway exited:\n{gateway.output()}"
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def counters(stack: Stack) -> list[dict[str, float]]:
    return [server.metrics() for server in stack.servers]


def served_by(stack: Stack, before: list[dict[str, float]]) -> tuple[int, list[float]]:
    """The one replica whose vLLM counted a request since ``before``, and its counters' growth
    (requests, prompt tokens, generated tokens)."""
    keys = (
        "vllm:request_success_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
    )
    grown: list[list[float]] = []

    def counted() -> bool:
        after = counters(stack)
        grown[:] = [
            [a.get(k, 0.0) - b.get(k, 0.0) for k in keys]
            for a, b in zip(after, before, strict=True)
        ]
        return sum(g[0] for g in grown) >= 1

    wait_for(counted, 30, "a vLLM replica to count the request in /metrics")
    serving = [i for i, g in enumerate(grown) if g[0] > 0]
    assert len(serving) == 1 and grown[serving[0]][0] == 1, f"requests counted: {grown}"
    return serving[0], grown[serving[0]]


def ask(
    stack: Stack, client: openai.OpenAI, messages: list[dict[str, Any]], *, stream: bool
) -> Turn:
    """One turn: greedy while the weather task is on (the fitted model's two turns), sampled at
    temperature 1 afterwards."""
    greedy = messages[-1]["role"] != "user" or len(messages) == 1
    params: dict[str, Any] = {
        "model": "tiny",  # the gateway answers for the name vLLM serves
        "messages": messages,
        "tools": WEATHER_TOOLS,
        "temperature": 0.0 if greedy else 1.0,
        "max_tokens": 96 if greedy else SAMPLED_TOKENS,
        "logprobs": True,
    }
    before = counters(stack)
    if stream:
        reply, finish, logprobs = _streamed(client, params)
    else:
        answer = client.chat.completions.create(**params)
        choice = answer.choices[0]
        reply = choice.message.model_dump(exclude_none=True)
        finish = choice.finish_reason
        assert choice.logprobs is not None and choice.logprobs.content is not None
        logprobs = [c.logprob for c in choice.logprobs.content]
    replica, grown = served_by(stack, before)
    return Turn(list(messages), reply, finish, logprobs, replica, grown[1], grown[2])


def _streamed(
    client: openai.OpenAI, params: dict[str, Any]
) -> tuple[dict[str, Any], str, list[float]]:
    text, finish, logprobs = "", "", []
    calls: dict[int, dict[str, Any]] = {}
    for chunk in client.chat.completions.create(**params, stream=True):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
            if choice.logprobs is not None and choice.logprobs.content:
                logprobs += [c.logprob for c in choice.logprobs.content]
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(
                    call.index, {"type": "function", "function": {"name": "", "arguments": ""}}
                )
                entry["id"] = call.id or entry.get("id")
                if call.function is not None:
                    entry["function"]["name"] += call.function.name or ""
                    entry["function"]["arguments"] += call.function.arguments or ""
    reply: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        reply["tool_calls"] = [calls[i] for i in sorted(calls)]
    return reply, finish, logprobs


def run_session(stack: Stack, *, streamed: bool) -> Session:
    """The agent: the weather question, then the tool's result for each call the model makes
    and a user follow-up after any other reply, for four turns; then it closes the session."""
    opened = httpx.post(f"{stack.gateway_url}/v1/sessions", json={}, timeout=10).json()
    client = openai.OpenAI(base_url=opened["base_url"], api_key="unused", max_retries=0)
    messages: list[dict[str, Any]] = [*WEATHER_QUESTION]
    follow_ups = iter(("And tomorrow?", "Thanks. Anything else?", "Go on."))
    turns: list[Turn] = []
    while len(turns) < 4:
        turn = ask(stack, client, messages, stream=streamed)
        turns.append(turn)
        messages.append(turn.reply)
        calls = turn.reply.get("tool_calls") or []
        messages += [
            {"role": "tool", "tool_call_id": call["id"], "content": WEATHER_RESULT}
            for call in calls
        ]
        if not calls and len(turns) < 4:
            messages.append({"role": "user", "content": next(follow_ups)})
    closed = httpx.post(f"{stack.gateway_url}/v1/sessions/{opened['session_id']}/close", json={})
    assert closed.status_code == 200, closed.text
    return Session(str(opened["session_id"]), streamed, turns)


@dataclass
class Rollouts:
    sessions: list[Session]
    events: dict[str, list[TurnCompleted]]  # per session, as the gateway published them
    rows: dict[str, TrajectoryReady]  # per session, read back from the shards


@pytest.fixture(scope="module")
def rollouts(stack: Stack) -> Rollouts:
    sessions = [run_session(stack, streamed=False), run_session(stack, streamed=True)]
    ids = {s.id for s in sessions}

    def in_shards() -> bool:
        for service in stack.services:
            assert service.running, f"{service.command} exited:\n{service.output()}"
        return ids <= {t.session for t in _shard_trajectories(stack.shards)}

    wait_for(in_shards, 120, f"sessions {sorted(ids)} in the shards")
    time.sleep(1.0)  # a second row for one of them would show up by now
    rows = _shard_trajectories(stack.shards)
    assert sorted(t.session for t in rows) == sorted(ids), "each session in exactly one row"
    events = asyncio.run(_turn_events(stack.nats.url, ids))
    return Rollouts(sessions, events, {t.session: t for t in rows})


def _shard_trajectories(root: Path) -> list[TrajectoryReady]:
    if not root.exists():
        return []
    return [t for _, t in table_to_trajectories(open_shards_dataset(str(root)).to_table())]


async def _turn_events(nats_url: str, sessions: set[str]) -> dict[str, list[TurnCompleted]]:
    nc = await connect(nats_url, name="vllm-deploy-test")
    try:
        js = nc.jetstream()
        out = {}
        for session in sessions:
            events = await read_session(js, RUN, session)
            out[session] = sorted(
                (e for e in events if isinstance(e, TurnCompleted)), key=lambda e: e.turn
            )
        return out
    finally:
        await nc.close()


def test_each_turn_is_token_exact_from_the_chat_template_through_vllm_to_the_shards(
    stack: Stack, rollouts: Rollouts
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(stack.model_dir)
    for session in rollouts.sessions:
        turns = rollouts.events[session.id]
        assert [t.turn for t in turns] == [0, 1, 2, 3], f"session {session.id}"
        context: list[int] = []
        for index, (turn, seen) in enumerate(zip(turns, session.turns, strict=True)):
            where = f"session {session.id} (streamed: {session.streamed}) turn {index}"
            prompt = context[: turn.prefix_len] + turn.prompt_ids.tolist()
            rendered = render_ids(
                tokenizer, seen.messages, WEATHER_TOOLS, add_generation_prompt=True
            )
            if index == 0:
                assert prompt == rendered, where
            else:
                # Tokens in, tokens out: the previous context (the model's own tokens, not a
                # re-rendering of its text) is kept, and what follows is the template's
                # rendering from the end of the model's tokens on: the '\n' after the
                # <|im_end|> the model generated (or both, after a reply cut at max_tokens),
                # the tool or user turn and the generation prompt.
                assert turn.prefix_len == len(context), where
                stopped = context[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")
                new = _rendered_after_last_reply(tokenizer, seen.messages, stopped)
                assert prompt[len(context) :] == new, where
            # What vLLM saw and made, by its own counters.
            assert seen.prompt_tokens == len(prompt), where
            assert seen.generation_tokens == len(turn.completion_ids), where
            assert turn.logprobs.tolist() == pytest.approx(seen.logprobs, abs=1e-6), where
            context = prompt + turn.completion_ids.tolist()

        row = rollouts.rows[session.id]
        assert (row.status, row.num_turns, row.segment) == ("completed", 4, 0)
        assert row.input_ids.tolist() == context
        mask = [0] * len(context)
        logprobs = [0.0] * len(context)
        for turn in turns:
            start = turn.prefix_len + len(turn.prompt_ids)
            stop = start + len(turn.completion_ids)
            mask[start:stop] = [1] * (stop - start)
            logprobs[start:stop] = turn.logprobs.tolist()
        assert row.loss_mask.tolist() == mask, f"session {session.id}"
        assert row.logprobs.tolist() == pytest.approx(logprobs, abs=1e-6)


def _rendered_after_last_reply(
    tokenizer: Any, messages: list[dict[str, Any]], stopped: bool
) -> list[int]:
    """What the template renders after the last assistant message's content: from its closing
    ``<|im_end|>`` on, or from the ``\n`` after it when the model generated that ``<|im_end|>``
    (``stopped``)."""
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    upto = render_ids(tokenizer, messages[: last + 1], WEATHER_TOOLS, add_generation_prompt=False)
    full = render_ids(tokenizer, messages, WEATHER_TOOLS, add_generation_prompt=True)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert upto[-2:] == [im_end, tokenizer.encode("\n")[0]]
    return full[len(upto) - (1 if stopped else 2) :]


def test_the_gateway_took_the_model_name_and_context_from_vllm(stack: Stack) -> None:
    """Started without --model-name and --max-context: the replicas' /v1/models gave both."""
    log = " ".join(stack.gateway.log_path.read_text().split())  # rich wraps long lines
    assert "backend serves 'tiny', context 4096 tokens" in log, stack.gateway.output()


def test_every_turn_of_a_session_went_to_one_vllm_and_both_served(rollouts: Rollouts) -> None:
    replicas = {s.id: {t.replica for t in s.turns} for s in rollouts.sessions}
    assert all(len(used) == 1 for used in replicas.values()), f"replicas per session: {replicas}"
    assert set().union(*replicas.values()) == set(range(REPLICAS)), (
        f"replicas per session: {replicas}; a new session goes to the least-loaded replica, "
        f"ties rotating"
    )


def test_rollout_logprobs_agree_with_the_reference_trainers(
    stack: Stack, rollouts: Rollouts
) -> None:
    model = AutoModelForCausalLM.from_pretrained(stack.model_dir, dtype=torch.float32)
    model.train(False)
    batch = assemble(list(rollouts.rows.values()))
    with torch.no_grad():
        # Temperature 1: the sampled turns' temperature; greedy turns record the raw logits'
        # log-probs, which is the same computation.
        log_probs = response_log_probs(model, batch, temperature=1.0)
    mask = batch["response_mask"].bool()
    delta = max_logprob_delta(log_probs, batch["rollout_log_probs"], mask)
    tokens = int(mask.sum())
    print(f"log-prob agreement: max |delta| {delta:.3g} over {tokens} generated tokens")
    assert delta is not None and tokens > 40
    assert delta < LOGPROB_BOUND, (
        f"vLLM's rollout log-probs and the trainer's differ by up to {delta:.3g} "
        f"(bound {LOGPROB_BOUND}) over {tokens} tokens"
    )


def test_a_tool_call_makes_the_round_trip(rollouts: Rollouts) -> None:
    for session in rollouts.sessions:
        call, answer = session.turns[0], session.turns[1]
        assert call.finish_reason == "tool_calls", (
            f"session {session.id}: the fitted model did not call the tool: {call.reply}"
        )
        (tool_call,) = call.reply["tool_calls"]
        assert tool_call["function"]["name"] == "get_weather"
        assert tool_call["function"]["arguments"].replace(" ", "") == '{"city":"Paris"}'
        assert answer.messages[-1] == {
            "role": "tool",
            "tool_call_id": tool_call["id"],
            "content": WEATHER_RESULT,
        }
        assert answer.reply["content"] == "It is 18°C and sunny in Paris."
