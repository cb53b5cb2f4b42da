"""Closing and rewarding a session another writer closed first: the client learns it, never a 200.

The log is an in-memory stream here (``tests.helpers.memory_log``: JetStream's expectation and
Msg-Id rules, shared by two gateways' services); the race it stands for was seen against a real
nats-server in the chaos soak: a client's close retried through an outage while the reaper stored
its own close first, both with the Msg-Id ``<run>.<session>.close``. Since issue 36 the log
decides: the client's close states the session's last sequence, the reaper's close moved it, and
the refused close catches up and finds the session closed.
"""

from __future__ import annotations

import pytest

from gateway.core.session_store import SessionLog, SessionStore
from gateway.errors import SessionClosed as ClosedAlready
from gateway.protocol.session_api import CloseSessionRequest, CreateSessionRequest, RewardRequest
from gateway.serving.session_service import SessionService
from schemas import SessionClosed
from tests.helpers.memory_log import MemoryLog


@pytest.mark.parametrize("replicated", [False, True])
async def test_a_reaper_close_landing_just_before_the_clients_is_a_409(replicated: bool) -> None:
    """The race the catch-up before a close cannot see: the reaper's close lands between it and
    the client's publish. A single-node stream refuses the stale close; a replicated one answers
    its Msg-Id (``<run>.<session>.close``, the reaper's too) as a duplicate: either way the
    gateway reads the log back, finds a close that is not the client's, and answers 409."""
    log = MemoryLog(replicated=replicated)
    service = gateway(log)
    session = await service.create("r", CreateSessionRequest(session_id="s"))
    log.before_next_append.append(
        SessionClosed(run="r", session="s", status="timeout", num_turns=0, created_at=1.0)
    )
    with pytest.raises(ClosedAlready, match=r"closed as 'timeout'"):
        await service.close(session, CloseSessionRequest(status="completed", reward=1.0))
    assert session.state.closed and session.state.status == "timeout"
    closes = [e for e in log.events("r", "s") if isinstance(e, SessionClosed)]
    assert [c.status for c in closes] == ["timeout"]


def gateway(log: MemoryLog) -> SessionService:
    """One gateway's session service on ``log`` (a second call: a second gateway)."""
    return SessionService(
        store=SessionStore(log=SessionLog(log.read_after)), publisher=log, model_name="tiny"
    )


@pytest.mark.parametrize("reaper_first", [True, False])
async def test_a_close_after_the_reapers_is_a_409_naming_it(reaper_first: bool) -> None:
    log = MemoryLog()
    service = gateway(log)
    session = await service.create("r", CreateSessionRequest(session_id="s"))
    if reaper_first:
        await log.publish(SessionClosed(run="r", session="s", status="timeout", num_turns=0))
    close = CloseSessionRequest(status="completed", reward=1.0)
    if reaper_first:
        with pytest.raises(ClosedAlready, match=r"closed as 'timeout' \(by the reaper"):
            await service.close(session, close)
    else:
        info = await service.close(session, close)
        assert info.status == "completed"
    closes = [e for e in log.events("r", "s") if isinstance(e, SessionClosed)]
    assert len(closes) == 1


async def test_a_close_sent_to_another_gateway_closes_the_session_for_every_gateway() -> None:
    log = MemoryLog()
    a, b = gateway(log), gateway(log)
    on_a = await a.create("r", CreateSessionRequest(session_id="s"))
    on_b = await b.create("r", CreateSessionRequest(session_id="s"))  # the same session
    assert on_a.state.id == on_b.state.id
    await a.close(on_a, CloseSessionRequest(status="completed", reward=1.0))
    with pytest.raises(ClosedAlready, match="session s"):
        await b.reward(on_b, RewardRequest(value=0.5))
    with pytest.raises(ClosedAlready, match=r"closed as 'completed'"):
        await b.close(on_b, CloseSessionRequest(status="aborted"))
    assert on_b.state.closed and on_b.seq == log.last_seq("r", "s")


async def test_a_reward_on_another_gateway_is_caught_up_not_lost() -> None:
    log = MemoryLog()
    a, b = gateway(log), gateway(log)
    on_a = await a.create("r", CreateSessionRequest(session_id="s"))
    on_b = await b.create("r", CreateSessionRequest(session_id="s"))
    await a.reward(on_a, RewardRequest(value=1.0, key="k1"))
    receipt = await b.reward(on_b, RewardRequest(value=2.0, key="k2"))  # refused once, then in
    assert receipt.acknowledged and log.refused == 1
    assert [getattr(e, "value", None) for e in log.events("r", "s")] == [None, 1.0, 2.0]
