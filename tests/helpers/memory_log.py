"""An in-memory EVENTS stream for tests of the gateway core (pure logic around the Publisher port
and ``ReadAfter``), with the two JetStream rules the core relies on, as measured on nats-server
2.15.1 (tests/integration/test_append_expectations.py checks them against the real server):

* an append's ``Expectation`` (the last sequence on the session's subjects) is checked *before*
  Msg-Id de-duplication: stale, it is refused (``AppendRefused`` with the actual last sequence);
  on a replicated stream (R3, ``replicated=True``) the other way round: a Msg-Id it holds is
  answered as a duplicate before the expectation is checked (tests/deploy/test_cluster.py);
* a Msg-Id already stored is not stored again (a duplicate receipt).

Several gateways (stores, services, engines) share one ``MemoryLog`` as they share one stream.
The real stream is used everywhere else (integration and e2e tests)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

from eventlog import AppendRefused, Expectation, PublishReceipt, SessionTail
from schemas import Event, SessionEvent, route


@dataclass
class MemoryLog:
    stored: list[tuple[int, Event]] = field(default_factory=list)
    msg_ids: dict[str, int] = field(default_factory=dict)
    reads: int = 0
    refused: int = 0
    round_trip_s: float = 0.0  # >0: each call yields, so concurrent callers interleave
    replicated: bool = False  # de-duplicate before checking the expectation (an R3 stream)
    # Events another writer stores just before the next expected append is checked (a race).
    before_next_append: list[Event] = field(default_factory=list)

    def last_seq(self, run: str, session: str) -> int:
        return max(
            (seq for seq, e in self.stored if isinstance(e, SessionEvent) and _of(e, run, session)),
            default=0,
        )

    async def publish(self, event: Event, *, expect: Expectation | None = None) -> PublishReceipt:
        await asyncio.sleep(self.round_trip_s)
        msg_id = route(event).msg_id
        if expect is not None and self.before_next_append:
            others, self.before_next_append = self.before_next_append, []
            for other in others:
                await self.publish(other)
        if self.replicated and msg_id in self.msg_ids:
            return PublishReceipt(msg_id, "EVENTS", self.msg_ids[msg_id], duplicate=True)
        if expect is not None and isinstance(event, SessionEvent):
            last = self.last_seq(event.run, event.session)
            if last != expect.last_seq:
                self.refused += 1
                raise AppendRefused(msg_id, expect.subjects, expect.last_seq, last)
        if msg_id in self.msg_ids:
            return PublishReceipt(msg_id, "EVENTS", self.msg_ids[msg_id], duplicate=True)
        seq = len(self.stored) + 1
        self.stored.append((seq, event))
        self.msg_ids[msg_id] = seq
        return PublishReceipt(msg_id, "EVENTS", seq)

    async def publish_many(self, events: Sequence[Event]) -> list[PublishReceipt]:
        return [await self.publish(e) for e in events]

    async def publish_raw(
        self, subject: str, payload: bytes, msg_id: str, *, expect: Expectation | None = None
    ) -> PublishReceipt:
        raise AssertionError("the gateway core publishes events only")

    async def read_after(self, run: str, session: str, after_seq: int) -> SessionTail:
        """``eventlog.read_session_after`` over this stream."""
        self.reads += 1
        await asyncio.sleep(self.round_trip_s)
        events = [
            (seq, e)
            for seq, e in self.stored
            if seq > after_seq and isinstance(e, SessionEvent) and _of(e, run, session)
        ]
        return SessionTail(after_seq, events, events[-1][0] if events else after_seq)

    def events(self, run: str, session: str) -> list[SessionEvent]:
        return [e for _, e in self.stored if isinstance(e, SessionEvent) and _of(e, run, session)]


def _of(event: SessionEvent, run: str, session: str) -> bool:
    return event.run == run and event.session == session
