"""One turn, from request to durable event to response (the logic behind the routers).

For every chat/completions request on a session: build the prompt ids (extending the previous
turn's tokens when the conversation extends it), generate on the backend, parse tool calls,
publish TurnCompleted and wait for JetStream's ack, and only then finish the response. A
streamed response sends tokens as they are generated; its final chunk (finish_reason, usage)
and ``[DONE]`` follow the ack, and a failed publish ends the stream with an error instead.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from gateway.backends.base import Backend, GenerationChunk, SamplingParams
from gateway.backends.router import ReplicaRouter
from gateway.decoding import Detokenizer
from gateway.errors import ContextLengthExceeded, InvalidRequest, error_body
from gateway.metrics import GatewayMetrics
from gateway.protocol import (
    ChatCompletionRequest,
    CloseSessionRequest,
    CompletionRequest,
    CreateSessionRequest,
    RewardRequest,
    message_text,
)
from gateway.sessions import Session, SessionStore
from gateway.templates import ChatTemplate, message_key
from gateway.tools import ToolCallParser
from schemas import RewardAssigned, SessionClosed, SessionEvent, SessionOpened, TurnCompleted
from schemas.delta import common_message_prefix_len, common_prefix_len
from schemas.ids import new_session_id, validate_id
from schemas.log import Publisher

__all__ = ["ChatService", "ChatStream", "TurnResult"]

log = logging.getLogger(__name__)
JSON = dict[str, Any]
Kind = Literal["chat", "completion"]


@dataclass
class _Turn:
    """A prepared turn: what to send to the backend and what to record."""

    session: Session
    kind: Kind
    prompt_ids: list[int]
    messages: list[JSON]  # the full conversation of this turn (chat); [] for completions
    tools: list[JSON] | None
    params: SamplingParams
    stop_strings: list[str]
    parse_tools: bool
    logprobs: bool
    top_logprobs: int
    sampling: JSON
    forced_text: str = ""  # tool-call opening appended to the prompt to enforce tool_choice
    started: float = field(default_factory=time.perf_counter)
    backend_id: str = ""  # the replica that served the turn
    finish: str = "length"  # set from the backend's last chunk
    sampled_version: int | None = None  # weight_version the backend reported


@dataclass
class TurnResult:
    completion_id: str
    text: str
    content: str | None
    tool_calls: list[JSON]
    finish_reason: str
    completion_ids: list[int]
    detok: Detokenizer
    prompt_tokens: int
    weight_version: int


class ChatStream:
    """The SSE chunks of one streamed turn, owning the session's lock.

    The generator releases the lock when it ends; ``release_if_unstarted`` (run by the
    response once it is done) releases it when the client left before the first chunk was
    pulled, where the generator's ``finally`` never runs and the session would stay locked."""

    def __init__(self, service: ChatService, turn: _Turn, req: ChatCompletionRequest) -> None:
        self._started = False
        self._lock = turn.session.lock
        self._chunks = service._stream_chat(turn, req, self._mark_started)

    def _mark_started(self) -> None:
        self._started = True

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._chunks

    async def release_if_unstarted(self) -> None:
        if not self._started and self._lock.locked():
            self._lock.release()


class ChatService:
    """Sessions and turns of one gateway."""

    def __init__(
        self,
        *,
        template: ChatTemplate,
        backend: Backend,
        publisher: Publisher,
        sessions: SessionStore,
        parser: ToolCallParser,
        run: str,
        model_name: str,
        metrics: GatewayMetrics,
        weight_version: Callable[[], int] = lambda: 0,
        recover: Callable[[str], Awaitable[Sequence[SessionEvent]]] | None = None,
    ) -> None:
        self.template = template
        self.backend = backend
        self.publisher = publisher
        self.sessions = sessions
        self.parser = parser
        self.run = run
        self.model_name = model_name
        self.metrics = metrics
        self.weight_version = weight_version
        self._recover = recover  # reads a session's events from the log

    # -- sessions ---------------------------------------------------------------------------

    async def open_session(self, req: CreateSessionRequest) -> Session:
        session_id = req.session_id or new_session_id()
        existing = await self.find_session(session_id)
        if existing is not None:
            return existing  # idempotent: a client retrying its create gets the same session
        session = Session(req.run or self.run, session_id, req.group, req.metadata)
        await self.publisher.publish(
            SessionOpened(
                run=session.run,
                session=session.id,
                group=session.group,
                metadata=session.metadata,
                model=self.model_name,
                created_at=time.time(),
            )
        )
        return self.sessions.add(session)

    async def find_session(self, session_id: str) -> Session | None:
        """A session held here, else one recovered from its events in the log."""
        # Before it reaches a subject filter, where '*' or '>' would be wildcards.
        validate_id(session_id, "session id")
        session = self.sessions.find(session_id)
        if session is not None or self._recover is None:
            return session
        recovered = Session.from_events(await self._recover(session_id))
        if recovered is None:
            return None
        # Another request may have recovered it while we read the log.
        return self.sessions.find(session_id) or self.sessions.add(recovered)

    async def session(self, session_id: str) -> Session:
        """The session, or SessionNotFound naming what to do."""
        session = await self.find_session(session_id)
        return session if session is not None else self.sessions.get(session_id)

    async def session_from_header(self, session_id: str | None) -> Session:
        if not session_id:
            raise InvalidRequest(
                "an X-Session-Id header is required on /v1/...; or create a session with "
                "POST /v1/sessions and use its base_url",
                param="X-Session-Id",
            )
        session = await self.find_session(session_id)
        if session is None:
            session = await self.open_session(CreateSessionRequest(session_id=session_id))
        return session

    async def reward(self, session: Session, req: RewardRequest) -> JSON:
        async with session.lock:
            session.ensure_open()
            if req.turn is not None and req.turn >= session.next_turn:
                raise InvalidRequest(
                    f"turn {req.turn} of session {session.id} has not happened "
                    f"(turns so far: {session.next_turn})",
                    param="turn",
                )
            receipt = await self.publisher.publish(
                RewardAssigned(
                    run=session.run,
                    session=session.id,
                    value=req.value,
                    turn=req.turn,
                    key=req.key,
                    source=req.source,
                    info=req.info,
                    created_at=time.time(),
                )
            )
        return {"session_id": session.id, "acknowledged": True, "seq": receipt.seq}

    async def close(self, session: Session, req: CloseSessionRequest) -> JSON:
        async with session.lock:
            session.ensure_open()
            await self.publisher.publish(
                SessionClosed(
                    run=session.run,
                    session=session.id,
                    status=req.status,
                    reward=req.reward,
                    num_turns=session.next_turn,
                    created_at=time.time(),
                )
            )
            session.closed, session.status = True, req.status
        if isinstance(self.backend, ReplicaRouter):
            self.backend.forget(session.id)
        return session.describe()

    # -- preparing a turn -------------------------------------------------------------------

    def _chat_prompt(
        self, session: Session, messages: list[JSON], tools: list[JSON] | None
    ) -> list[int]:
        """Extend the previous turn's tokens when the conversation extends it, else render."""
        previous = session.conversation
        if (
            previous
            and tools == session.tools
            and len(messages) > len(previous)
            and [message_key(m) for m in messages[: len(previous)]]
            == [message_key(m) for m in previous]
        ):
            suffix = self.template.continuation_ids(
                previous, session.last_completion_ids, messages[len(previous) :], tools
            )
            if suffix is not None:
                return [*session.context_ids.tolist(), *suffix]
        return self.template.prompt_ids(messages, tools)

    def _params(
        self,
        session: Session,
        prompt_len: int,
        budget: int | None,
        temperature: float | None,
        top_p: float | None,
        seed: int | None,
        top_logprobs: int,
    ) -> SamplingParams:
        room = self.backend.max_context - prompt_len
        if room <= 0 or (budget is not None and budget > room):
            asked = f" + max_tokens {budget}" if budget is not None else ""
            raise ContextLengthExceeded(
                f"session {session.id}: prompt of {prompt_len} tokens{asked} exceeds the model's "
                f"context length of {self.backend.max_context} tokens",
                param="messages",
            )
        return SamplingParams(
            max_tokens=budget or room,
            temperature=1.0 if temperature is None else temperature,
            top_p=1.0 if top_p is None else top_p,
            seed=seed,
            stop_token_ids=self.template.stop_token_ids,
            top_logprobs=top_logprobs,
        )

    def prepare_chat(self, session: Session, req: ChatCompletionRequest) -> _Turn:
        try:
            messages = [
                {**m.model_dump(exclude_none=True), "content": message_text(m.content)}
                for m in req.messages
            ]
        except ValueError as exc:
            raise InvalidRequest(str(exc), param="messages") from exc
        use_tools = bool(req.tools) and req.tool_choice != "none"
        tools = req.tools if use_tools else None
        prompt_ids = self._chat_prompt(session, messages, tools)
        # "required" / a named function: open the call in the prompt, so the model cannot
        # decline it; these tokens are the gateway's: prompt tokens, not the policy's actions.
        forced = ""
        if use_tools and req.tool_choice == "required":
            forced = self.parser.forced_prefix(None)
        elif use_tools and isinstance(req.tool_choice, dict):
            forced = self.parser.forced_prefix(req.tool_choice["function"]["name"])
        if forced:
            prompt_ids += self.template.encode(forced)
        top = req.top_logprobs or 0
        params = self._params(
            session, len(prompt_ids), req.token_budget, req.temperature, req.top_p, req.seed, top
        )
        return _Turn(
            session,
            "chat",
            prompt_ids,
            messages,
            tools,
            params,
            req.stop_strings,
            use_tools,
            req.logprobs,
            top,
            _sampling_record(params, req.stop_strings, req.tool_choice),
            forced,
        )

    def prepare_completion(self, session: Session, req: CompletionRequest) -> _Turn:
        if isinstance(req.prompt, str):
            prompt_ids = self.template.encode(req.prompt)
        else:
            prompt_ids = list(req.prompt)
        top = req.logprobs or 0
        params = self._params(
            session, len(prompt_ids), req.max_tokens, req.temperature, req.top_p, req.seed, top
        )
        return _Turn(
            session,
            "completion",
            prompt_ids,
            [],
            None,
            params,
            req.stop_strings,
            False,
            req.logprobs is not None,
            top,
            _sampling_record(params, req.stop_strings, None),
        )

    # -- running a turn ---------------------------------------------------------------------

    async def _tokens(self, turn: _Turn, detok: Detokenizer) -> AsyncIterator[Detokenizer]:
        """Generate, feeding ``detok``; yields it after every chunk. Stops at a stop string."""
        stream: AsyncIterator[GenerationChunk]
        if isinstance(self.backend, ReplicaRouter):
            # Sticky routing: the replica that served this session holds its prefix in cache.
            turn.backend_id, stream = await self.backend.generate_for(
                turn.session.id, turn.prompt_ids, turn.params
            )
        else:
            turn.backend_id = self.backend.id
            stream = self.backend.generate(turn.prompt_ids, turn.params)
        try:
            async for chunk in stream:
                detok.add(chunk.token_ids, chunk.logprobs, chunk.top_logprobs)
                if chunk.weight_version is not None:
                    turn.sampled_version = chunk.weight_version
                if chunk.finish_reason is not None:
                    turn.finish = chunk.finish_reason
                yield detok
                if detok.stopped:
                    turn.finish = "stop"
                    break
        finally:
            aclose = getattr(stream, "aclose", None)  # stops the generation on the backend
            if aclose is not None:
                await aclose()
            detok.finish()

    def _turn_event(
        self,
        turn: _Turn,
        detok: Detokenizer,
        fields: JSON,
        version: int,
        timing: tuple[float | None, float],
    ) -> TurnCompleted:
        """The turn as an event extending the session's current state (its next index, the
        previous context and conversation, the tools)."""
        session = turn.session
        prefix_len = common_prefix_len(session.context_ids, turn.prompt_ids)
        message_prefix = common_message_prefix_len(
            [message_key(m) for m in session.conversation], [message_key(m) for m in turn.messages]
        )
        ttft, generated = timing
        event = TurnCompleted(
            run=session.run,
            session=session.id,
            turn=session.next_turn,
            created_at=time.time(),
            prefix_len=prefix_len,
            prompt_ids=np.asarray(turn.prompt_ids[prefix_len:], dtype=np.int32),
            completion_ids=np.asarray(detok.ids, dtype=np.int32),
            logprobs=np.asarray(detok.logprobs, dtype=np.float32),
            message_prefix_len=message_prefix,
            new_messages=turn.messages[message_prefix:],
            # None: same tools as the previous turn; [] : tools removed.
            tools=(turn.tools or [])
            if turn.tools != session.tools or session.next_turn == 0
            else None,
            sampling=turn.sampling,
            **fields,
            weight_version=version,
            template_hash=self.template.hash,
            backend=turn.backend_id,
            timings={
                "ttft_ms": round(1000 * ((ttft or generated) - turn.started), 3),
                "generate_ms": round(1000 * (generated - turn.started), 3),
            },
            usage={"prompt_tokens": len(turn.prompt_ids), "completion_tokens": len(detok.ids)},
        )
        return event

    async def _turn_taken(self, session: Session, event: TurnCompleted) -> bool:
        """Whether the log holds another event under ``event``'s turn index (its publish was a
        duplicate of an earlier attempt's); if so ``session`` catches up with the log."""
        if self._recover is None:
            return False
        events = await self._recover(session.id)
        stored = next(
            (e for e in events if isinstance(e, TurnCompleted) and e.turn == event.turn), None
        )
        if stored is None or (
            stored.created_at == event.created_at
            and np.array_equal(stored.completion_ids, event.completion_ids)
        ):
            return False  # ours: a retry of this very publish
        logged = Session.from_events(events)
        if logged is None or logged.next_turn <= event.turn:
            return False
        log.warning(
            "session %s turn %d: the log holds an earlier attempt (answered 503, stored late); "
            "this reply becomes turn %d",
            session.id,
            event.turn,
            logged.next_turn,
        )
        session.catch_up(logged)
        return True

    async def _finish_turn(self, turn: _Turn, detok: Detokenizer, ttft: float | None) -> TurnResult:
        """Parse, publish (awaiting the ack), update the session."""
        session = turn.session
        text = detok.text
        content: str | None = text
        tool_calls: list[JSON] = []
        finish = turn.finish
        if turn.parse_tools:
            parsed = self.parser.parse(turn.forced_text + text)
            content = parsed.content
            tool_calls = [
                {
                    "id": f"call_{secrets.token_hex(12)}",
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in parsed.tool_calls
            ]
            if tool_calls:
                finish = "tool_calls"
        version = turn.sampled_version
        if version is None:
            version = self.weight_version()
        generated = time.perf_counter()
        reply: JSON = {"role": "assistant", "content": content}
        if tool_calls:
            reply["tool_calls"] = tool_calls
        fields = {"text": content or "", "tool_calls": tool_calls, "finish_reason": finish}
        event = self._turn_event(turn, detok, fields, version, (ttft, generated))
        with self.metrics.publish_latency.time():
            receipt = await self.publisher.publish(event)
        while receipt.duplicate and await self._turn_taken(session, event):
            # An earlier attempt at this turn, answered with a 503 (its ack never came), reached
            # the log after all: that index holds tokens the client never received. This reply
            # is the session's next turn instead, so the log holds what the client gets.
            event = self._turn_event(turn, detok, fields, version, (ttft, generated))
            receipt = await self.publisher.publish(event)
        self.metrics.tokens_in.inc(len(turn.prompt_ids))
        self.metrics.tokens_out.inc(len(detok.ids))
        self.metrics.turns.labels(turn.kind).inc()
        session.context_ids = np.asarray([*turn.prompt_ids, *detok.ids], dtype=np.int32)
        session.last_completion_ids = list(detok.ids)
        session.conversation = [*turn.messages, reply] if turn.kind == "chat" else []
        session.tools = turn.tools
        session.next_turn += 1
        session.last_activity = time.monotonic()
        return TurnResult(
            f"{'chatcmpl' if turn.kind == 'chat' else 'cmpl'}-{session.id}-{event.turn}",
            text,
            content,
            tool_calls,
            finish,
            list(detok.ids),
            detok,
            len(turn.prompt_ids),
            version,
        )

    async def run_turn(self, turn: _Turn) -> TurnResult:
        """A whole turn, not streamed; the caller holds the session lock."""
        detok = Detokenizer(self.template.decode, turn.stop_strings)
        ttft = None
        async for _ in self._tokens(turn, detok):
            ttft = ttft or time.perf_counter()
        return await self._finish_turn(turn, detok, ttft)

    async def chat(self, session: Session, req: ChatCompletionRequest) -> JSON:
        async with session.lock:
            session.ensure_open()
            turn = self.prepare_chat(session, req)
            result = await self.run_turn(turn)
        return self._chat_response(turn, result)

    async def complete(self, session: Session, req: CompletionRequest) -> JSON:
        async with session.lock:
            session.ensure_open()
            turn = self.prepare_completion(session, req)
            result = await self.run_turn(turn)
        return self._completion_response(turn, result)

    # -- streaming --------------------------------------------------------------------------

    async def chat_stream(self, session: Session, req: ChatCompletionRequest) -> ChatStream:
        """Validate and prepare the turn now (errors get their status code), then return the
        SSE stream, which holds the session's lock until it ends."""
        await session.lock.acquire()
        try:
            session.ensure_open()
            turn = self.prepare_chat(session, req)
        except BaseException:
            session.lock.release()
            raise
        return ChatStream(self, turn, req)

    async def _stream_chat(
        self, turn: _Turn, req: ChatCompletionRequest, started: Callable[[], None]
    ) -> AsyncIterator[bytes]:
        session = turn.session
        started()
        try:
            detok = Detokenizer(self.template.decode, turn.stop_strings)
            created = int(time.time())
            cid = f"chatcmpl-{session.id}-{session.next_turn}"

            def chunk(
                delta: JSON, finish: str | None = None, logprobs: JSON | None = None
            ) -> bytes:
                choice: JSON = {
                    "index": 0,
                    "delta": delta,
                    "finish_reason": finish,
                    "logprobs": logprobs,
                }
                return _sse(
                    {
                        "id": cid,
                        "object": "chat.completion.chunk",
                        "created": created,
                        "model": self.model_name,
                        "choices": [choice],
                    }
                )

            yield chunk({"role": "assistant", "content": ""})
            sent, sent_tokens, ttft = 0, 0, None
            async for _ in self._tokens(turn, detok):
                ttft = ttft or time.perf_counter()
                limit = None
                if turn.parse_tools:  # hold back what may still turn out to be a tool call
                    forced = turn.forced_text
                    safe = self.parser.content_safe_prefix_len(forced + detok.text)
                    limit = max(safe - len(forced), 0)
                text = detok.streamable(limit)
                if len(text) > sent:
                    lp = (
                        self._logprobs(detok, sent_tokens, len(detok.ids), turn)
                        if turn.logprobs
                        else None
                    )
                    yield chunk({"content": text[sent:]}, logprobs=lp)
                    sent, sent_tokens = len(text), len(detok.ids)
            try:
                result = await self._finish_turn(turn, detok, ttft)
            except Exception as exc:
                yield _sse({"error": error_body(exc)})
                return
            rest = (
                (result.content or "")[sent:]
                if (result.content or "").startswith(detok.text[:sent])
                else ""
            )
            if rest or (turn.logprobs and sent_tokens < len(detok.ids)):
                lp = (
                    self._logprobs(detok, sent_tokens, len(detok.ids), turn)
                    if turn.logprobs
                    else None
                )
                yield chunk({"content": rest}, logprobs=lp)
            if result.tool_calls:
                yield chunk(
                    {
                        "tool_calls": [
                            {"index": i, **call} for i, call in enumerate(result.tool_calls)
                        ]
                    }
                )
            yield chunk({}, result.finish_reason)
            if (req.stream_options or {}).get("include_usage"):
                yield _sse(
                    {
                        "id": cid,
                        "object": "chat.completion.chunk",
                        "created": created,
                        "model": self.model_name,
                        "choices": [],
                        "usage": _usage(result),
                    }
                )
            yield b"data: [DONE]\n\n"
        finally:
            session.lock.release()

    # -- responses --------------------------------------------------------------------------

    def _logprobs(self, detok: Detokenizer, start: int, end: int, turn: _Turn) -> JSON:
        entries = []
        for i in range(start, end):
            token = self.template.decode([detok.ids[i]], skip_special_tokens=False)
            entries.append(
                {
                    "token": token,
                    "logprob": detok.logprobs[i],
                    "bytes": list(token.encode()),
                    "top_logprobs": [
                        {
                            "token": (
                                t := self.template.decode([alt.token_id], skip_special_tokens=False)
                            ),
                            "logprob": alt.logprob,
                            "bytes": list(t.encode()),
                        }
                        for alt in detok.top_logprobs[i][: turn.top_logprobs]
                    ],
                }
            )
        return {"content": entries, "refusal": None}

    def _chat_response(self, turn: _Turn, result: TurnResult) -> JSON:
        message: JSON = {"role": "assistant", "content": result.content, "refusal": None}
        if result.tool_calls:
            message["tool_calls"] = result.tool_calls
        choice: JSON = {
            "index": 0,
            "message": message,
            "finish_reason": result.finish_reason,
            "logprobs": self._logprobs(result.detok, 0, len(result.completion_ids), turn)
            if turn.logprobs
            else None,
        }
        return {
            "id": result.completion_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [choice],
            "usage": _usage(result),
        }

    def _completion_response(self, turn: _Turn, result: TurnResult) -> JSON:
        logprobs = None
        if turn.logprobs:
            tokens = [
                self.template.decode([i], skip_special_tokens=False) for i in result.completion_ids
            ]
            logprobs = {
                "tokens": tokens,
                "token_logprobs": result.detok.logprobs,
                "top_logprobs": [
                    {
                        self.template.decode([a.token_id], skip_special_tokens=False): a.logprob
                        for a in alts[: turn.top_logprobs]
                    }
                    for alts in result.detok.top_logprobs
                ],
                "text_offset": list(np.cumsum([0, *[len(t) for t in tokens[:-1]]]).tolist()),
            }
        choice = {
            "index": 0,
            "text": result.text,
            "finish_reason": result.finish_reason,
            "logprobs": logprobs,
        }
        return {
            "id": result.completion_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [choice],
            "usage": _usage(result),
        }


def _usage(result: TurnResult) -> JSON:
    n = len(result.completion_ids)
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": n,
        "total_tokens": result.prompt_tokens + n,
    }


def _sampling_record(params: SamplingParams, stop: Sequence[str], tool_choice: object) -> JSON:
    record: JSON = {
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
    }
    if params.seed is not None:
        record["seed"] = params.seed
    if stop:
        record["stop"] = list(stop)
    if tool_choice is not None:
        record["tool_choice"] = tool_choice
    return record


def _sse(payload: JSON) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"
