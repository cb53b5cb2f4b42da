"""A turn from any API surface, answered whole or streamed (the serving half of the turn core).

Each API adapter (Chat Completions, Anthropic Messages, OpenAI Responses) translates its request
into a ``TurnRequest`` and the ``TurnResult`` back into its response; a streamed reply is the
same token loop with the adapter's ``StreamEncoder`` writing the events. A streamed turn sends
text as it is generated; its closing events (tool calls, finish reason, usage) follow JetStream's
ack of the turn, and a failed publish ends the stream with the API's error event instead.

A request equal to the request of a kept turn that no later turn continued (a conversation's
tip: ``gateway.core.branches.resent_turn``) is a client's retry: it gets the recorded turn
again, whole or streamed, and adds no turn.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Protocol

from gateway.backends.interface import needs_processed_logprobs
from gateway.core.branches import resent_turn
from gateway.core.conversation import TurnRequest
from gateway.core.session_store import Session, SessionStore
from gateway.decoding import Detokenizer
from gateway.errors import InvalidRequest
from gateway.serving.engine import TurnEngine, sampling_record
from gateway.serving.turn_data import Turn, TurnResult

__all__ = ["StreamEncoder", "TurnServing", "TurnStream", "named_tool_choice"]


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


MakeEncoder = Callable[[int, int], StreamEncoder]  # (turn index, prompt tokens) -> encoder


class TurnStream:
    """The SSE events of one streamed turn, owning the session's lock and a hold on it.

    The generator gives both back when it ends; ``release_if_unstarted`` (run by the response
    once it is done) gives them back when the client left before the first event was pulled,
    where the generator's ``finally`` never runs and the session would stay locked."""

    def __init__(
        self,
        chunks: Callable[[Callable[[], None], Callable[[], None]], AsyncIterator[bytes]],
        session: Session,
        release_hold: Callable[[], None],
    ) -> None:
        self._started = False
        self._session = session
        self._release_hold = release_hold
        self._chunks = chunks(self._mark_started, self._release)

    def _mark_started(self) -> None:
        self._started = True

    def _release(self) -> None:
        if self._session.lock.locked():
            self._session.lock.release()
        self._release_hold()

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._chunks

    async def release_if_unstarted(self) -> None:
        if not self._started:
            self._release()


class TurnServing:
    def __init__(self, engine: TurnEngine, store: SessionStore) -> None:
        self.engine = engine
        self.store = store

    async def prepare(self, session: Session, req: TurnRequest) -> Turn:
        engine = self.engine
        use_tools = bool(req.tools) and req.tool_choice != "none"
        tools = req.tools if use_tools else None
        named = named_tool_choice(req)
        chat = await engine.chat_prompt(session, req.messages, tools, req.keys)
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
        )

    def _resent(self, session: Session, req: TurnRequest) -> TurnResult | None:
        tools = req.tools if req.tools and req.tool_choice != "none" else None
        event = resent_turn(session.state, req.messages, tools, req.record, req.keys)
        if event is None:
            return None
        self.engine.metrics.resent.labels(req.api).inc()
        return self.engine.recorded(event, tools_parsed=tools is not None)

    async def complete(self, session: Session, req: TurnRequest) -> TurnResult:
        async with session.lock:
            session.ensure_open()
            recorded = self._resent(session, req)
            if recorded is not None:
                return recorded
            turn = await self.prepare(session, req)
            return await self.engine.run(turn)

    async def stream(self, session: Session, req: TurnRequest, encoder: MakeEncoder) -> TurnStream:
        """Validate and prepare the turn now (errors get their status code), then return the
        SSE stream, which holds the session (lock and hold) until it ends."""
        release_hold = self.store.hold(session)
        await session.lock.acquire()
        try:
            session.ensure_open()
            recorded = self._resent(session, req)
            turn = None if recorded is not None else await self.prepare(session, req)
        except BaseException:
            session.lock.release()
            release_hold()
            raise
        if recorded is not None:
            replay = recorded
            return TurnStream(
                lambda started, release: self._replayed(replay, encoder, started, release),
                session,
                release_hold,
            )
        assert turn is not None
        live = turn
        return TurnStream(
            lambda started, release: self._chunks(live, encoder, started, release),
            session,
            release_hold,
        )

    async def _replayed(
        self,
        result: TurnResult,
        make_encoder: MakeEncoder,
        started: Callable[[], None],
        release: Callable[[], None],
    ) -> AsyncIterator[bytes]:
        started()
        try:
            encoder = make_encoder(result.index, result.prompt_tokens)
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

    async def _chunks(
        self,
        turn: Turn,
        make_encoder: MakeEncoder,
        started: Callable[[], None],
        release: Callable[[], None],
    ) -> AsyncIterator[bytes]:
        engine = self.engine
        started()
        try:
            encoder = make_encoder(turn.index, len(turn.prompt))
            gen = engine.generation(turn)
            detok = gen.detok
            yield encoder.opening()
            sent, sent_tokens = 0, 0
            try:
                async for _ in engine.tokens(turn, gen):
                    limit = None
                    if turn.parse_tools:  # hold back what may still turn out to be a tool call
                        forced = turn.forced_text
                        safe = engine.parser.content_safe_prefix_len(forced + detok.text)
                        limit = max(safe - len(forced), 0)
                    text = detok.streamable(limit)
                    if len(text) > sent:
                        yield encoder.text(text[sent:], detok, range(sent_tokens, len(detok.ids)))
                        sent, sent_tokens = len(text), len(detok.ids)
            except Exception as exc:
                # The status line is gone: the backend's failure ends the stream as an error
                # event, and the turn, which the client never got whole, is not recorded.
                yield encoder.failure(exc)
                return
            try:
                result = await engine.finish(turn, gen)
            except Exception as exc:
                yield encoder.failure(exc)
                return
            content = result.content or ""
            rest = content[sent:] if content.startswith(detok.text[:sent]) else ""
            yield encoder.closing(result, rest, detok, range(sent_tokens, len(detok.ids)))
        finally:
            release()


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
