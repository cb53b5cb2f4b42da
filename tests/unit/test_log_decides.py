"""The log decides, not the gateway's memory (issue 36): two gateways' turn cores (engine, serving,
store) on one in-memory stream with JetStream's expectation rules (``tests.helpers.memory_log``;
the real server's rules are checked in tests/integration/test_append_expectations.py and the
whole fleet in tests/e2e/test_fleet.py). A turn's append states the session's last sequence as
its gateway knows it; refused, the gateway catches up on only what followed and appends again,
under another index, or refuses the turn (409) where the log holds the session closed."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from eventlog import AppendRefused, Expectation, PublishReceipt
from gateway.core.session_store import Session, SessionLog, SessionStore
from gateway.errors import SessionClosed
from gateway.metrics import GatewayMetrics
from gateway.protocol import ChatCompletionRequest
from gateway.serving import ChatServing, TurnEngine, TurnServing
from gateway.templates import ChatTemplate
from gateway.tools import get_parser
from schemas import Event, SessionOpened
from schemas.events import SessionClosed as Closed
from schemas.events import TurnCompleted
from tests.helpers.memory_log import MemoryLog
from tests.unit.test_concurrent_turns import REPLY, WAIT, _GatedBackend, request


class Gateway:
    """One gateway's turn core on ``log``; ``backend`` holds each generation at its gate."""

    def __init__(self, model_dir: Path, log: MemoryLog, name: str) -> None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        template = ChatTemplate(tokenizer)
        ids = [*tokenizer.encode(REPLY, add_special_tokens=False), *template.stop_token_ids[:1]]
        self.backend = _GatedBackend(ids)
        self.metrics = GatewayMetrics()
        self.store = SessionStore(log=SessionLog(log.read_after, metrics=self.metrics))
        self.engine = TurnEngine(
            template=template,
            backend=self.backend,
            publisher=log,
            parser=get_parser("hermes"),
            model_name="tiny",
            metrics=self.metrics,
            store=self.store,
            instance=name,
        )
        self.chat = ChatServing(TurnServing(self.engine, self.store))

    async def session(self, log: MemoryLog) -> Session:
        session = await self.store.load(("run", "s"))  # opened by the test, in the log
        assert session is not None
        return session


async def fleet(model_dir: Path, replicated: bool = False) -> tuple[MemoryLog, Gateway, Gateway]:
    log = MemoryLog(replicated=replicated)
    await log.publish(SessionOpened(run="run", session="s"))
    return log, Gateway(model_dir, log, "a"), Gateway(model_dir, log, "b")


def turns(log: MemoryLog) -> list[TurnCompleted]:
    return [e for e in log.events("run", "s") if isinstance(e, TurnCompleted)]


@pytest.mark.parametrize("replicated", [False, True])
async def test_an_append_refused_for_another_gateways_turn_takes_the_next_index(
    tiny_model_dir: Path, replicated: bool
) -> None:
    """A single-node stream refuses a's stale append; a replicated one answers its Msg-Id (the
    index's, b's turn holds it) as a duplicate first: a reads back which turn that is."""
    log, a, b = await fleet(tiny_model_dir, replicated)
    on_a, on_b = await a.session(log), await b.session(log)
    slow = asyncio.create_task(a.chat.complete(on_a, request("task a")))
    await asyncio.wait_for(a.backend.first_sent.wait(), WAIT)
    b.backend.gate.set()
    await b.chat.complete(on_b, request("task b"))  # stored while a's turn generates
    a.backend.gate.set()
    await asyncio.wait_for(slow, WAIT)
    stored = turns(log)
    assert [(t.turn, t.reply_id != "") for t in stored] == [(0, True), (1, True)]
    assert log.refused == (0 if replicated else 1), "a's append stated a sequence b's moved"
    assert on_a.state.turns == 2 and on_a.seq == log.last_seq("run", "s")
    assert a.metrics.appends_refused.labels("turn")._value.get() == 1
    assert a.metrics.caught_up_events._value.get() == 1
    assert stored[0].sampling["seed"] != stored[1].sampling["seed"], "each gateway's own seeds"


async def test_a_turn_generating_when_another_gateway_closes_is_not_recorded(
    tiny_model_dir: Path,
) -> None:
    log, a, _ = await fleet(tiny_model_dir)
    on_a = await a.session(log)
    slow = asyncio.create_task(a.chat.complete(on_a, request()))
    await asyncio.wait_for(a.backend.first_sent.wait(), WAIT)
    await log.publish(Closed(run="run", session="s", status="timeout", num_turns=0))  # reaper
    a.backend.gate.set()
    with pytest.raises(SessionClosed, match="session s"):
        await asyncio.wait_for(slow, WAIT)
    assert turns(log) == [] and on_a.state.closed
    with pytest.raises(SessionClosed):  # refused before generating, from memory now
        await a.chat.complete(on_a, request())
    assert a.backend.calls == 1


async def test_an_idle_session_catches_up_before_it_generates(tiny_model_dir: Path) -> None:
    log, a, _ = await fleet(tiny_model_dir)
    on_a = await a.session(log)
    await log.publish(Closed(run="run", session="s", status="completed", num_turns=0))
    on_a.synced_at -= 60  # not heard from the log about it for a minute
    with pytest.raises(SessionClosed):
        await a.chat.complete(on_a, request())
    assert a.backend.calls == 0, "closed elsewhere: refused before anything is generated"
    assert a.metrics.catch_up_reads.labels("idle")._value.get() == 1


class _LosesTheAck(MemoryLog):
    """Stores the first turn, then answers as JetStream does to a retry whose first try landed
    (refused: the expectation is checked before the Msg-Id) and whose look-up failed."""

    async def publish(self, event: Event, *, expect: Expectation | None = None) -> PublishReceipt:
        receipt = await super().publish(event, expect=expect)
        if isinstance(event, TurnCompleted) and expect is not None:
            raise AppendRefused(receipt.msg_id, expect.subjects, expect.last_seq, receipt.seq, True)
        return receipt


async def test_a_refused_retry_whose_first_try_landed_is_that_turn(tiny_model_dir: Path) -> None:
    log = _LosesTheAck()
    await log.publish(SessionOpened(run="run", session="s"))
    a = Gateway(tiny_model_dir, log, "a")
    on_a = await a.session(log)
    a.backend.gate.set()
    reply = await a.chat.complete(on_a, request())
    stored = turns(log)
    assert len(stored) == 1 and reply.id == f"chatcmpl-s-{stored[0].reply_id}"
    assert on_a.state.turns == 1


async def test_requests_racing_on_a_stale_copy_both_continue_the_turn_they_extend(
    tiny_model_dir: Path,
) -> None:
    """Two requests that continue a turn another gateway stored, on a copy that lacks it: the
    first one's catch-up applies it while the second waits for the session's lock, and the
    second's catch-up then finds nothing new; both must prepare again from the state as it is
    now, or the second renders the turn it continues from text (found by benchmarks/fleet.py
    with --worker-routing any: a sub-agent's turn racing its main agent's)."""
    log, a, b = await fleet(tiny_model_dir)
    log.round_trip_s = 0.01  # reads and appends take a moment: the requests interleave
    on_b = await b.session(log)
    b.backend.gate.set()
    first = await b.chat.complete(on_b, request("task"))
    on_a = await a.session(log)  # a loads the session holding turn 0 only
    conversation = [
        {"role": "user", "content": "task"},
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "go on"},
    ]
    second = await b.chat.complete(
        on_b, ChatCompletionRequest(messages=conversation, max_tokens=64)
    )
    conversation.append({"role": "assistant", "content": second.choices[0].message.content})
    a.backend.gate.set()
    branches = [
        ChatCompletionRequest(
            messages=[*conversation, {"role": "user", "content": ask}], max_tokens=64
        )
        for ask in ("left", "right")
    ]
    await asyncio.wait_for(asyncio.gather(*(a.chat.complete(on_a, r) for r in branches)), WAIT)
    stored = turns(log)
    assert [t.turn for t in stored] == [0, 1, 2, 3]
    whole = len(on_a.state.nodes[1].context_ids)
    assert [(t.parent_turn, t.prefix_len) for t in stored[2:]] == [(1, whole), (1, whole)]
    assert a.metrics.stale_prompts._value.get() == 0
