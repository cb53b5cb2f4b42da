"""Chat Completions: a turn from a chat request, answered whole or streamed.

A streamed turn sends tokens as they are generated; its final chunks (finish_reason, usage) and
``[DONE]`` follow JetStream's ack of the turn, and a failed publish ends the stream with an
error event instead.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from gateway.decoding import Detokenizer
from gateway.protocol.chat import (
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Choice,
    ChoiceLogprobs,
    ChunkChoice,
    Delta,
    DeltaToolCall,
    NamedToolChoice,
    TokenLogprob,
    ToolCallFunction,
    ToolCallOut,
    TopLogprobOut,
    message_text,
)
from gateway.protocol.common import Usage
from gateway.serving.engine import Turn, TurnEngine, TurnResult, sampling_record
from gateway.sessions import Session, SessionStore
from gateway.sse import DONE, sse, sse_error

__all__ = ["ChatServing", "ChatStream", "usage"]

JSON = dict[str, Any]


def usage(result: TurnResult) -> Usage:
    prompt, completion = result.usage
    return Usage.build(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )


class ChatStream:
    """The SSE chunks of one streamed turn, owning the session's lock and a hold on it.

    The generator gives both back when it ends; ``release_if_unstarted`` (run by the response
    once it is done) gives them back when the client left before the first chunk was pulled,
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


class ChatServing:
    def __init__(self, engine: TurnEngine, store: SessionStore) -> None:
        self.engine = engine
        self.store = store

    async def prepare(self, session: Session, req: ChatCompletionRequest) -> Turn:
        engine = self.engine
        messages = [
            {**m.model_dump(exclude_none=True), "content": message_text(m.content)}
            for m in req.messages
        ]
        use_tools = bool(req.tools) and req.tool_choice != "none"
        tools = req.raw_tools if use_tools else None
        prompt_ids = await engine.chat_prompt(session.state, messages, tools)
        # "required" / a named function: open the call in the prompt, so the model cannot
        # decline it; these tokens are the gateway's: prompt tokens, not the policy's actions.
        forced = ""
        named = req.tool_choice if isinstance(req.tool_choice, NamedToolChoice) else None
        if use_tools and req.tool_choice == "required":
            forced = engine.parser.forced_prefix(None)
        elif use_tools and named is not None:
            forced = engine.parser.forced_prefix(named.function.name)
        if forced:
            prompt_ids += engine.template.encode(forced)
        top = req.top_logprobs or 0
        params = engine.params(
            session, len(prompt_ids), req.token_budget, req.temperature, req.top_p, req.seed, top
        )
        tool_choice = named.model_dump() if named is not None else req.tool_choice
        return Turn(
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
            sampling_record(params, req.stop_strings, tool_choice, req.token_budget),
            forced,
        )

    async def complete(self, session: Session, req: ChatCompletionRequest) -> ChatCompletion:
        async with session.lock:
            session.ensure_open()
            turn = await self.prepare(session, req)
            result = await self.engine.run(turn)
        message = AssistantMessage.build(
            content=result.content, tool_calls=_tool_calls(result) or None
        )
        choice = Choice.build(
            message=message,
            finish_reason=result.finish_reason,
            logprobs=self._logprobs(result.detok, 0, len(result.completion_ids), turn)
            if turn.logprobs
            else None,
        )
        return ChatCompletion.build(
            id=result.completion_id,
            created=int(time.time()),
            model=self.engine.model_name,
            choices=[choice],
            usage=usage(result),
        )

    async def stream(self, session: Session, req: ChatCompletionRequest) -> ChatStream:
        """Validate and prepare the turn now (errors get their status code), then return the
        SSE stream, which holds the session (lock and hold) until it ends."""
        release_hold = self.store.hold(session)
        await session.lock.acquire()
        try:
            session.ensure_open()
            turn = await self.prepare(session, req)
        except BaseException:
            session.lock.release()
            release_hold()
            raise
        return ChatStream(
            lambda started, release: self._chunks(turn, req, started, release),
            session,
            release_hold,
        )

    async def _chunks(
        self,
        turn: Turn,
        req: ChatCompletionRequest,
        started: Callable[[], None],
        release: Callable[[], None],
    ) -> AsyncIterator[bytes]:
        engine = self.engine
        started()
        try:
            detok = Detokenizer(engine.template.decode, turn.stop_strings)
            created = int(time.time())
            cid = f"chatcmpl-{turn.session.state.id}-{turn.index}"

            def chunk(
                delta: Delta, finish: str | None = None, logprobs: ChoiceLogprobs | None = None
            ) -> bytes:
                choice = ChunkChoice.build(delta=delta, finish_reason=finish, logprobs=logprobs)
                return sse(
                    ChatCompletionChunk.build(
                        id=cid, created=created, model=engine.model_name, choices=[choice]
                    )
                )

            yield chunk(Delta.build(role="assistant", content=""))
            sent, sent_tokens, ttft = 0, 0, None
            try:
                async for _ in engine.tokens(turn, detok):
                    ttft = ttft or time.perf_counter()
                    limit = None
                    if turn.parse_tools:  # hold back what may still turn out to be a tool call
                        forced = turn.forced_text
                        safe = engine.parser.content_safe_prefix_len(forced + detok.text)
                        limit = max(safe - len(forced), 0)
                    text = detok.streamable(limit)
                    if len(text) > sent:
                        lp = (
                            self._logprobs(detok, sent_tokens, len(detok.ids), turn)
                            if turn.logprobs
                            else None
                        )
                        yield chunk(Delta.build(content=text[sent:]), logprobs=lp)
                        sent, sent_tokens = len(text), len(detok.ids)
            except Exception as exc:
                # The status line is gone: the backend's failure ends the stream as an error
                # event, and the turn, which the client never got whole, is not recorded.
                yield sse_error(exc)
                return
            try:
                result = await engine.finish(turn, detok, ttft)
            except Exception as exc:
                yield sse_error(exc)
                return
            content = result.content or ""
            rest = content[sent:] if content.startswith(detok.text[:sent]) else ""
            if rest or (turn.logprobs and sent_tokens < len(detok.ids)):
                lp = (
                    self._logprobs(detok, sent_tokens, len(detok.ids), turn)
                    if turn.logprobs
                    else None
                )
                yield chunk(Delta.build(content=rest), logprobs=lp)
            if result.tool_calls:
                calls = [
                    DeltaToolCall.build(index=i, id=c.id, function=c.function)
                    for i, c in enumerate(_tool_calls(result))
                ]
                yield chunk(Delta.build(tool_calls=calls))
            yield chunk(Delta.build(), result.finish_reason)
            if req.include_usage:
                yield sse(
                    ChatCompletionChunk.build(
                        id=cid,
                        created=created,
                        model=engine.model_name,
                        choices=[],
                        usage=usage(result),
                    )
                )
            yield DONE
        finally:
            release()

    def _logprobs(self, detok: Detokenizer, start: int, end: int, turn: Turn) -> ChoiceLogprobs:
        decode = self.engine.template.decode
        entries = []
        for i in range(start, end):
            token = decode([detok.ids[i]], skip_special_tokens=False)
            tops = []
            for alt in detok.top_logprobs[i][: turn.top_logprobs]:
                text = decode([alt.token_id], skip_special_tokens=False)
                tops.append(
                    TopLogprobOut.build(token=text, logprob=alt.logprob, bytes=list(text.encode()))
                )
            entries.append(
                TokenLogprob.build(
                    token=token,
                    logprob=detok.logprobs[i],
                    bytes=list(token.encode()),
                    top_logprobs=tops,
                )
            )
        return ChoiceLogprobs.build(content=entries)


def _tool_calls(result: TurnResult) -> list[ToolCallOut]:
    return [
        ToolCallOut.build(
            id=c["id"],
            function=ToolCallFunction.build(
                name=c["function"]["name"], arguments=c["function"]["arguments"]
            ),
        )
        for c in result.tool_calls
    ]
