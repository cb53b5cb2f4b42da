"""OpenAI Responses over the turn core: the request as a ``TurnRequest``, the result as a
``response`` object or as typed ``response.*`` events.

Input items become chat messages: a message item is a message (its text parts joined), the
``function_call`` items that follow an assistant message item (or each other) join it as ONE
assistant message with tool calls, a ``function_call_output`` is a tool message, ``reasoning``
items are dropped. So the output items of a response, echoed back verbatim or re-serialized,
are exactly the reply the turn recorded, and the next turn extends it token for token.

Response ids name the session and the turn (``resp_<session>_<turn>``), and so do item ids;
a resent request gets its turn again under the same ids.

``previous_response_id`` continues that response's conversation (its messages, its reply, then
the new input), token for token. It is served from the session's state, which keeps the session's
most recently used turns (``--session-turns-kept``): any kept response can be continued, the
latest or an earlier one (a branch). A response no longer kept is refused with a 400 naming
it: the log holds it, but the turn core offers no read of a session's events to the adapters,
so the client resends the full conversation as input.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from typing import Any

from gateway.conversation import TurnRequest
from gateway.decoding import Detokenizer
from gateway.errors import InvalidRequest, error_body
from gateway.protocol.chat import TokenLogprob
from gateway.protocol.responses import (
    RESPONSE_ID,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionChoice,
    HostedTool,
    MessageItem,
    ResponsesRequest,
    item_text,
)
from gateway.protocol.responses_reply import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ContentPartEvent,
    IncompleteDetails,
    InputTokensDetails,
    LifecycleEvent,
    OutputFunctionCall,
    OutputItemEvent,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ResponseErrorEvent,
    ResponseObject,
    ResponseUsage,
    TextDeltaEvent,
    TextDoneEvent,
)
from gateway.protocol.sse import sse_event
from gateway.serving.chat import token_logprobs
from gateway.serving.engine import TurnEngine, TurnResult
from gateway.serving.turns import TurnServing, TurnStream
from gateway.sessions import Session
from gateway.turns import SessionState

__all__ = [
    "ResponsesServing",
    "input_messages",
    "parse_response_id",
    "response_id",
    "responses_turn_request",
]

JSON = dict[str, Any]
_RESPONSE_ID = re.compile(RESPONSE_ID)
# Recorded with the turn: what is stable across a client's retry of the same request (a
# request with another record is another turn). client_metadata is Codex's turn telemetry
# (thread, turn, window and installation ids, the turn's start time): its key order changes
# between requests, but as a dict it is the same in every request of a Codex turn (the three
# captured requests: tests/unit/test_responses_protocol.py), so a retry has the same record.
# include is recorded as a set: the Agents SDK builds it from one.
_RECORDED = ("reasoning", "store", "prompt_cache_key", "metadata", "client_metadata")


def response_id(session: str, turn: int) -> str:
    """The id of a session's turn's response (a resend of it gets the same id).

    >>> response_id("s_1", 3)
    'resp_s_1_3'
    """
    return f"resp_{session}_{turn}"


def parse_response_id(value: str) -> tuple[str, int]:
    """The session and turn a response id names (session ids may hold ``_``: the turn is
    what follows the last one).

    >>> parse_response_id("resp_s_1_3")
    ('s_1', 3)
    """
    if not _RESPONSE_ID.match(value):
        raise InvalidRequest(
            f"previous_response_id {value[:80]!r} is not a response id of this gateway "
            "(resp_<session>_<turn>)",
            param="previous_response_id",
        )
    session, _, turn = value[len("resp_") :].rpartition("_")
    return session, int(turn)


def input_messages(items: str | Sequence[object]) -> list[JSON]:
    """The input (a string, or parsed items) as chat messages (see the module's docstring).

    >>> input_messages("hi")
    [{'role': 'user', 'content': 'hi'}]
    """
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[JSON] = []
    assistant: JSON | None = None  # the assistant message being assembled

    def flush() -> None:
        nonlocal assistant
        if assistant is not None:
            messages.append(assistant)
            assistant = None

    for item in items:
        if isinstance(item, MessageItem):
            text = item_text(item.content)
            if item.role != "assistant":
                flush()
                messages.append({"role": item.role, "content": text})
            elif assistant is not None and not assistant.get("tool_calls"):
                assistant["content"] = (assistant["content"] or "") + text
            else:
                flush()
                assistant = {"role": "assistant", "content": text}
        elif isinstance(item, FunctionCallItem):
            if assistant is None:
                assistant = {"role": "assistant", "content": None}
            assistant.setdefault("tool_calls", []).append(
                {
                    "id": item.call_id,
                    "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments},
                }
            )
        elif isinstance(item, FunctionCallOutputItem):
            flush()
            messages.append(
                {"role": "tool", "tool_call_id": item.call_id, "content": item_text(item.output)}
            )
        # reasoning items: dropped, and they do not split an assistant message
    flush()
    return messages


def _with_instructions(base: Sequence[JSON], instructions: str | None) -> list[JSON]:
    """``instructions`` as the leading system message: in place of the previous one (a
    previous response's instructions do not carry over), else first."""
    if instructions is None:
        return list(base)
    system = {"role": "system", "content": instructions}
    if base and base[0].get("role") == "system":
        return [system, *base[1:]]
    return [system, *base]


def responses_turn_request(req: ResponsesRequest, previous: Sequence[JSON] = ()) -> TurnRequest:
    """A Responses request as the canonical turn request; ``previous`` is the conversation
    ``previous_response_id`` continues (its messages and its reply)."""
    messages = [*_with_instructions(previous, req.instructions), *input_messages(req.input)]
    if not messages:
        raise InvalidRequest("input holds no message: send at least one", param="input")
    tools = [
        {
            "type": "function",
            "function": {
                k: v
                for k, v in (
                    ("name", t.name),
                    ("description", t.description),
                    ("parameters", t.parameters),
                )
                if v is not None
            },
        }
        for t in req.function_tools
    ]
    choice = req.tool_choice
    extras: JSON = {}
    for name in _RECORDED:
        value = getattr(req, name)
        if value is not None and value != [] and value != {}:
            extras[name] = value
    if req.include:
        extras["include"] = sorted(set(req.include))
    if req.previous_response_id is not None:
        extras["previous_response_id"] = req.previous_response_id
    unoffered = [t.model_dump() for t in req.tools or () if isinstance(t, HostedTool)]
    if unoffered:
        extras["unoffered_tools"] = unoffered
    return TurnRequest(
        api="responses",
        messages=messages,
        tools=tools or None,
        tool_choice=(
            {"type": "function", "function": {"name": choice.name}}
            if isinstance(choice, FunctionChoice)
            else choice
        ),
        parallel_tool_calls=req.parallel_tool_calls,
        max_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        logprobs=req.logprobs,
        top_logprobs=(req.top_logprobs or 0) if req.logprobs else 0,
        extras=extras,
    )


def previous_conversation(state: SessionState, req: ResponsesRequest) -> list[JSON]:
    """The conversation ``req.previous_response_id`` continues, from the session's state.

    Read without the session's lock: a turn taken meanwhile makes this request a branch from
    the response it named, which is what it asked for. A resent request rebuilds the same
    conversation, so it is answered with its recorded turn (``gateway.branches.resent_turn``)."""
    previous = req.previous_response_id
    if previous is None:
        return []
    session, turn = parse_response_id(previous)
    if session != state.id:
        raise InvalidRequest(
            f"previous_response_id {previous!r} is a response of session {session!r}, not of "
            f"this request's session {state.id!r}",
            param="previous_response_id",
        )
    if turn >= state.turns:
        raise InvalidRequest(
            f"previous_response_id {previous!r}: session {state.id!r} has no turn {turn} "
            f"(it has {state.turns})",
            param="previous_response_id",
        )
    node = state.nodes.get(turn)
    if node is None:
        raise InvalidRequest(
            f"previous_response_id {previous!r}: turn {turn} of session {state.id!r} is no "
            f"longer held by the gateway (it keeps a session's {state.kept.turns} most recently "
            f"used turns, {state.kept.tokens} tokens at most); resend the full conversation as "
            "input, without previous_response_id",
            param="previous_response_id",
        )
    if node.event.request.get("api") == "completions":
        raise InvalidRequest(
            f"previous_response_id {previous!r} names a text completion, not a response",
            param="previous_response_id",
        )
    return list(node.conversation)


def _item_id(call_id: str) -> str:
    return "fc_" + call_id.removeprefix("call_")


def _status(result: TurnResult) -> str:
    return "incomplete" if result.finish_reason == "length" else "completed"


def _usage(result: TurnResult) -> ResponseUsage:
    prompt, completion = result.usage
    return ResponseUsage.build(
        input_tokens=prompt,
        input_tokens_details=InputTokensDetails.build(),
        output_tokens=completion,
        output_tokens_details=OutputTokensDetails.build(),
        total_tokens=prompt + completion,
    )


def _function_call(call: JSON, status: str, arguments: str | None = None) -> OutputFunctionCall:
    function = call["function"]
    return OutputFunctionCall.build(
        id=_item_id(call["id"]),
        call_id=call["id"],
        name=function["name"],
        arguments=function["arguments"] if arguments is None else arguments,
        status=status,
    )


class _Frame:
    """What every response object of one request shares: its parameters, echoed."""

    def __init__(self, engine: TurnEngine, req: ResponsesRequest) -> None:
        self.model = engine.model_name
        self.created_at = int(time.time())
        choice = req.tool_choice
        self.echo: JSON = {
            "instructions": req.instructions,
            "metadata": req.metadata or {},
            "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "tool_choice": choice.model_dump()
            if isinstance(choice, FunctionChoice)
            else choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "top_logprobs": req.top_logprobs,
            "max_output_tokens": req.max_output_tokens,
            "reasoning": req.reasoning,
            "store": req.store,
            "text": {"format": {"type": "text"}},
            "truncation": req.truncation or "disabled",
            "user": req.user,
            "prompt_cache_key": req.prompt_cache_key,
        }

    def response(
        self,
        rid: str,
        status: str,
        output: list[OutputMessage | OutputFunctionCall],
        usage: ResponseUsage | None = None,
    ) -> ResponseObject:
        return ResponseObject.build(
            id=rid,
            created_at=self.created_at,
            status=status,
            model=self.model,
            output=output,
            usage=usage,
            incomplete_details=IncompleteDetails.build() if status == "incomplete" else None,
            **self.echo,
        )


class ResponsesServing:
    """OpenAI Responses over the turn core."""

    def __init__(self, turns: TurnServing) -> None:
        self.turns = turns
        self.engine = turns.engine

    def turn_request(self, session: Session, req: ResponsesRequest) -> TurnRequest:
        return responses_turn_request(req, previous_conversation(session.state, req))

    async def complete(self, session: Session, req: ResponsesRequest) -> ResponseObject:
        request = self.turn_request(session, req)
        result = await self.turns.complete(session, request)
        sid, status = session.state.id, _status(result)
        output: list[OutputMessage | OutputFunctionCall] = []
        if result.content:
            logprobs: list[TokenLogprob] = []
            if request.logprobs:
                logprobs = _logprobs(
                    self.engine, result.detok, range(len(result.completion_ids)), request
                )
            text = OutputText.build(text=result.content, annotations=[], logprobs=logprobs)
            output.append(
                OutputMessage.build(id=f"msg_{sid}_{result.index}", status=status, content=[text])
            )
        output += [_function_call(c, "completed") for c in result.tool_calls]
        frame = _Frame(self.engine, req)
        return frame.response(response_id(sid, result.index), status, output, _usage(result))

    async def stream(self, session: Session, req: ResponsesRequest) -> TurnStream:
        request = self.turn_request(session, req)
        frame, sid = _Frame(self.engine, req), session.state.id
        return await self.turns.stream(
            session,
            request,
            lambda index, _prompt_tokens: _ResponsesEncoder(
                self.engine, frame, sid, index, request
            ),
        )


class _ResponsesEncoder:
    """The typed events of one streamed response. The message item opens with the first
    text (a reply may hold tool calls only); tool calls, the final response and usage come
    after the turn is durable."""

    def __init__(
        self, engine: TurnEngine, frame: _Frame, session: str, index: int, request: TurnRequest
    ) -> None:
        self.engine = engine
        self.frame = frame
        self.request = request
        self.id = response_id(session, index)
        self.message_id = f"msg_{session}_{index}"
        self.sequence = 0
        self.opened = False  # the message item
        self.logprobs: list[TokenLogprob] = []

    def _event(self, event: Any) -> bytes:
        self.sequence += 1
        return sse_event(event.type, event)

    def _lifecycle(self, kind: str, response: ResponseObject) -> bytes:
        return self._event(
            LifecycleEvent.build(type=kind, sequence_number=self.sequence, response=response)
        )

    def opening(self) -> bytes:
        response = self.frame.response(self.id, "in_progress", [])
        return self._lifecycle("response.created", response) + self._lifecycle(
            "response.in_progress", response
        )

    def _open_message(self) -> bytes:
        if self.opened:
            return b""
        self.opened = True
        item = OutputMessage.build(id=self.message_id, status="in_progress", content=[])
        part = OutputText.build(text="", annotations=[], logprobs=[])
        return self._event(
            OutputItemEvent.build(
                type="response.output_item.added",
                sequence_number=self.sequence,
                output_index=0,
                item=item,
            )
        ) + self._event(
            ContentPartEvent.build(
                type="response.content_part.added",
                sequence_number=self.sequence,
                item_id=self.message_id,
                output_index=0,
                part=part,
            )
        )

    def text(self, delta: str, detok: Detokenizer, tokens: range) -> bytes:
        logprobs: list[TokenLogprob] = []
        if self.request.logprobs:
            logprobs = _logprobs(self.engine, detok, tokens, self.request)
            self.logprobs += logprobs
        return self._open_message() + self._event(
            TextDeltaEvent.build(
                sequence_number=self.sequence,
                item_id=self.message_id,
                output_index=0,
                delta=delta,
                logprobs=logprobs,
            )
        )

    def closing(self, result: TurnResult, rest: str, detok: Detokenizer, tokens: range) -> bytes:
        out = [self.text(rest, detok, tokens)] if rest else []
        status = _status(result)
        output: list[OutputMessage | OutputFunctionCall] = []
        if self.opened or result.content:
            out.append(self._open_message())
            # What the turn recorded: the client keeps this item, and sends it back.
            text = result.content or ""
            part = OutputText.build(text=text, annotations=[], logprobs=self.logprobs)
            message = OutputMessage.build(id=self.message_id, status=status, content=[part])
            output.append(message)
            out += [
                self._event(
                    TextDoneEvent.build(
                        sequence_number=self.sequence,
                        item_id=self.message_id,
                        output_index=0,
                        text=text,
                        logprobs=self.logprobs,
                    )
                ),
                self._event(
                    ContentPartEvent.build(
                        type="response.content_part.done",
                        sequence_number=self.sequence,
                        item_id=self.message_id,
                        output_index=0,
                        part=part,
                    )
                ),
                self._item("response.output_item.done", 0, message),
            ]
        for call in result.tool_calls:
            index, item = len(output), _function_call(call, "completed")
            output.append(item)
            out += [
                self._item(
                    "response.output_item.added", index, _function_call(call, "in_progress", "")
                ),
                self._event(
                    ArgumentsDeltaEvent.build(
                        sequence_number=self.sequence,
                        item_id=item.id,
                        output_index=index,
                        delta=item.arguments,
                    )
                ),
                self._event(
                    ArgumentsDoneEvent.build(
                        sequence_number=self.sequence,
                        item_id=item.id,
                        output_index=index,
                        name=item.name,
                        arguments=item.arguments,
                    )
                ),
                self._item("response.output_item.done", index, item),
            ]
        response = self.frame.response(self.id, status, output, _usage(result))
        out.append(self._lifecycle(f"response.{status}", response))
        return b"".join(out)

    def _item(self, kind: str, index: int, item: OutputMessage | OutputFunctionCall) -> bytes:
        return self._event(
            OutputItemEvent.build(
                type=kind, sequence_number=self.sequence, output_index=index, item=item
            )
        )

    def failure(self, exc: BaseException) -> bytes:
        body = error_body(exc)
        return self._event(
            ResponseErrorEvent.build(
                sequence_number=self.sequence,
                code=str(body["code"]),
                message=str(body["message"]),
                param=body["param"],
            )
        )


def _logprobs(
    engine: TurnEngine, detok: Detokenizer, tokens: range, request: TurnRequest
) -> list[TokenLogprob]:
    return token_logprobs(engine, detok, tokens, request.top_logprobs)
