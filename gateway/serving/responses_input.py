"""OpenAI Responses, the request's side: input items as chat messages, the request as a
``TurnRequest``, response ids, and the conversation ``previous_response_id`` continues
(``responses_service`` answers the turn).

Input items become chat messages: a message item is a message (its text parts joined; one
with an ``input_image`` keeps its parts in order, ``image_input.content_parts``), the
``function_call`` items that follow an assistant message item (or each other) join it as ONE
assistant message with tool calls, a ``function_call_output`` is a tool message, an
``agent_message`` a user message, ``reasoning`` items are dropped. An output's images (a
computer-use tool's screenshot) are its tool message's, as a message's are. A namespace's
function is called by its flattened name (``<namespace>__<name>``), as it was offered to the model,
whether or not this request offers the namespace (a Codex sub-agent's copy of its parent's
history holds the parent's calls, not its tools). So the output items of a response, echoed
back verbatim or re-serialized, are exactly the reply the turn recorded, and the next turn
extends it token for token.

Response ids name the session and the request (``resp_<session>_<reply>``: the turn's
``TurnCompleted.reply``, its per-request ``reply_id``, made before the turn's index is known;
events older than it use the turn index, and their ids keep working); a resent request gets its
turn again under the same id.

``previous_response_id`` continues that response's conversation (its messages, its reply, then
the new input), token for token. It is served from the session's state, which keeps the session's
most recently used turns (``--session-turns-kept``): any kept response can be continued, the
latest or an earlier one (a branch). A response no longer kept is refused with a 400 naming
it: the log holds it, but the turn core offers no read of a session's events to the adapters,
so the client resends the full conversation as input. The images of that conversation are
not resent either: their bytes come from the gateway's memory of recent images
(``image_input.KeptImages``), and one it forgot is a 400 of the same kind.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from gateway.core.aggregate import SessionState
from gateway.core.conversation import TurnRequest
from gateway.errors import InvalidRequest
from gateway.protocol.responses import (
    RESPONSE_ID,
    AgentMessageItem,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionChoice,
    HostedTool,
    MessageItem,
    NamespaceTool,
    ResponsesRequest,
    item_text,
)
from gateway.protocol.responses_items import InputImagePart, content_items
from gateway.serving.image_input import FoundImage, content_parts

__all__ = [
    "input_messages",
    "parse_response_id",
    "previous_conversation",
    "response_id",
    "responses_images",
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


def response_id(session: str, reply: str) -> str:
    """The id of a session's turn's response, from its ``reply`` id (a resend of it gets the
    same id).

    >>> response_id("s_1", "9f3a0c17e2b4")
    'resp_s_1_9f3a0c17e2b4'
    """
    return f"resp_{session}_{reply}"


def parse_response_id(value: str) -> tuple[str, str]:
    """The session and reply id a response id names (session ids may hold ``_``: the reply is
    what follows the last one).

    >>> parse_response_id("resp_s_1_9f3a0c17e2b4"), parse_response_id("resp_s_3")
    (('s_1', '9f3a0c17e2b4'), ('s', '3'))
    """
    if not _RESPONSE_ID.match(value):
        raise InvalidRequest(
            f"previous_response_id {value[:80]!r} is not a response id of this gateway "
            "(resp_<session>_<reply>)",
            param="previous_response_id",
        )
    session, _, reply = value[len("resp_") :].rpartition("_")
    return session, reply


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

    for i, item in enumerate(items):
        if isinstance(item, MessageItem):
            said = content_items(item.content)
            if item.role != "assistant":
                flush()
                messages.append({"role": item.role, "content": _content(said)})
                continue
            if not isinstance(said, str) and not all(isinstance(p, str) for p in said):
                raise InvalidRequest(
                    f"input[{i}] is an assistant message with an input_image: the model's own "
                    "messages hold text; send the image in a user message",
                    param=f"input[{i}].content",
                )
            text = item_text(item.content)
            if assistant is not None and not assistant.get("tool_calls"):
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
                    "function": {"name": item.function, "arguments": item.arguments},
                }
            )
        elif isinstance(item, AgentMessageItem):
            flush()
            messages.append({"role": "user", "content": item_text(item.content)})
        elif isinstance(item, FunctionCallOutputItem):
            flush()
            content = _content(content_items(item.output))
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": content})
        # reasoning items: dropped, and they do not split an assistant message
    flush()
    return messages


def _content(said: str | Sequence[str | Any]) -> str | list[JSON]:
    return said if isinstance(said, str) else content_parts(said)


def responses_images(req: ResponsesRequest) -> Iterator[FoundImage]:
    """The request's ``input_image`` parts (a message's, a function call output's), where each
    is."""
    items: str | Sequence[object] = req.input
    if isinstance(items, str):
        return
    for i, item in enumerate(items):
        parts: str | Sequence[object] = ""
        if isinstance(item, MessageItem):
            parts, field = item.content, "content"
        elif isinstance(item, FunctionCallOutputItem):
            parts, field = item.output, "output"
        if isinstance(parts, str):
            continue
        for j, part in enumerate(parts):
            if isinstance(part, InputImagePart):
                yield f"input[{i}].{field}[{j}].image_url", part


def _with_instructions(base: Sequence[JSON], instructions: str | None) -> list[JSON]:
    """``instructions`` as the leading system message: in place of the previous one (a
    previous response's instructions do not carry over), else first."""
    if instructions is None:
        return list(base)
    system = {"role": "system", "content": instructions}
    if base and base[0].get("role") == "system":
        return [system, *base[1:]]
    return [system, *base]


def responses_turn_request(
    req: ResponsesRequest,
    previous: Sequence[JSON] = (),
    images: Mapping[str, bytes] | None = None,
) -> TurnRequest:
    """A Responses request as the canonical turn request; ``previous`` is the conversation
    ``previous_response_id`` continues (its messages and its reply); ``images``: the bytes of
    the images of both, by digest (``check_images`` of ``responses_images``, and the kept
    bytes of the previous conversation's)."""
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
    namespaces = [_namespace_record(t) for t in req.tools or () if isinstance(t, NamespaceTool)]
    if namespaces:
        extras["tool_namespaces"] = namespaces
    return TurnRequest(
        api="responses",
        messages=messages,
        model=req.model,
        tools=tools or None,
        tool_choice=(
            {"type": "function", "function": {"name": choice.function}}
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
        images=images or {},
    )


def _namespace_record(tool: NamespaceTool) -> JSON:
    """What a turn records of a namespace (its functions are offered, flattened): which
    functions it grouped, and its description, which the model does not read."""
    record: JSON = {"name": tool.name, "functions": [f.name for f in tool.tools]}
    if tool.description is not None:
        record["description"] = tool.description
    return record


def previous_conversation(state: SessionState, req: ResponsesRequest) -> list[JSON]:
    """The conversation ``req.previous_response_id`` continues, from the session's state.

    Read without the session's lock: a turn taken meanwhile makes this request a branch from
    the response it named, which is what it asked for. A resent request rebuilds the same
    conversation, so it is answered with its recorded turn
    (``gateway.core.branches.resent_turn``)."""
    previous = req.previous_response_id
    if previous is None:
        return []
    session, reply = parse_response_id(previous)
    if session != state.id:
        raise InvalidRequest(
            f"previous_response_id {previous!r} is a response of session {session!r}, not of "
            f"this request's session {state.id!r}",
            param="previous_response_id",
        )
    node = next((n for n in state.nodes.values() if n.event.reply == reply), None)
    if node is None:
        raise InvalidRequest(
            f"previous_response_id {previous!r}: session {state.id!r} holds no such response "
            f"(the gateway keeps a session's {state.kept.turns} most recently used turns, "
            f"{state.kept.tokens} tokens at most, of its {state.turns}); resend the full "
            "conversation as input, without previous_response_id",
            param="previous_response_id",
        )
    if node.event.request.get("api") == "completions":
        raise InvalidRequest(
            f"previous_response_id {previous!r} names a text completion, not a response",
            param="previous_response_id",
        )
    return list(node.conversation)
