"""Chat Completions over the turn core: the request as a ``TurnRequest``, the result as a
``chat.completion`` or as ``chat.completion.chunk`` events ending in ``[DONE]``."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from typing import Any

from gateway.core.agents import AgentIdentity
from gateway.core.conversation import TurnRequest
from gateway.core.session_store import Session
from gateway.decoding import Detokenizer
from gateway.protocol.chat import (
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatMessage,
    Choice,
    ChoiceLogprobs,
    ChunkChoice,
    Content,
    Delta,
    DeltaToolCall,
    ImagePart,
    NamedToolChoice,
    SeeingContent,
    TokenLogprob,
    ToolCallFunction,
    ToolCallOut,
    TopLogprobOut,
    content_items,
)
from gateway.protocol.sse import DONE, TextEvents, sse, sse_error
from gateway.protocol.wire import Usage
from gateway.serving.engine import TurnEngine
from gateway.serving.image_input import FoundImage, ImageEdge, content_parts
from gateway.serving.model_names import answered_as
from gateway.serving.turn_data import TurnResult
from gateway.serving.turn_service import TurnServing, TurnStream

__all__ = ["ChatServing", "chat_images", "chat_turn_request", "token_logprobs", "usage"]

JSON = dict[str, Any]


def usage(result: TurnResult) -> Usage:
    prompt, completion = result.usage
    return Usage.build(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )


def chat_images(req: ChatCompletionRequest) -> Iterator[FoundImage]:
    """The request's image parts (user and tool messages' ``image_url``), where each is."""
    for i, message in enumerate(req.messages):
        if isinstance(message.content, list):
            for j, part in enumerate(message.content):
                if isinstance(part, ImagePart):
                    yield f"messages[{i}].content[{j}].image_url", part


def chat_turn_request(
    req: ChatCompletionRequest,
    agent: AgentIdentity | None = None,
    images: Mapping[str, bytes] | None = None,
) -> TurnRequest:
    """A chat request as the canonical turn request (``agent``: who asks, from its headers;
    ``images``: its images' bytes by digest, ``check_images`` of ``chat_images``, which keeps
    each part's checked image for this translation). A message's text parts are joined where
    it shows no image; one that does keeps its parts, in order (``content_parts``)."""
    choice = req.tool_choice
    return TurnRequest(
        api="chat.completions",
        model=req.model,
        messages=[_message(m) for m in req.messages],
        tools=req.raw_tools,
        tool_choice=choice.model_dump() if isinstance(choice, NamedToolChoice) else choice,
        parallel_tool_calls=req.parallel_tool_calls,
        max_tokens=req.token_budget,
        temperature=req.temperature,
        top_p=req.top_p,
        seed=req.seed,
        stop=req.stop_strings,
        logprobs=req.logprobs,
        top_logprobs=req.top_logprobs or 0,
        agent=agent,
        images=images or {},
    )


def _message(message: ChatMessage) -> JSON:
    """A message as the turn's: its fields (None left out), its content a string, None or the
    canonical parts (``_content``)."""
    fields = message.model_dump(exclude_none=True)
    content = message.content
    if not isinstance(content, str):  # a string is in the dump as it is (most messages)
        fields["content"] = _content(content)
    return fields


def _content(content: Content | SeeingContent) -> str | list[JSON] | None:
    items = content_items(content)
    return items if items is None or isinstance(items, str) else content_parts(items)


class ChatServing:
    """Chat Completions over the turn core."""

    def __init__(self, turns: TurnServing, images: ImageEdge | None = None) -> None:
        self.turns = turns
        self.engine = turns.engine
        self.images = images or ImageEdge()

    async def turn_request(
        self, req: ChatCompletionRequest, agent: AgentIdentity | None = None
    ) -> TurnRequest:
        """The request as a turn, its images checked (a 400 naming a bad one)."""
        found = chat_images(req)
        images = await self.images.check(found, where="messages")
        return chat_turn_request(req, agent, images)

    async def complete(
        self, session: Session, req: ChatCompletionRequest, agent: AgentIdentity | None = None
    ) -> ChatCompletion:
        request = await self.turn_request(req, agent)
        result = await self.turns.complete(session, request)
        message = AssistantMessage.build(
            content=result.content, tool_calls=_tool_calls(result) or None
        )
        logprobs = None
        if request.logprobs:
            tokens = range(len(result.completion_ids))
            logprobs = _logprobs(self.engine, result.detok, tokens, request)
        choice = Choice.build(
            message=message, finish_reason=result.finish_reason, logprobs=logprobs
        )
        return ChatCompletion.build(
            id=result.completion_id,
            created=int(time.time()),
            model=answered_as(request.model, self.engine.model_name),
            choices=[choice],
            usage=usage(result),
        )

    async def stream(
        self, session: Session, req: ChatCompletionRequest, agent: AgentIdentity | None = None
    ) -> TurnStream:
        request = await self.turn_request(req, agent)
        return await self.turns.stream(
            session,
            request,
            lambda reply, _prompt_tokens: _ChatEncoder(
                self.engine, f"chatcmpl-{session.state.id}-{reply}", request, req.include_usage
            ),
        )


class _ChatEncoder:
    """chat.completion.chunk events, then ``[DONE]``."""

    def __init__(
        self, engine: TurnEngine, cid: str, request: TurnRequest, include_usage: bool
    ) -> None:
        self.engine = engine
        self.cid = cid
        self.request = request
        self.include_usage = include_usage
        self.created = int(time.time())
        self._texts: TextEvents | None = None  # text-only chunks, from one serialized

    def _chunk(
        self, delta: Delta, finish: str | None = None, logprobs: ChoiceLogprobs | None = None
    ) -> bytes:
        choice = ChunkChoice.build(delta=delta, finish_reason=finish, logprobs=logprobs)
        return sse(
            ChatCompletionChunk.build(
                id=self.cid,
                created=self.created,
                model=answered_as(self.request.model, self.engine.model_name),
                choices=[choice],
            )
        )

    def _logprobs(self, detok: Detokenizer, tokens: range) -> ChoiceLogprobs | None:
        if not self.request.logprobs:
            return None
        return _logprobs(self.engine, detok, tokens, self.request)

    def opening(self) -> bytes:
        return self._chunk(Delta.build(role="assistant", content=""))

    def text(self, delta: str, detok: Detokenizer, tokens: range) -> bytes:
        if self.request.logprobs:
            return self._chunk(Delta.build(content=delta), logprobs=self._logprobs(detok, tokens))
        if self._texts is None:
            self._texts = TextEvents(self._chunk(Delta.build(content="")), b'"content":')
        return self._texts.write(delta)

    def closing(self, result: TurnResult, rest: str, detok: Detokenizer, tokens: range) -> bytes:
        out = []
        if rest or (self.request.logprobs and len(tokens)):
            out.append(
                self._chunk(Delta.build(content=rest), logprobs=self._logprobs(detok, tokens))
            )
        if result.tool_calls:
            calls = [
                DeltaToolCall.build(index=i, id=c.id, function=c.function)
                for i, c in enumerate(_tool_calls(result))
            ]
            out.append(self._chunk(Delta.build(tool_calls=calls)))
        out.append(self._chunk(Delta.build(), result.finish_reason))
        if self.include_usage:
            out.append(
                sse(
                    ChatCompletionChunk.build(
                        id=self.cid,
                        created=self.created,
                        model=answered_as(self.request.model, self.engine.model_name),
                        choices=[],
                        usage=usage(result),
                    )
                )
            )
        out.append(DONE)
        return b"".join(out)

    def failure(self, exc: BaseException) -> bytes:
        return sse_error(exc)


def token_logprobs(
    engine: TurnEngine, detok: Detokenizer, tokens: range, top: int
) -> list[TokenLogprob]:
    """The logprobs of completion ``tokens`` as OpenAI writes them (Chat and Responses)."""
    decode = engine.template.decode
    entries = []
    for i in tokens:
        token = decode([detok.ids[i]], skip_special_tokens=False)
        tops = []
        for alt in detok.top_logprobs[i][:top]:
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
    return entries


def _logprobs(
    engine: TurnEngine, detok: Detokenizer, tokens: range, request: TurnRequest
) -> ChoiceLogprobs:
    return ChoiceLogprobs.build(content=token_logprobs(engine, detok, tokens, request.top_logprobs))


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
