"""A turn that continues a kept turn reuses what that turn built: its context ids as an array,
its prefix length, the JSON text of its ids (``gateway.backends.interface.Prompt``); what
reaches the backend and the log is exactly what a full render and encode would give."""

from __future__ import annotations

import itertools
import json
import logging
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from transformers import AutoTokenizer
from transformers.utils import logging as transformers_logging

from gateway.backends.interface import GenerationChunk, Prompt, SamplingParams
from gateway.core import aggregate, conversation
from gateway.core.aggregate import SessionState
from gateway.core.session_store import Session, SessionStore
from gateway.metrics import GatewayMetrics
from gateway.protocol import ChatCompletionRequest
from gateway.serving import ChatServing, TurnEngine, TurnServing
from gateway.serving.engine import renders_off_loop
from gateway.templates import ChatTemplate
from gateway.tools import get_parser
from schemas.events import TurnCompleted

JSON = dict[str, Any]


class _Receipt:
    seq, duplicate = 1, False


class _Publisher:
    def __init__(self) -> None:
        self.events: list[TurnCompleted] = []

    async def publish(self, event: TurnCompleted) -> _Receipt:
        self.events.append(event)
        return _Receipt()


class _HttpLikeBackend:
    """Encodes every prompt to JSON as the HTTP backends do, and records what it sent."""

    id, max_context = "http-like", 4096

    def __init__(self, reply: list[int]) -> None:
        self.reply = reply
        self.sent: list[tuple[list[int], bytes]] = []

    async def generate(
        self, prompt: Prompt, params: SamplingParams, *, session: str | None = None
    ) -> AsyncIterator[GenerationChunk]:
        self.sent.append((prompt.ids.tolist(), prompt.json()))
        yield GenerationChunk(self.reply, [-0.1] * len(self.reply), finish_reason="stop")

    async def admit(self, params: SamplingParams) -> str | None:
        return None

    async def close(self) -> None:
        return None


class _Setup:
    def __init__(self, model_dir: Path) -> None:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.template = ChatTemplate(tokenizer, max_context=4096)
        reply = [*self.template.encode("Sure."), int(tokenizer.eos_token_id)]
        self.backend = _HttpLikeBackend(reply)
        self.publisher = _Publisher()
        engine = TurnEngine(
            template=self.template,
            backend=self.backend,
            publisher=self.publisher,  # type: ignore[arg-type]
            parser=get_parser("hermes"),
            model_name="tiny",
            metrics=GatewayMetrics(),
        )
        self.store = SessionStore()
        self.chat = ChatServing(TurnServing(engine, self.store))

    async def session(self) -> Session:
        async def create() -> tuple[SessionState, int]:
            return SessionState(run="run", id="s"), 0

        session = await self.store.load(("run", "s"), create)
        assert session is not None
        return session

    async def turn(self, session: Session, messages: list[JSON]) -> JSON:
        request = ChatCompletionRequest.model_validate({"messages": messages, "max_tokens": 16})
        answer = await self.chat.complete(session, request)
        return {"role": "assistant", "content": answer.choices[0].message.content}


def _json_ok(sent: tuple[list[int], bytes]) -> bool:
    ids, text = sent
    return bool(json.loads(text) == ids)


async def test_a_linear_session_sends_each_turn_its_whole_prompt_and_caches_one_head(
    tiny_model_dir: Path,
) -> None:
    setup = _Setup(tiny_model_dir)
    session = await setup.session()
    # One emoji, as in Claude Code's system text: Python would hold the whole render at 4 bytes
    # a character; the cache keeps its UTF-8 (issue 40), and the render still extends it.
    messages: list[JSON] = [{"role": "system", "content": "Be brief. \N{ROCKET}"}]
    renders: list[bool] = []
    render = setup.template.render

    def counted(*args: Any, **kwargs: Any) -> str:
        renders.append(kwargs["generation"])
        return render(*args, **kwargs)

    setup.template.render = counted  # type: ignore[method-assign]
    for k in range(4):
        messages.append({"role": "user", "content": f"question {k} " * (k + 1)})
        renders.clear()
        messages.append(await setup.turn(session, messages))
        assert renders == [True], "one render a turn: the conversation, ready for the reply"
    assert all(_json_ok(sent) for sent in setup.backend.sent)
    events = setup.publisher.events
    for previous, event in itertools.pairwise(events):
        whole = previous.prefix_len + len(previous.prompt_ids) + len(previous.completion_ids)
        assert (event.parent_turn, event.prefix_len) == (previous.turn, whole)
    # A full render of the last conversation gives the very ids sent (token-exact).
    full = setup.template.prompt_ids(messages[:-1], None)
    assert setup.backend.sent[-1][0] == full
    # Only the tip holds a cache: its context's JSON and text (what a render of the tip's
    # conversation starts with).
    nodes = session.state.nodes
    assert list(nodes) == [0, 1, 2, 3] and list(session.contexts) == [3]
    tip, cache = nodes[3], session.contexts[3]
    assert cache.json_head and cache.text is not None
    assert json.loads(b"".join(cache.json_head) + b"]") == tip.context_ids.tolist()
    assert all(isinstance(part, bytes) for part in cache.text)
    text = b"".join(cache.text).decode("utf-8")
    assert "\N{ROCKET}" in text
    assert text == setup.template.decode(tip.context_ids, skip_special_tokens=False)


async def test_two_continuations_of_one_turn_are_both_exact(tiny_model_dir: Path) -> None:
    """The second continuation finds the head taken by the first: it encodes its whole prompt."""
    setup = _Setup(tiny_model_dir)
    session = await setup.session()
    first = [{"role": "user", "content": "hi"}]
    first.append(await setup.turn(session, first))
    a = [*first, {"role": "user", "content": "go left"}]
    b = [*first, {"role": "user", "content": "go right, far"}]
    await setup.turn(session, a)
    await setup.turn(session, b)
    assert all(_json_ok(sent) for sent in setup.backend.sent)
    second, third = setup.publisher.events[1:]
    assert second.parent_turn == third.parent_turn == 0
    assert second.prefix_len == third.prefix_len == len(session.state.nodes[0].context_ids)
    assert setup.backend.sent[2][0] == setup.template.prompt_ids(b, None)


async def test_an_edited_history_forks_with_its_prefix_compared(tiny_model_dir: Path) -> None:
    """A request that continues no kept turn is rendered whole; its delta base and prefix are
    found by comparing tokens, not taken from a continuation."""
    setup = _Setup(tiny_model_dir)
    session = await setup.session()
    first = [{"role": "user", "content": "hello there"}]
    first.append(await setup.turn(session, first))
    edited = [
        {"role": "user", "content": "hello where"},
        first[1],
        {"role": "user", "content": "?"},
    ]
    await setup.turn(session, edited)
    assert all(_json_ok(sent) for sent in setup.backend.sent)
    fork = setup.publisher.events[1]
    prompt = setup.template.prompt_ids(edited, None)
    context = session.state.nodes[0].context_ids
    shared = next(i for i, (x, y) in enumerate(zip(context, prompt, strict=False)) if x != y)
    assert fork.parent_turn == 0 and fork.prefix_len == shared
    assert np.array_equal(
        np.concatenate([context[: fork.prefix_len], fork.prompt_ids]), np.asarray(prompt)
    )


def test_the_prompt_json_of_a_head_and_new_ids() -> None:
    head = Prompt([5, 6]).extended_json_head([7])
    prompt = Prompt(np.array([5, 6, 7, 8, 9], dtype=np.int32), head=head, head_len=3)
    assert prompt.json() == b"[5,6,7,8,9]" and prompt.tolist() == [5, 6, 7, 8, 9]
    assert Prompt([5, 6, 7], head=head, head_len=3).json() == b"[5,6,7]"
    assert Prompt([]).json() == b"[]" and b"".join(Prompt([]).extended_json_head([1])) == b"[1"
    assert b"".join(Prompt([5]).extended_json_head([])) == b"[5"
    assert prompt.extended([10]).json() == b"[5,6,7,8,9,10]"
    # Sent once (its JSON built), a prompt continued after an abort encodes only what follows.
    sent = Prompt([5, 6])
    sent.json()
    assert sent.extended([7, 8]).json() == b"[5,6,7,8]" and sent.extended([]).json() == b"[5,6]"
    assert sent.extended([7]).extended([8]).json() == b"[5,6,7,8]"
    with pytest.raises(ValueError):
        Prompt([1], head=head, head_len=3)


def test_the_tokenizer_warns_of_no_length_limit_the_gateway_enforces_itself(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """transformers warned "Token indices sequence length is longer than the specified maximum
    sequence length for this model (30994 > 4096)" for prompts the server takes."""
    transformers_logging.enable_propagation()  # its records reach caplog
    try:
        with caplog.at_level(logging.WARNING):
            unset = AutoTokenizer.from_pretrained(tiny_model_dir)
            unset.encode("x" * 10_000, add_special_tokens=False)
            assert "longer than the specified maximum" in caplog.text  # what the issue saw
            caplog.clear()
            tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
            template = ChatTemplate(tokenizer, max_context=65_536)
            assert len(template.encode("x" * 10_000)) == 10_000
            # Nor for a prompt past the served context, which the gateway refuses itself (413).
            assert len(template.encode("x" * 70_000)) == 70_000
            # And where transformers' own encode runs (a reconfigured tokenizer: no fast path).
            tokenizer.split_special_tokens = True
            assert len(template.encode("x" * 10_000)) == 10_000
    finally:
        transformers_logging.disable_propagation()
    assert "longer than the specified maximum" not in caplog.text


# A template that rewrites an earlier assistant message once a later one follows (as Qwen3's
# drops earlier turns' reasoning): the render of the next conversation no longer starts with
# the kept turn's text, nor with its render, and the turn forks.
_REWRITING = """\
{%- for message in messages %}
    {%- if message.role == 'assistant' and not loop.last %}
        {{- '<|im_start|>assistant\\n' + message.content | replace('Sure', 'OK') }}
        {{- '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""

# A template that renders replies stripped: the model's reply "  Sure." is rendered "Sure.",
# so the render never starts with the kept turn's text; its render without the new messages
# is still a prefix, and the turn continues the kept one with the end-of-turn text (the two
# renders of continuation_ids), as before the one-render path existed.
_STRIPPING = _REWRITING.replace(" | replace('Sure', 'OK')", " | trim").replace(
    "message.role == 'assistant' and not loop.last", "message.role == 'assistant'"
)


@pytest.mark.parametrize(("template", "continues"), [(_REWRITING, False), (_STRIPPING, True)])
async def test_a_template_that_renders_replies_otherwise(
    tiny_model_dir: Path, template: str, continues: bool
) -> None:
    setup = _Setup(tiny_model_dir)
    setup.template.tokenizer.chat_template = template
    setup.backend.reply = [*setup.template.encode("  Sure."), *setup.backend.reply[-1:]]
    session = await setup.session()
    messages: list[JSON] = [{"role": "user", "content": "hi"}]
    for k in range(3):
        messages.append(await setup.turn(session, messages))
        messages.append({"role": "user", "content": f"and {k}?"})
    await setup.turn(session, messages)
    assert all(_json_ok(sent) for sent in setup.backend.sent)
    events = setup.publisher.events
    for previous, event in itertools.pairwise(events):
        whole = previous.prefix_len + len(previous.prompt_ids) + len(previous.completion_ids)
        assert (event.parent_turn == previous.turn and event.prefix_len == whole) is continues
    if not continues:  # forked: each prompt is the render of its conversation, token for token
        assert setup.backend.sent[-1][0] == setup.template.prompt_ids(messages, None)


async def test_a_turn_computes_each_message_key_once(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The request's message keys are computed once and carried: the resend check, the
    continuation, the event's message delta and the applied node reuse them; only the reply,
    which no request held, gets its key when its node is built."""
    setup = _Setup(tiny_model_dir)
    session = await setup.session()
    keyed: list[JSON] = []
    key = conversation.message_key

    def counted(message: JSON) -> tuple[object, ...]:
        keyed.append(message)
        return key(message)

    monkeypatch.setattr(conversation, "message_key", counted)
    monkeypatch.setattr(aggregate, "message_key", counted)
    messages: list[JSON] = [{"role": "system", "content": "be brief"}]
    for k in range(3):
        messages.append({"role": "user", "content": f"question {k}"})
        keyed.clear()
        messages.append(await setup.turn(session, messages))
        assert len(keyed) == len(messages), "a key per message sent, and one for the reply"
    assert [e.parent_turn for e in setup.publisher.events] == [-1, 0, 1]


async def test_a_prompt_whose_tools_make_it_long_is_rendered_off_the_event_loop(
    tiny_model_dir: Path,
) -> None:
    """Where a prompt is rendered follows what the template writes, not the messages' text
    alone: a coding agent's turn is a little text, tool calls' arguments and many tools (Claude
    Code's 100k-token turn: ~36k characters of text, ~100k rendered), and its render and first
    tokenization held the event loop for ~15 and ~65 ms when only the text was counted. A
    session's first prompt (all of it tokenized) queues on its own thread, apart from the later
    turns of sessions already under way."""
    setup = _Setup(tiny_model_dir)
    threads: list[str] = []
    render = setup.template.render

    def where(*args: Any, **kwargs: Any) -> str:
        threads.append(threading.current_thread().name)
        return render(*args, **kwargs)

    setup.template.render = where  # type: ignore[method-assign]
    tool = {"type": "function", "function": {"name": "t", "parameters": {"type": "object"}}}
    messages: list[JSON] = [{"role": "user", "content": "list the files"}]
    assert not renders_off_loop(messages, [tool])
    many = [{**tool, "function": {**tool["function"], "name": f"t{k}"}} for k in range(40)]
    assert renders_off_loop(messages, many), "40 tools: ~40k characters rendered"

    async def rendered_on(session: Session, tools: list[JSON]) -> list[str]:
        threads.clear()
        request = ChatCompletionRequest.model_validate(
            {"messages": messages, "tools": tools, "max_tokens": 4}
        )
        await setup.chat.complete(session, request)
        return [name.rsplit("_", 1)[0] for name in threads]

    session = await setup.session()
    assert await rendered_on(session, [tool]) == [threading.main_thread().name]
    # The session has a turn now: its later prompts queue apart from sessions' first ones.
    assert await rendered_on(session, many) == ["turnstream-prompt"]

    async def create() -> tuple[SessionState, int]:
        return SessionState(run="run", id="new"), 0

    new = await setup.store.load(("run", "new"), create)
    assert new is not None
    assert await rendered_on(new, many) == ["turnstream-first-prompt"]


def test_message_key_reads_tool_calls_and_content_alike() -> None:
    """What makes a resent message the same: text, role, name, tool call id, and each tool
    call's name with its arguments as an object (spacing and key order aside); a message
    without tool calls, or with an empty list or None of them, keys them as ()."""
    message_key = conversation.message_key
    plain = {"role": "user", "content": "hi"}
    assert message_key(plain) == ("user", "hi", (), None, None)
    assert message_key({**plain, "tool_calls": []}) == message_key({**plain, "tool_calls": None})
    assert message_key({**plain, "tool_calls": None}) == message_key(plain)
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"b":1,"a":2}'}}
    spaced = {**call, "function": {"name": "f", "arguments": '{"a": 2, "b": 1}'}}
    said = {"role": "assistant", "content": None, "tool_calls": [call]}
    assert message_key(said) == ("assistant", "", (("f", '{"a": 2, "b": 1}'),), None, None)
    assert message_key(said) == message_key({**said, "tool_calls": [spaced], "content": ""})
