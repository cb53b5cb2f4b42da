"""Anthropic Messages over the turn core: the request as a ``TurnRequest``, the result as a
``message`` or as Anthropic's stream events.

The request's side (the canonical conversation, its images): ``anthropic_input``.

A reply's ``stop_reason``: ``tool_use`` with tool calls, ``max_tokens`` at the cap (or
``model_context_window_exceeded`` when the reply filled the model's context), else
``stop_sequence`` when one of the request's ``stop_sequences`` ended it (the earliest of them in
the completion's text: the core only says "stop"), else ``end_turn``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, cast

from gateway.core.agents import AgentIdentity
from gateway.core.conversation import TurnRequest, arguments_object
from gateway.core.session_store import Session
from gateway.decoding import Detokenizer
from gateway.errors import anthropic_error_body
from gateway.protocol.anthropic import CountTokensRequest, MessagesRequest
from gateway.protocol.anthropic_reply import (
    ContentBlockDeltaEvent,
    ContentBlockStartEvent,
    ContentBlockStopEvent,
    InputJsonDelta,
    Message,
    MessageDelta,
    MessageDeltaEvent,
    MessageDeltaUsage,
    MessageStartEvent,
    MessageStopEvent,
    MessageUsage,
    StreamErrorEvent,
    TextContent,
    TextDelta,
    TokenCountResult,
    ToolUseContent,
)
from gateway.protocol.sse import TextEvents, sse_event
from gateway.serving.anthropic_input import (
    anthropic_images,
    canonical_messages,
    canonical_tools,
    messages_turn_request,
    tool_choice,
)
from gateway.serving.engine import TurnEngine, renders_off_loop
from gateway.serving.image_input import ImageEdge
from gateway.serving.model_names import answered_as
from gateway.serving.turn_data import TurnResult
from gateway.serving.turn_service import TurnServing, TurnStream

__all__ = [
    "AnthropicServing",
    "canonical_messages",
    "canonical_tools",
    "messages_turn_request",
    "tool_input",
]

JSON = dict[str, Any]


def tool_input(arguments: object) -> JSON:
    """A tool call's arguments as ``tool_use.input`` (an object). The parsers only yield JSON
    objects; anything else is passed on wrapped, as ``{"arguments": <what the model wrote>}``."""
    parsed = arguments_object(arguments)
    return parsed if isinstance(parsed, dict) else {"arguments": parsed}


def _partial_json(arguments: object) -> str:
    """The input_json_delta of a call: the arguments as sent, when they are an object."""
    if isinstance(arguments, str) and isinstance(arguments_object(arguments), dict):
        return arguments
    return json.dumps(tool_input(arguments), ensure_ascii=False, separators=(",", ":"))


def stop_sequence(engine: TurnEngine, result: TurnResult, stops: Sequence[str]) -> str | None:
    """The stop sequence that ended the turn: the earliest of ``stops`` in its text."""
    if result.finish_reason != "stop" or not stops:
        return None
    text = engine.template.decode(result.completion_ids)
    hits = [(at, n, s) for n, s in enumerate(stops) if s and (at := text.find(s)) >= 0]
    return min(hits)[2] if hits else None


def stop_reason(engine: TurnEngine, result: TurnResult, sequence: str | None) -> str:
    if result.tool_calls:
        return "tool_use"
    if result.finish_reason == "length":
        # The core lowers max_tokens to the room the prompt leaves: a reply that filled the
        # context stopped there, not at the client's cap (Anthropic names that case too).
        full = sum(result.usage) >= engine.backend.max_context
        return "model_context_window_exceeded" if full else "max_tokens"
    return "end_turn" if sequence is None else "stop_sequence"


def _content(result: TurnResult) -> list[TextContent | ToolUseContent]:
    blocks: list[TextContent | ToolUseContent] = []
    if result.content:
        blocks.append(TextContent.build(text=result.content))
    for call in result.tool_calls:
        function = call["function"]
        blocks.append(
            ToolUseContent.build(
                id=call["id"], name=function["name"], input=tool_input(function["arguments"])
            )
        )
    return blocks


def message_id(session: Session, reply: str) -> str:
    """One id per turn of a session, from its ``reply`` id (``TurnCompleted.reply``): a resent
    request gets its message again, same id."""
    return f"msg_{session.state.id}_{reply}"


class AnthropicServing:
    """Anthropic Messages over the turn core."""

    def __init__(self, turns: TurnServing, images: ImageEdge | None = None) -> None:
        self.turns = turns
        self.engine = turns.engine
        self.images = images or ImageEdge()

    async def _images(self, req: MessagesRequest | CountTokensRequest) -> dict[str, bytes]:
        """The request's images checked (a 400 naming a bad one), their bytes by digest."""
        found = anthropic_images(req)
        return await self.images.check(found, where="messages")

    async def complete(
        self, session: Session, req: MessagesRequest, agent: AgentIdentity | None = None
    ) -> Message:
        request = messages_turn_request(req, agent, await self._images(req))
        result = await self.turns.complete(session, request)
        sequence = stop_sequence(self.engine, result, request.stop)
        prompt, completion = result.usage
        return Message.build(
            id=message_id(session, result.reply),
            model=answered_as(request.model, self.engine.model_name),
            content=_content(result),
            stop_reason=stop_reason(self.engine, result, sequence),
            stop_sequence=sequence,
            usage=MessageUsage.build(input_tokens=prompt, output_tokens=completion),
        )

    async def stream(
        self, session: Session, req: MessagesRequest, agent: AgentIdentity | None = None
    ) -> TurnStream:
        request = messages_turn_request(req, agent, await self._images(req))
        return await self.turns.stream(
            session,
            request,
            lambda reply, prompt_tokens: _MessagesEncoder(
                self.engine, message_id(session, reply), request, prompt_tokens
            ),
        )

    async def count_tokens(self, req: CountTokensRequest) -> TokenCountResult:
        """The prompt's length as rendered from scratch (a turn that continues the session's
        previous one may differ by the template's rendering of that turn's reply)."""
        # Checked (their sizes decide their placeholders), and taken by the model.
        self.engine.takes(await self._images(req))
        choice, _ = tool_choice(req)
        messages = canonical_messages(req)
        tools = canonical_tools(req) if choice != "none" else None
        render = self.engine.template.prompt_ids
        if renders_off_loop(messages, tools):
            ids = await self.engine.off_loop(render, messages, tools, first=True)
        else:
            ids = render(messages, tools)
        return TokenCountResult.build(input_tokens=len(ids))


class _MessagesEncoder:
    """message_start, a text block as text arrives, then (after the turn is durable) a
    tool_use block per call, message_delta and message_stop. No empty text block is opened
    for a reply without text. ``input_tokens`` is in message_start (Claude Code tracks its
    context with it) and again in message_delta."""

    def __init__(
        self, engine: TurnEngine, mid: str, request: TurnRequest, prompt_tokens: int
    ) -> None:
        self.engine = engine
        self.mid = mid
        self.request = request
        self.prompt_tokens = prompt_tokens
        self.text_open = False
        self._texts: TextEvents | None = None  # text deltas, from one serialized

    def opening(self) -> bytes:
        message = Message.build(
            id=self.mid,
            model=answered_as(self.request.model, self.engine.model_name),
            content=[],
            stop_reason=None,
            usage=MessageUsage.build(input_tokens=self.prompt_tokens, output_tokens=0),
        )
        return sse_event("message_start", MessageStartEvent.build(message=message))

    def text(self, delta: str, detok: Detokenizer, tokens: range) -> bytes:
        out = b""
        if not self.text_open:
            self.text_open = True
            start = ContentBlockStartEvent.build(index=0, content_block=TextContent.build(text=""))
            out = sse_event("content_block_start", start)
        if self._texts is None:
            event = ContentBlockDeltaEvent.build(index=0, delta=TextDelta.build(text=""))
            self._texts = TextEvents(sse_event("content_block_delta", event), b'"text":')
        return out + self._texts.write(delta)

    def closing(self, result: TurnResult, rest: str, detok: Detokenizer, tokens: range) -> bytes:
        out = [self.text(rest, detok, tokens)] if rest else []
        index = 0
        if self.text_open:
            out.append(sse_event("content_block_stop", ContentBlockStopEvent.build(index=0)))
            index = 1
        for call in result.tool_calls:
            function = call["function"]
            block = ToolUseContent.build(id=call["id"], name=function["name"], input={})
            delta = InputJsonDelta.build(partial_json=_partial_json(function["arguments"]))
            out += [
                sse_event(
                    "content_block_start",
                    ContentBlockStartEvent.build(index=index, content_block=block),
                ),
                sse_event(
                    "content_block_delta", ContentBlockDeltaEvent.build(index=index, delta=delta)
                ),
                sse_event("content_block_stop", ContentBlockStopEvent.build(index=index)),
            ]
            index += 1
        sequence = stop_sequence(self.engine, result, self.request.stop)
        prompt, completion = result.usage
        delta_event = MessageDeltaEvent.build(
            delta=MessageDelta.build(
                stop_reason=stop_reason(self.engine, result, sequence), stop_sequence=sequence
            ),
            usage=MessageDeltaUsage.build(output_tokens=completion, input_tokens=prompt),
        )
        out.append(sse_event("message_delta", delta_event))
        out.append(sse_event("message_stop", MessageStopEvent.build()))
        return b"".join(out)

    def failure(self, exc: BaseException) -> bytes:
        body = anthropic_error_body(exc)
        error = cast(dict[str, str], body["error"])
        return sse_event("error", StreamErrorEvent.build(error=error))
