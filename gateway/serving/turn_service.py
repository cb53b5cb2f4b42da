"""A turn from any API surface, answered whole or streamed (the serving half of the turn core).

Each API adapter (Chat Completions, Anthropic Messages, OpenAI Responses) translates its request
into a ``TurnRequest`` and the ``TurnResult`` back into its response; a streamed reply is the
same generation with the adapter's ``StreamEncoder`` writing the events. A streamed turn sends
text as it is generated; its closing events (tool calls, finish reason, usage) follow JetStream's
ack of the turn, and a failed publish ends the stream with the API's error event instead.

Turns of one session are served concurrently (DESIGN §4): nothing here holds the session while a
turn generates; ``TurnEngine.finish`` appends under the session's lock.

The log decides, not this gateway's memory (DESIGN §4): the append states the session's last
sequence as known here and is refused if another gateway (or the reaper) stored something since.
So that the prompt is right the first time, token for token, the session first catches up on the
log (one read of what follows its sequence: ``SessionStore.catch_up``) where its copy may not be
enough: it has not heard from the log about the session for ``SessionLog.idle_sync_s`` (a close
elsewhere is then a 409 before anything is generated), or the request may continue a turn this
copy lacks (``Placement.unsure``: a reply it does not know among the messages, a sub-agent new
here). With affinity (one gateway per session) neither happens while an agent is busy.

A request equal to the request of a kept turn of the same agent that no later turn continued
(a conversation's tip: ``gateway.core.branches.resent_turn``) is a client's retry: it gets the
recorded turn again, whole or streamed, and adds no turn. A retry that arrives while its
original is still generating (a client that timed out) waits for it and gets its answer
(``gateway.core.session_store.Flight``); if the original fails, the retry runs itself. Two
agents' identical requests are two turns.

A streamed turn generates in its own task (``TurnEngine.detach``), which the SSE stream only
watches: a client that goes away (Starlette cancels the response on ``http.disconnect``) leaves
the turn running, and it is appended when the backend finishes it, flagged ``client_gone``.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol

from gateway.backends.interface import needs_processed_logprobs
from gateway.core.branches import resent_turn
from gateway.core.conversation import TurnRequest
from gateway.core.session_store import Asked, Flight, Session, SessionStore
from gateway.decoding import Detokenizer
from gateway.errors import InvalidRequest
from gateway.serving.engine import TurnEngine, sampling_record
from gateway.serving.turn_data import Generation, Turn, TurnResult

__all__ = ["StreamEncoder", "TurnServing", "TurnStream", "named_tool_choice"]

log = logging.getLogger(__name__)


class StreamEncoder(Protocol):
    """How one API writes a streamed turn as server-sent events."""

    def opening(self) -> bytes:
        """The events before the first text (the role, message start, response created)."""
        ...

    def text(self, delta: str, detok: Detokenizer, tokens: range) -> bytes:
        """New content text; ``tokens`` are the completion tokens it covers (for logprobs)."""
        ...

    def closing(self, result: TurnResult, rest: str, detok: Detokenizer, tokens: range) -> bytes:
        """After the turn is durable: the content not yet sent (``rest``, covering ``tokens``),
        the tool calls, the finish reason, usage and the end of the stream."""
        ...

    def failure(self, exc: BaseException) -> bytes:
        """An error after the stream started (its status line is gone)."""
        ...


MakeEncoder = Callable[[str, int], StreamEncoder]  # (reply id, prompt tokens) -> encoder


class TurnStream:
    """The SSE events of one streamed turn, and what to do once its response is done
    (``ended``, the response's background task): a live turn learns whether its client stayed
    to the end, a replayed one gives its session back (its generator's ``finally`` does not run
    where the client left before the first event was pulled)."""

    def __init__(self, chunks: AsyncIterator[bytes], ended: Callable[[], None]) -> None:
        self._chunks = chunks
        self._ended = ended

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._chunks

    async def ended(self) -> None:
        self._ended()


@dataclass(eq=False, slots=True)
class _LiveTurn:
    """A streamed turn between its generating task (the producer: it fills ``gen``, marks how
    much of its text may be sent and sets ``progress`` when that grows, then appends) and the
    SSE stream (the consumer: it wakes on ``progress`` and sends the text up to the latest mark,
    however many chunks that covers)."""

    turn: Turn
    gen: Generation
    flight: Flight
    progress: asyncio.Event = field(default_factory=asyncio.Event)
    # The text that may be sent (its length) and the completion tokens it covers.
    chars: int = 0
    tokens: int = 0
    done: bool = False  # appended, or failed
    result: TurnResult | None = None
    error: Exception | None = None
    closed: bool = False  # the stream wrote its closing events
    gone: bool = False  # the client left before the stream's end

    def client_gone(self) -> bool:
        """Asked at the append: the client left and no retry waits for the reply."""
        return self.gone and not self.flight.joined

    def left(self) -> None:
        """The response ended: without its closing events, the client left."""
        if not self.closed:
            self.gone = True


class TurnServing:
    def __init__(self, engine: TurnEngine, store: SessionStore) -> None:
        self.engine = engine
        self.store = store

    async def _sync(self, session: Session, reason: str) -> None:
        """Catch the session up on the log (under its lock)."""
        async with session.lock:
            await self.store.catch_up(session, reason)

    async def _sync_if_idle(self, session: Session) -> None:
        log_ = self.store.log
        if log_ is not None and log_.idle(session):
            await self._sync(session, "idle")

    async def prepare(self, session: Session, req: TurnRequest) -> Turn:
        """The turn, prepared from a snapshot of the session's state (no lock: the state is
        immutable, and the parent chosen here is checked again at the append); where a turn
        this copy lacks could place it otherwise, from the state caught up on the log."""
        engine = self.engine
        use_tools = bool(req.tools) and req.tool_choice != "none"
        tools = req.tools if use_tools else None
        named = named_tool_choice(req)
        seen = session.state  # the snapshot chat_prompt prepares from (read before it awaits)
        chat = await engine.chat_prompt(
            session, req.messages, tools, req.keys, req.agent, req.images
        )
        if chat.unsure and self.store.log is not None:
            await self._sync(session, "unsure")
            # Changed since the snapshot, by this catch-up or by another request's meanwhile
            # (a sibling sub-agent's turn, its catch-up): prepared again from what it is now.
            if session.state is not seen:
                session.ensure_open()
                seen = session.state
                chat = await engine.chat_prompt(
                    session, req.messages, tools, req.keys, req.agent, req.images
                )
        prompt = chat.prompt
        # "required" / a named function: open the call in the prompt, so the model cannot
        # decline it; these tokens are the gateway's: prompt tokens, not the policy's actions.
        forced = ""
        if use_tools and req.tool_choice == "required":
            forced = engine.parser.forced_prefix(None)
        elif use_tools and named is not None:
            forced = engine.parser.forced_prefix(named)
        if forced:
            prompt = prompt.extended(engine.template.encode(forced))
        params = engine.params(
            session,
            len(prompt),
            req.max_tokens,
            req.temperature,
            req.top_p,
            req.seed,
            req.top_logprobs,
        )
        if needs_processed_logprobs(params):
            # Refused now, with its status code, not as an error event after the stream began:
            # a replica whose log-probs would not be the sampled distribution's (issue 19).
            try:
                await engine.backend.admit(params)
            except InvalidRequest as exc:
                raise InvalidRequest(f"session {session.name}: {exc}", param=exc.param) from None
        return Turn(
            session,
            req.api,  # type: ignore[arg-type]  # the adapters pass a Kind
            prompt,
            req.messages,
            tools,
            params,
            list(req.stop),
            use_tools,
            req.logprobs,
            req.top_logprobs,
            sampling_record(params, req.stop, req.tool_choice, req.max_tokens, asked_seed=req.seed),
            forced,
            request=req.record,
            parallel_tool_calls=req.parallel_tool_calls,
            parent=chat.parent,
            prefix_len=chat.prefix_len,
            prompt_text=chat.text,
            keys=req.keys,
            reply_id=secrets.token_hex(6),
            agent=chat.agent,
            known_turns=seen.turns,
        )

    async def _answered(
        self, session: Session, req: TurnRequest, asked: Asked
    ) -> TurnResult | None:
        """The recorded answer of a request its agent sent before (``asked``: what makes it
        that request): a kept tip's (the log's), or that of the same request still in flight,
        awaited (None where it fails: this request then runs itself). None: a new turn."""
        while True:
            session.ensure_open()
            event = resent_turn(
                session.state, req.messages, asked.tools, asked.request, asked.keys, asked.agent
            )
            if event is None:
                flight = session.flight(asked)
                if flight is None:
                    return None
                flight.joined += 1
                try:
                    event = await asyncio.shield(flight.landed)
                finally:
                    flight.joined -= 1
                if event is None:
                    continue  # the original failed: asked again, from the top
            self.engine.metrics.resent.labels(req.api).inc()
            return self.engine.recorded(event, tools_parsed=asked.tools is not None)

    async def complete(self, session: Session, req: TurnRequest) -> TurnResult:
        """A whole turn. A client that leaves meanwhile is not noticed (uvicorn does not cancel
        a request handler on disconnect): the turn is recorded as any other, ``client_gone``
        False, and a retry of it gets it from the log."""
        await self._sync_if_idle(session)
        asked = _asked(req)
        recorded = await self._answered(session, req, asked)
        if recorded is not None:
            return recorded
        flight = session.take_off(asked)  # no await since _answered: no twin slips in
        result = None
        try:
            turn = await self.prepare(session, req)
            result = await self.engine.run(turn)
            return result
        finally:
            session.landed(flight, None if result is None else result.event)

    async def stream(self, session: Session, req: TurnRequest, encoder: MakeEncoder) -> TurnStream:
        """Validate and prepare the turn now (errors get their status code), start its
        generation, and return the SSE stream that watches it. The session is held until the
        turn has appended (or the replay of a recorded one has been sent)."""
        release_hold = self.store.hold(session)
        try:
            await self._sync_if_idle(session)
            asked = _asked(req)
            recorded = await self._answered(session, req, asked)
            if recorded is not None:
                replay = self._replayed(recorded, encoder, release_hold)
                return TurnStream(replay, release_hold)
            flight = session.take_off(asked)
            try:
                turn = await self.prepare(session, req)
            except BaseException:
                session.landed(flight, None)
                raise
        except BaseException:
            release_hold()
            raise
        live = _LiveTurn(turn, self.engine.generation(turn), flight)
        self.engine.detach(self._produce(live, release_hold), f"turn {session.name}")
        return TurnStream(self._chunks(live, encoder), live.left)

    async def _replayed(
        self, result: TurnResult, make_encoder: MakeEncoder, release: Callable[[], None]
    ) -> AsyncIterator[bytes]:
        try:
            encoder = make_encoder(result.reply, result.prompt_tokens)
            yield encoder.opening()
            content, detok = result.content or "", result.detok
            end = len(detok.ids)
            if content:
                yield encoder.text(content, detok, range(0, end))
                yield encoder.closing(result, "", detok, range(end, end))
            else:
                yield encoder.closing(result, "", detok, range(0, end))
        finally:
            release()

    async def _produce(self, live: _LiveTurn, release: Callable[[], None]) -> None:
        """Generate and append a streamed turn, whether or not its client still reads."""
        engine, turn, progress = self.engine, live.turn, live.progress
        parser, detok = engine.parser, live.gen.detok
        try:
            async for _ in engine.tokens(turn, live.gen):
                limit = None
                if turn.parse_tools:  # hold back what may still turn out to be a tool call
                    forced = turn.forced_text
                    safe = parser.content_safe_prefix_len(forced + detok.text)
                    limit = max(safe - len(forced), 0)
                chars = len(detok.streamable(limit))
                if chars > live.chars:
                    live.chars, live.tokens = chars, len(detok.ids)
                    progress.set()
            live.result = await engine.finish(turn, live.gen, live.client_gone)
        except Exception as exc:
            # A backend failure: the turn, which nobody got whole, is not recorded.
            live.error = exc
            if live.gone:
                log.warning(
                    "session %s: a turn whose client had left failed and is not recorded: %s",
                    turn.session.name,
                    exc,
                )
        finally:
            turn.session.landed(live.flight, None if live.result is None else live.result.event)
            live.done = True
            progress.set()
            release()

    async def _chunks(self, live: _LiveTurn, make_encoder: MakeEncoder) -> AsyncIterator[bytes]:
        """The SSE events: the text marked sendable since the last wake, then the closing
        events (never cancels the generation: see ``_LiveTurn.left``)."""
        turn, detok, progress = live.turn, live.gen.detok, live.progress
        try:
            encoder = make_encoder(turn.reply_id, len(turn.prompt))
            yield encoder.opening()
            sent, sent_tokens = 0, 0
            while not live.done:
                await progress.wait()
                progress.clear()
                chars, tokens = live.chars, live.tokens
                if chars > sent:
                    yield encoder.text(detok.text[sent:chars], detok, range(sent_tokens, tokens))
                    sent, sent_tokens = chars, tokens
            result = live.result
            if result is None:
                # The status line is gone: the failure ends the stream as an error event.
                live.closed = True
                yield encoder.failure(live.error or RuntimeError("the turn did not finish"))
                return
            content = result.content or ""
            rest = content[sent:] if content.startswith(detok.text[:sent]) else ""
            live.closed = True
            yield encoder.closing(result, rest, detok, range(sent_tokens, len(detok.ids)))
        finally:
            live.left()  # cancelled (the client went away) or closed before the end


def _asked(req: TurnRequest) -> Asked:
    tools = req.tools if req.tools and req.tool_choice != "none" else None
    return Asked(None if req.agent is None else req.agent.id, req.record, tools, req.keys)


def named_tool_choice(req: TurnRequest) -> str | None:
    """The function a tool_choice names (None: it names none), checked against the tools
    offered; "required" needs tools. The same rule for every API."""
    choice = req.tool_choice
    if choice == "required" and not req.tools:
        raise InvalidRequest(
            "tool_choice 'required' needs tools: send the tools the model must choose from",
            param="tool_choice",
        )
    if not isinstance(choice, dict):
        return None
    name = str((choice.get("function") or {}).get("name", ""))
    offered = [(t.get("function") or {}).get("name") for t in req.tools or ()]
    if name not in offered:
        raise InvalidRequest(
            f"tool_choice names function {name!r}, not among the tools offered {offered}",
            param="tool_choice",
        )
    return name
