"""OpenAI Responses over the turn core: the result as a ``response`` object or as typed
``response.*`` events (the request's side, input items to a ``TurnRequest``, response ids and
``previous_response_id``: ``responses_input``).

Response ids name the session and the request (``resp_<session>_<reply>``, the turn's
``TurnCompleted.reply``), and so do item ids; a resent request gets its turn again under the
same ids.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import replace
from typing import Any

from pydantic import PrivateAttr

from gateway.core.agents import AgentIdentity
from gateway.core.conversation import TurnRequest
from gateway.core.session_store import Session
from gateway.decoding import Detokenizer
from gateway.errors import error_body
from gateway.protocol.chat import TokenLogprob
from gateway.protocol.responses import (
    FunctionChoice,
    ResponsesRequest,
    Tool,
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
from gateway.serving.chat_service import token_logprobs
from gateway.serving.engine import TurnEngine
from gateway.serving.image_input import ImageEdge
from gateway.serving.model_names import answered_as
from gateway.serving.responses_input import (
    previous_conversation,
    response_id,
    responses_images,
    responses_turn_request,
)
from gateway.serving.turn_data import TurnResult
from gateway.serving.turn_service import TurnServing, TurnStream

__all__ = ["ResponsesServing"]

JSON = dict[str, Any]
Namespaced = dict[str, tuple[str, str]]  # offered name -> (namespace, name)


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


def _function_call(
    call: JSON, status: str, namespaced: Namespaced, arguments: str | None = None
) -> OutputFunctionCall:
    """The item of a parsed call; a call of a namespace's function (by its flattened name)
    gets its namespace and bare name back, as Codex offered and reads them."""
    function = call["function"]
    namespace, name = namespaced.get(function["name"], (None, function["name"]))
    return OutputFunctionCall.build(
        id=_item_id(call["id"]),
        call_id=call["id"],
        name=name,
        arguments=function["arguments"] if arguments is None else arguments,
        status=status,
        namespace=namespace,  # left out of the item when None
    )


# A response object without its tools ends with them and the fixed ``text`` (``Wire.build``
# writes the fields given in the order given, after the defaults: the frame gives ``tools`` and
# ``text`` last), and so does a lifecycle event (its response last), so the tools are written
# back in at a known place: nothing a client sent stands between.
_NO_TOOLS_TAIL = b'"tools":[],"text":{"format":{"type":"text"}}}'
_NO_TOOLS_END = _NO_TOOLS_TAIL + b"}\n\n"


def _with_tools(written: bytes, end: bytes, tools_json: bytes) -> bytes:
    """``written`` (ending with ``end``: its tools ``[]``), with ``tools_json`` for them."""
    if not written.endswith(end):
        raise RuntimeError("a response written without its tools does not end as expected")
    rest = end[len(b'"tools":[]') :]
    return b"".join((written[: -len(end)], b'"tools":', tools_json, rest))


class _EchoedResponse(ResponseObject):
    """A whole response whose tools' JSON its frame holds (``_tools_echo``): written without
    them, that JSON put back in (a coding agent's 63 KB, serialized again on every turn, were
    ~0.07 ms). Its fields are the response's, tools included."""

    _tools_json: bytes = PrivateAttr(b"[]")

    def json_bytes(self) -> bytes:
        bare = ResponseObject.build(**{**self.__dict__, "tools": []})  # the same field order
        return _with_tools(bare.json_bytes(), _NO_TOOLS_TAIL, self._tools_json)


# A session's tools are validated once (``validated_once``: the same list of models every
# turn), and echoed from what was written of them the first time: the dicts and the JSON. The
# 16 lists last echoed (a coding agent's: ~63 KB of JSON each), the least recent dropped.
_ECHOES: OrderedDict[int, tuple[list[Tool], list[JSON], bytes]] = OrderedDict()
ECHOES = 16


def _tools_echo(tools: list[Tool] | None) -> tuple[list[JSON], bytes]:
    """The tools as a response echoes them, and their JSON as the response object writes it."""
    if not tools:
        return [], b"[]"
    entry = _ECHOES.get(id(tools))
    if entry is not None and entry[0] is tools:
        _ECHOES.move_to_end(id(tools))
        return entry[1], entry[2]
    dumped = [t.model_dump(exclude_none=True) for t in tools]
    written = ResponseObject.__pydantic_serializer__.to_json(  # ``{"tools":[...]}``
        ResponseObject.build(tools=dumped), include={"tools"}
    )
    text = written[len(b'{"tools":') : -1]
    _ECHOES[id(tools)] = (tools, dumped, text)
    while len(_ECHOES) > ECHOES:
        _ECHOES.popitem(last=False)
    return dumped, text


class _Frame:
    """What every response object of one request shares: its parameters, echoed.

    A streamed response echoes its tools three times (``response.created``, ``in_progress``
    and the last event, as OpenAI does): a coding agent's 63 KB of tools, serialized by
    pydantic each time, were ~0.07 ms each on a later turn (issue 40, point 2). The streamed
    events are serialized without them and ``spliced`` writes the tools' JSON, written by the
    same serializer once per session (``_tools_echo``), into each."""

    def __init__(self, engine: TurnEngine, req: ResponsesRequest) -> None:
        self.model = answered_as(req.model, engine.model_name)
        self.created_at = int(time.time())
        self.namespaced: Namespaced = req.namespaced_functions
        choice = req.tool_choice
        tools, self._tools_json = _tools_echo(req.tools)
        self.echo: JSON = {
            "instructions": req.instructions,
            "metadata": req.metadata or {},
            "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "tool_choice": choice.model_dump(exclude_none=True)
            if isinstance(choice, FunctionChoice)
            else choice or "auto",
            "tools": tools,
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

    def spliced(self, event: bytes) -> bytes:
        """A lifecycle event serialized from ``response(..., echo_tools=False)``, with the
        tools."""
        return _with_tools(event, _NO_TOOLS_END, self._tools_json)

    def whole(
        self,
        rid: str,
        status: str,
        output: list[OutputMessage | OutputFunctionCall],
        usage: ResponseUsage,
    ) -> ResponseObject:
        """The response of a request not streamed, written with the tools' kept JSON."""
        response = _EchoedResponse.build(**self.response(rid, status, output, usage).__dict__)
        object.__setattr__(response, "__pydantic_private__", {"_tools_json": self._tools_json})
        return response

    def response(
        self,
        rid: str,
        status: str,
        output: list[OutputMessage | OutputFunctionCall],
        usage: ResponseUsage | None = None,
        *,
        echo_tools: bool = True,
    ) -> ResponseObject:
        """The response object; without its tools (``[]``) where not ``echo_tools``, for
        ``spliced``."""
        echo = self.echo if echo_tools else {**self.echo, "tools": []}
        return ResponseObject.build(
            id=rid,
            created_at=self.created_at,
            status=status,
            model=self.model,
            output=output,
            usage=usage,
            incomplete_details=IncompleteDetails.build() if status == "incomplete" else None,
            **echo,
        )


class ResponsesServing:
    """OpenAI Responses over the turn core."""

    def __init__(self, turns: TurnServing, images: ImageEdge | None = None) -> None:
        self.turns = turns
        self.engine = turns.engine
        self.images = images or ImageEdge()

    async def turn_request(
        self, session: Session, req: ResponsesRequest, agent: AgentIdentity | None = None
    ) -> TurnRequest:
        """The request as a turn: its images checked (a 400 naming a bad one), those of the
        conversation ``previous_response_id`` continues from the kept ones."""
        found = responses_images(req)
        images = await self.images.check(found, where="input")
        previous = previous_conversation(session.state, req)
        if previous:
            images |= self.images.kept.bytes_of(
                previous,
                images,
                named=f"previous_response_id {req.previous_response_id!r}",
                param="previous_response_id",
            )
        request = responses_turn_request(req, previous, images)
        return request if agent is None else replace(request, agent=agent)

    async def complete(
        self, session: Session, req: ResponsesRequest, agent: AgentIdentity | None = None
    ) -> ResponseObject:
        request = await self.turn_request(session, req, agent)
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
                OutputMessage.build(id=f"msg_{sid}_{result.reply}", status=status, content=[text])
            )
        frame = _Frame(self.engine, req)
        output += [_function_call(c, "completed", frame.namespaced) for c in result.tool_calls]
        return frame.whole(response_id(sid, result.reply), status, output, _usage(result))

    async def stream(
        self, session: Session, req: ResponsesRequest, agent: AgentIdentity | None = None
    ) -> TurnStream:
        request = await self.turn_request(session, req, agent)
        frame, sid = _Frame(self.engine, req), session.state.id
        return await self.turns.stream(
            session,
            request,
            lambda reply, _prompt_tokens: _ResponsesEncoder(
                self.engine, frame, sid, reply, request
            ),
        )


class _ResponsesEncoder:
    """The typed events of one streamed response. The message item opens with the first
    text (a reply may hold tool calls only); tool calls, the final response and usage come
    after the turn is durable."""

    def __init__(
        self, engine: TurnEngine, frame: _Frame, session: str, reply: str, request: TurnRequest
    ) -> None:
        self.engine = engine
        self.frame = frame
        self.request = request
        self.id = response_id(session, reply)
        self.message_id = f"msg_{session}_{reply}"
        self.sequence = 0
        self.opened = False  # the message item
        self.logprobs: list[TokenLogprob] = []

    def _event(self, event: Any) -> bytes:
        self.sequence += 1
        return sse_event(event.type, event)

    def _lifecycle(self, kind: str, response: ResponseObject) -> bytes:
        """A lifecycle event of ``response`` (made without its tools), with the tools."""
        return self.frame.spliced(
            self._event(
                LifecycleEvent.build(type=kind, sequence_number=self.sequence, response=response)
            )
        )

    def opening(self) -> bytes:
        response = self.frame.response(self.id, "in_progress", [], echo_tools=False)
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
        namespaced = self.frame.namespaced
        for call in result.tool_calls:
            index, item = len(output), _function_call(call, "completed", namespaced)
            output.append(item)
            opened = _function_call(call, "in_progress", namespaced, "")
            out += [
                self._item("response.output_item.added", index, opened),
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
        response = self.frame.response(self.id, status, output, _usage(result), echo_tools=False)
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
