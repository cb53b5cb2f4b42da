"""Publishing events to JetStream: deterministic Msg-Id, awaited ack, retries, outbox.

We do not use nats-py's ``publish_async`` futures: a server-side error can leave them pending
forever (nats.py issue #985). Instead every publish carries a reply subject under one inbox
subscription of ours, and every wait for an ack has a deadline. A publish that gets no ack in
time is retried with the *same* Msg-Id, so the stream's duplicate window absorbs the copies; once
the tries are spent the event goes to the on-disk outbox (when configured), which drains in order
on its own. While the outbox holds anything, new events are appended behind it: the log sees
every event in the order it was acknowledged to the caller. A publish the server's permissions
refuse (the wrong role's credentials) raises ``PublishForbidden``: retries and the outbox
cannot help it.

An append may state what it expects (``expect``, an ``Expectation``: the last stream sequence
on the session's subjects as the caller knows it); JetStream refuses it when that is stale, and
``AppendRefused`` says so at once, never retried nor spooled (the caller must catch up). A
retry after a lost ack is refused too when the first try had landed (the expectation is checked
before the Msg-Id's de-duplication): the publisher then looks for its Msg-Id after the expected
sequence and, found, answers the stored event's receipt (``duplicate``) instead. An
expectation can only be checked by the log at the moment of the append, so an expected append
is never spooled either: with the outbox holding events, or the log not answering, it raises
``EventLogUnavailable`` and stores nothing.

``publish_many`` pipelines: it sends a window of events (bounded by in-flight bytes) before
waiting for their acks, and sends the stragglers through the retry path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import msgspec
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from eventlog.config import PublisherSettings
from eventlog.connection import closed_socket_as_reset
from eventlog.errors import AppendRefused, LogStoreFull, PublishForbidden
from eventlog.expectation import Expectation, refusal
from eventlog.outbox import Outbox, OutboxRecord
from eventlog.reader import read_subjects_after
from schemas.codec import Codec
from schemas.errors import EventLogError, EventLogUnavailable, OutboxFull, PayloadTooLarge
from schemas.events import Event
from schemas.routing import route

__all__ = ["JetStreamPublisher", "PublishReceipt", "Publisher", "PublisherStats"]

log = logging.getLogger(__name__)

_MSG_ID = "Nats-Msg-Id"


@dataclass(frozen=True)
class PublishReceipt:
    """Where an event landed: a stream sequence, or the outbox (``spooled``)."""

    msg_id: str
    stream: str | None = None
    seq: int | None = None
    duplicate: bool = False
    spooled: bool = False


class Publisher(Protocol):
    """The port the gateway and the workers publish through."""

    async def publish(
        self, event: Event, *, expect: Expectation | None = None
    ) -> PublishReceipt: ...

    async def publish_many(self, events: Sequence[Event]) -> list[PublishReceipt]: ...

    async def publish_raw(
        self, subject: str, payload: bytes, msg_id: str, *, expect: Expectation | None = None
    ) -> PublishReceipt: ...


@dataclass
class PublisherStats:
    published: int = 0  # acknowledged by JetStream (duplicates included)
    duplicates: int = 0  # acknowledged as already stored (a retry that had landed)
    retried: int = 0  # extra tries after a missing or failed ack
    spooled: int = 0  # appended to the outbox
    drained: int = 0  # outbox records acknowledged by JetStream
    failed: int = 0  # raised to the caller: nothing stored, the caller must answer an error
    refused: int = 0  # expected appends the log refused (stale expectation; failed too)


class _PubAck(msgspec.Struct):
    stream: str = ""
    seq: int = 0
    duplicate: bool = False
    error: dict[str, object] | None = None


class _Transient(Exception):
    """One try failed in a way a later try may not; ``store_full``: JetStream refused it for
    want of storage (``STORE_FULL_CODES``)."""

    def __init__(self, message: str, *, store_full: bool = False) -> None:
        super().__init__(message)
        self.store_full = store_full


# JetStream's answers when its store has no room: 10023 "insufficient resources" (the server's
# or account's max_file_store reached; code 503), 10047 "insufficient storage resources
# available" (code 500). Both pass once space returns: transient, not a refusal of the event.
STORE_FULL_CODES = frozenset({10023, 10047})


_ack_decoder = msgspec.json.Decoder(_PubAck)


class JetStreamPublisher:
    """The Publisher over a nats-py connection. Call ``start()`` before use, ``close()`` after."""

    def __init__(
        self,
        nc: NATS,
        settings: PublisherSettings | None = None,
        codec: Codec | None = None,
        outbox: Outbox | None = None,
    ) -> None:
        self._nc = nc
        self.settings = settings or PublisherSettings()
        self.codec = codec or Codec()
        self.outbox = outbox
        self.stats = PublisherStats()
        self._inbox = ""
        self._waiting: dict[str, asyncio.Future[bytes]] = {}
        self._next_token = 0
        self._outbox_lock = asyncio.Lock()
        self._drain_lock = asyncio.Lock()
        self._kick = asyncio.Event()
        self._drainer: asyncio.Task[None] | None = None
        self._sub: object | None = None
        self._closing = False

    async def start(self) -> JetStreamPublisher:
        self._inbox = self._nc.new_inbox()
        self._sub = await self._nc.subscribe(f"{self._inbox}.*", cb=self._on_ack)
        if self.outbox is not None:
            self._drainer = asyncio.create_task(self._drain_loop(), name="outbox-drain")
        return self

    async def close(self) -> None:
        self._closing = True
        if self._drainer is not None:
            self._drainer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._drainer
            self._drainer = None
        if self._sub is not None:
            # unsubscribe() flushes, which waits for a reconnect while the server is down.
            with contextlib.suppress(nats.errors.Error, TimeoutError):
                async with asyncio.timeout(1.0):
                    await self._sub.unsubscribe()  # type: ignore[attr-defined]
            self._sub = None

    # -- acks -------------------------------------------------------------------------------

    async def _on_ack(self, msg: Msg) -> None:
        future = self._waiting.pop(msg.subject[len(self._inbox) + 1 :], None)
        if future is not None and not future.done():
            future.set_result(msg.data)

    async def _send(
        self, subject: str, payload: bytes, msg_id: str, expect: Expectation | None = None
    ) -> asyncio.Future[bytes]:
        """Publish once with a reply subject; the future gets the raw ack."""
        headers = {_MSG_ID: msg_id}
        if expect is not None:
            headers.update(expect.headers())
        self._next_token += 1
        token = str(self._next_token)
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._waiting[token] = future
        try:
            with closed_socket_as_reset():
                await self._nc.publish(
                    subject, payload, reply=f"{self._inbox}.{token}", headers=headers
                )
        except nats.errors.MaxPayloadError as exc:
            self._waiting.pop(token, None)
            raise PayloadTooLarge(msg_id, len(payload), self._nc.max_payload) from exc
        except (nats.errors.Error, OSError) as exc:  # closed, reconnecting with a full buffer
            self._waiting.pop(token, None)
            future.set_exception(_Transient(f"{type(exc).__name__}: {exc}"))
        return future

    def _receipt(
        self,
        msg_id: str,
        raw: bytes,
        expect: Expectation | None = None,
        after_retry: bool = False,
    ) -> PublishReceipt:
        ack = _ack_decoder.decode(raw) if raw else _PubAck(error={"description": "no responders"})
        if ack.error is not None:
            code = ack.error.get("code")
            text = f"JetStream error {code}: {ack.error.get('description')}"
            if ack.error.get("err_code") in STORE_FULL_CODES:
                raise _Transient(f"{text} (err_code {ack.error['err_code']})", store_full=True)
            if code == 503 or not raw:  # JetStream recovering / no stream listening yet
                raise _Transient(text)
            if expect is not None:
                refused = refusal(ack.error, msg_id, expect, after_retry=after_retry)
                if refused is not None:  # a stale expectation: the caller must catch up
                    raise refused
            raise EventLogError(f"publish of {msg_id} refused: {text}")
        self.stats.published += 1
        self.stats.duplicates += ack.duplicate
        return PublishReceipt(msg_id, ack.stream, ack.seq, ack.duplicate)

    async def _await_ack(
        self,
        future: asyncio.Future[bytes],
        subject: str,
        msg_id: str,
        expect: Expectation | None = None,
        after_retry: bool = False,
    ) -> PublishReceipt:
        try:
            async with asyncio.timeout(self.settings.ack_timeout_s):
                raw = await future
        except TimeoutError as exc:
            self._raise_if_forbidden(subject, msg_id)
            raise _Transient(f"no ack within {self.settings.ack_timeout_s}s") from exc
        return self._receipt(msg_id, raw, expect, after_retry)

    def _raise_if_forbidden(self, subject: str, msg_id: str) -> None:
        """A publish the server's permissions refuse gets no ack: the refusal comes as an
        error on the connection (nats-py keeps it as ``last_error``). Retrying cannot help."""
        error = str(self._nc.last_error or "").lower()
        if "permissions violation" in error and f'publish to "{subject.lower()}"' in error:
            raise PublishForbidden(
                f"the log refused {msg_id} on {subject}: {self._nc.last_error}; the role of "
                f"this process's credentials may not publish there (see "
                f"eventlog.server.permissions for what each role may do, and use the role meant "
                f"for this service)"
            )

    async def _publish_with_retry(
        self, subject: str, payload: bytes, msg_id: str, expect: Expectation | None = None
    ) -> PublishReceipt:
        s = self.settings
        last = _Transient("")
        for attempt in range(s.max_attempts):
            if attempt:
                self.stats.retried += 1
                await asyncio.sleep(min(s.backoff_initial_s * 2 ** (attempt - 1), s.backoff_max_s))
            try:
                sent = await self._send(subject, payload, msg_id, expect)
                # A refusal after a try without an ack may be that try's own landing: the
                # expectation is checked before the Msg-Id's de-duplication (AppendRefused).
                return await self._await_ack(sent, subject, msg_id, expect, attempt > 0)
            except _Transient as exc:
                last = exc
        if last.store_full:
            raise LogStoreFull(
                f"the log's store is full: JetStream did not store {msg_id} on {subject} after "
                f"{s.max_attempts} tries ({last}); free disk space where nats-server keeps its "
                f"store, or raise its jetstream max_file_store; it was not stored: retry later"
            )
        raise EventLogUnavailable(
            f"JetStream did not acknowledge {msg_id} on {subject} after {s.max_attempts} tries "
            f"({last}); is nats-server up, answering, with room on its store's disk (a full "
            f"disk leaves publishes unanswered until nats-server restarts), and the stream "
            f"provisioned (`turnstream provision`)?"
        )

    # -- public -----------------------------------------------------------------------------

    async def publish(self, event: Event, *, expect: Expectation | None = None) -> PublishReceipt:
        """Publish ``event``; returns once JetStream (or the outbox) holds it durably.

        With ``expect``, JetStream stores it only if the last message on ``expect.subjects`` is
        still at ``expect.last_seq``; else ``AppendRefused`` (carrying the actual last
        sequence), at once. An expected append is never spooled: while the outbox holds events
        (this one would land behind them, unchecked) or when the log does not answer, it raises
        ``EventLogUnavailable`` and nothing is stored (the gateway answers 503).
        """
        subject, msg_id = route(event)
        return await self.publish_raw(subject, self.codec.encode(event), msg_id, expect=expect)

    async def publish_raw(
        self, subject: str, payload: bytes, msg_id: str, *, expect: Expectation | None = None
    ) -> PublishReceipt:
        if expect is not None:
            return await self._publish_expected(subject, payload, msg_id, expect)
        if self.outbox is not None and self.outbox.pending_bytes:
            return await self._spool(subject, payload, msg_id)  # keep order behind the backlog
        try:
            return await self._publish_with_retry(subject, payload, msg_id)
        except EventLogUnavailable:
            if self.outbox is None:
                self.stats.failed += 1
                raise
            return await self._spool(subject, payload, msg_id)
        except EventLogError:
            self.stats.failed += 1
            raise

    async def _publish_expected(
        self, subject: str, payload: bytes, msg_id: str, expect: Expectation
    ) -> PublishReceipt:
        if self.outbox is not None and self.outbox.pending_bytes:
            self.stats.failed += 1
            raise EventLogUnavailable(
                f"{msg_id} expects the last message on {expect.subjects} at stream sequence "
                f"{expect.last_seq}, which only the log can check, and the outbox still holds "
                f"events the log has not taken; not spooled, try again once it has drained"
            )
        try:
            return await self._publish_with_retry(subject, payload, msg_id, expect)
        except AppendRefused as refused:
            if refused.after_retry:
                try:
                    landed = await self._landed(msg_id, expect)
                except EventLogUnavailable as exc:  # the refusal stands, after_retry says why
                    log.warning("cannot tell whether %s landed before its refusal: %s", msg_id, exc)
                    landed = None
                if landed is not None:
                    return landed
            self.stats.refused += 1
            self.stats.failed += 1
            raise
        except EventLogError:  # EventLogUnavailable included: an expectation is not spooled
            self.stats.failed += 1
            raise

    async def _landed(self, msg_id: str, expect: Expectation) -> PublishReceipt | None:
        """The receipt of ``msg_id`` if it is stored on ``expect.subjects`` after
        ``expect.last_seq``: a try whose ack was lost had landed, and the retry was refused
        because the expectation is checked before the Msg-Id's de-duplication. None: it was not
        stored (another append moved the sequence); the refusal stands."""
        stored = await read_subjects_after(
            self._nc.jetstream(), expect.stream, expect.subjects, expect.last_seq
        )
        for message in stored:
            if message.msg_id == msg_id:
                self.stats.published += 1
                self.stats.duplicates += 1
                return PublishReceipt(msg_id, expect.stream, message.seq, duplicate=True)
        return None

    async def publish_many(self, events: Sequence[Event]) -> list[PublishReceipt]:
        """Publish ``events`` pipelined; same guarantees as ``publish`` for each."""
        routed = [(*route(e), self.codec.encode(e)) for e in events]
        return await self.publish_many_raw([(s, p, m) for s, m, p in routed])

    async def publish_many_raw(
        self, items: Sequence[tuple[str, bytes, str]]
    ) -> list[PublishReceipt]:
        """Pipelined ``publish_raw`` of (subject, payload, msg_id) items.

        Keeps up to ``max_inflight_bytes`` unacknowledged (always at least one event), freeing
        budget as each ack arrives; an event without an ack by its deadline goes through the
        retry path (same Msg-Id) once the window is collected.
        """
        if self.outbox is not None and self.outbox.pending_bytes:
            return [await self.publish_raw(*item) for item in items]  # stay behind the backlog
        budget = self.settings.max_inflight_bytes
        timeout = self.settings.ack_timeout_s
        loop = asyncio.get_running_loop()
        inflight = 0
        freed = asyncio.Event()
        sent: list[tuple[asyncio.Future[bytes], float]] = []

        def release(size: int) -> Callable[[asyncio.Future[bytes]], None]:
            def done(_: asyncio.Future[bytes]) -> None:
                nonlocal inflight
                inflight -= size
                freed.set()

            return done

        for subject, payload, msg_id in items:
            while inflight and inflight + len(payload) > budget:
                freed.clear()
                oldest = next((f, d) for f, d in sent if not f.done())
                try:
                    async with asyncio.timeout_at(oldest[1]):
                        await freed.wait()
                except TimeoutError:
                    oldest[0].cancel()  # past its deadline: collected below, then retried
            future = await self._send(subject, payload, msg_id)
            inflight += len(payload)
            future.add_done_callback(release(len(payload)))
            sent.append((future, loop.time() + timeout))

        receipts: list[PublishReceipt] = []
        for (future, deadline), (subject, payload, msg_id) in zip(sent, items, strict=True):
            if not future.done():
                await asyncio.wait([future], timeout=max(deadline - loop.time(), 0))
            try:
                if not future.done() or future.cancelled():
                    raise _Transient("no ack within the pipelined deadline")
                receipts.append(self._receipt(msg_id, future.result()))
            except _Transient:
                future.cancel()
                self.stats.retried += 1
                receipts.append(await self.publish_raw(subject, payload, msg_id))
        return receipts

    # -- outbox -----------------------------------------------------------------------------

    async def _spool(self, subject: str, payload: bytes, msg_id: str) -> PublishReceipt:
        assert self.outbox is not None
        async with self._outbox_lock:
            try:
                await asyncio.to_thread(self.outbox.append, OutboxRecord(subject, msg_id, payload))
            except OutboxFull:
                self.stats.failed += 1
                raise
        self.stats.spooled += 1
        self._kick.set()
        log.warning("log unavailable: spooled %s to the outbox", msg_id)
        return PublishReceipt(msg_id, spooled=True)

    async def drain_outbox(self) -> int:
        """Publish spooled events in order; returns how many were acknowledged.

        Stops (raising EventLogUnavailable) at the first event the log still does not take;
        the next call resumes there.
        """
        outbox = self.outbox
        if outbox is None:
            return 0
        drained = 0
        async with self._drain_lock:
            while True:
                records = await asyncio.to_thread(lambda: list(outbox.pending()))
                for offset, record in records:
                    await self._publish_with_retry(record.subject, record.payload, record.msg_id)
                    outbox.advance(offset)
                    drained += 1
                    self.stats.drained += 1
                async with self._outbox_lock:
                    if outbox.reset_if_drained():
                        break
        if drained:
            log.info("outbox drained: %d events published", drained)
        return drained

    async def _drain_loop(self) -> None:
        assert self.outbox is not None
        while not self._closing:
            # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancel that arrives
            # as the wait completes, and close() would then wait on this loop forever.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.settings.outbox_drain_interval_s):
                    await self._kick.wait()
            self._kick.clear()
            if not self.outbox.pending_bytes:
                continue
            try:
                await self.drain_outbox()
            except EventLogUnavailable as exc:
                log.info("outbox drain waits for the log: %s", exc)
            except EventLogError:
                log.exception("outbox drain stopped on an event the log refuses")
