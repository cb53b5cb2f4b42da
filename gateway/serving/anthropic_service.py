"""Anthropic Messages over the turn core: the request as a ``TurnRequest``, the result as a
``message`` or as Anthropic's stream events.

The canonical conversation is the same whichever way a client serializes its history:

- ``system`` (a string or text blocks) is one leading system message; a ``role: "system"``
  message inside ``messages`` stays where it is. Text blocks are joined with "" (a string and
  its blocks give the same message); ``cache_control`` and other block decorations are dropped.
- A user message's ``tool_result`` blocks become tool messages (``tool_call_id`` = its
  ``tool_use_id``, ``content`` its text; ``is_error`` is not recorded), first, as Anthropic
  requires them first; its text blocks follow as one user message.
- An assistant message's text is its content, its ``tool_use`` blocks its tool calls
  (``arguments`` = the input as compact JSON, as the tool parsers write it), its thinking blocks
  are dropped: the reply the gateway sent comes back as the message the turn recorded.

A reply's ``stop_reason``: ``tool_use`` with tool calls, ``max_tokens`` at the cap (or
``model_context_window_exceeded`` when the reply filled the model's context), else
``stop_sequence`` when one of the request's ``stop_sequences`` ended it (the earliest of them in
the completion's text: the core only says "stop"), else ``end_turn``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any, cast

from gateway.core.agents import AgentIdentity
from gateway.core.conversation import TurnRequest, arguments_object
from gateway.core.session_store import Session
from gateway.decoding import Detokenizer
from gateway.errors import anthropic_error_body
from gateway.protocol.anthropic import (
    CountTokensRequest,
    CustomTool,
    MessagesRequest,
    SystemTurn,
    TextBlock,
    ToolChoiceAny,
    ToolChoiceAuto,
    ToolChoiceNone,
    ToolChoiceTool,
    ToolResultBlock,
    ToolUseBlock,
    UserTurn,
    block_text,
)
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
from gateway.serving.engine import TurnEngine
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
# Rendering a prompt this large (count_tokens) runs on a worker thread, as the turn core does.
_OFF_LOOP_CHARS = 64 * 1024


def canonical_messages(req: MessagesRequest | CountTokensRequest) -> list[JSON]:
    """The request's conversation as the turn core's messages."""
    messages: list[JSON] = []
    system = block_text(_prompt_blocks(req.system))
    if system:
        messages.append({"role": "system", "content": system})
    for message in req.messages:
        if isinstance(message, SystemTurn):
            messages.append({"role": "system", "content": block_text(message.content)})
        elif isinstance(message, UserTurn):
            messages += _user_messages(message.content)
        else:
            messages.append(_assistant_message(message.content))
    return messages


_BILLING_HEADER = "x-anthropic-billing-header:"


def _prompt_blocks(system: str | list[TextBlock] | None) -> str | list[TextBlock] | None:
    """``system`` without Claude Code's billing block (``billing_header``): a header carried in
    the body, not text for the model. It differs between one session's agents (a sub-agent's
    adds ``cc_is_subagent=true;``) and between builds of the CLI (its version suffix), so
    rendering it would make a fork's prompt share nothing with its parent's spawning turn, and
    a prompt depend on which build sent it. Recorded with the turn instead."""
    if not isinstance(system, list) or not any(b.text.startswith(_BILLING_HEADER) for b in system):
        return system
    return [b for b in system if not b.text.startswith(_BILLING_HEADER)]


def billing_header(system: str | list[TextBlock] | None) -> str | None:
    """The text of Claude Code's billing block in ``system`` (``x-anthropic-billing-header:
    cc_version=...; cc_entrypoint=...;``), where there is one."""
    if not isinstance(system, list):
        return None
    return next((b.text for b in system if b.text.startswith(_BILLING_HEADER)), None)


def _user_messages(content: str | Sequence[TextBlock | ToolResultBlock]) -> list[JSON]:
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    out: list[JSON] = [
        {"role": "tool", "tool_call_id": b.tool_use_id, "content": block_text(b.content)}
        for b in content
        if isinstance(b, ToolResultBlock)
    ]
    texts = [b.text for b in content if isinstance(b, TextBlock)]
    if texts or not out:
        out.append({"role": "user", "content": "".join(texts)})
    return out


def _assistant_message(content: str | Sequence[object]) -> JSON:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    texts = [b.text for b in content if isinstance(b, TextBlock)]
    calls = [
        {
            "id": b.id,
            "type": "function",
            # The tool parsers' serialization: the arguments the gateway sent, back as sent.
            "function": {
                "name": b.name,
                "arguments": json.dumps(b.input, ensure_ascii=False, separators=(",", ":")),
            },
        }
        for b in content
        if isinstance(b, ToolUseBlock)
    ]
    message: JSON = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
    if calls:
        message["tool_calls"] = calls
    return message


def canonical_tools(req: MessagesRequest | CountTokensRequest) -> list[JSON] | None:
    """The custom tools as function tools (what the model is offered); server tools are not."""
    tools = [_function_tool(t) for t in req.custom_tools]
    return tools or None


def _function_tool(tool: CustomTool) -> JSON:
    function: JSON = {"name": tool.name}
    if tool.description is not None:
        function["description"] = tool.description
    function["parameters"] = tool.input_schema
    return {"type": "function", "function": function}


def _tool_choice(req: MessagesRequest | CountTokensRequest) -> tuple[str | JSON | None, bool]:
    """The canonical tool_choice and whether parallel tool calls are allowed."""
    choice = req.tool_choice
    if choice is None:
        return None, True
    if isinstance(choice, ToolChoiceNone):
        return "none", True
    parallel = not choice.disable_parallel_tool_use
    if isinstance(choice, ToolChoiceAuto):
        return "auto", parallel
    if isinstance(choice, ToolChoiceAny):
        return "required", parallel
    assert isinstance(choice, ToolChoiceTool)
    return {"type": "function", "function": {"name": choice.name}}, parallel


def messages_turn_request(req: MessagesRequest, agent: AgentIdentity | None = None) -> TurnRequest:
    """A Messages request as the canonical turn request (``agent``: who asks, from its
    headers). ``extras`` records what the turn cannot honour but a client's retry resends
    unchanged (never ``stream``)."""
    choice, parallel = _tool_choice(req)
    extras: JSON = {}
    for name in ("metadata", "thinking", "context_management"):
        value = getattr(req, name)
        if value is not None:
            extras[name] = value
    if req.output_config is not None:
        extras["output_config"] = req.output_config.model_dump(exclude_none=True)
    if req.server_tools:
        extras["unoffered_tools"] = [t.raw for t in req.server_tools]
    billing = billing_header(req.system)
    if billing is not None:
        extras["billing_header"] = billing
    return TurnRequest(
        api="messages",
        messages=canonical_messages(req),
        model=req.model,
        tools=canonical_tools(req),
        tool_choice=choice,
        parallel_tool_calls=parallel,
        max_tokens=req.max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        stop=list(req.stop_sequences or ()),
        extras=extras,
        agent=agent,
    )


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

    def __init__(self, turns: TurnServing) -> None:
        self.turns = turns
        self.engine = turns.engine

    async def complete(
        self, session: Session, req: MessagesRequest, agent: AgentIdentity | None = None
    ) -> Message:
        request = messages_turn_request(req, agent)
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
        request = messages_turn_request(req, agent)
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
        choice, _ = _tool_choice(req)
        messages = canonical_messages(req)
        tools = canonical_tools(req) if choice != "none" else None
        render = self.engine.template.prompt_ids
        if sum(len(m.get("content") or "") for m in messages) > _OFF_LOOP_CHARS:
            ids = await asyncio.to_thread(render, messages, tools)
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
