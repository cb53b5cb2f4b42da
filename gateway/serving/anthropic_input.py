"""Anthropic Messages, the request's side: the conversation as the turn core's canonical one,
its image blocks and where each is (for the edge's check), the request as a ``TurnRequest``
(``anthropic_service`` answers the turn).

The canonical conversation is the same whichever way a client serializes its history:

- ``system`` (a string or text blocks) is one leading system message; a ``role: "system"``
  message inside ``messages`` stays where it is. Text blocks are joined with "" (a string and
  its blocks give the same message); ``cache_control`` and other block decorations are dropped.
- A user message's ``tool_result`` blocks become tool messages (``tool_call_id`` = its
  ``tool_use_id``, ``content`` its text; ``is_error`` is not recorded), first, as Anthropic
  requires them first; its text and image blocks follow as one user message. Content with an
  image (a user's, or a tool result's: a computer-use agent's screenshot) keeps its blocks as
  canonical parts, in order (``image_input.content_parts``); text alone is joined, as always.
- An assistant message's text is its content, its ``tool_use`` blocks its tool calls
  (``arguments`` = the input as compact JSON, as the tool parsers write it), its thinking blocks
  are dropped: the reply the gateway sent comes back as the message the turn recorded.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from gateway.core.agents import AgentIdentity
from gateway.core.conversation import TurnRequest
from gateway.protocol.anthropic import (
    CountTokensRequest,
    CustomTool,
    ImageBlock,
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
from gateway.serving.image_input import FoundImage, content_parts

__all__ = [
    "anthropic_images",
    "billing_header",
    "canonical_messages",
    "canonical_tools",
    "messages_turn_request",
    "tool_choice",
]

JSON = dict[str, Any]


def anthropic_images(req: MessagesRequest | CountTokensRequest) -> Iterator[FoundImage]:
    """The request's image blocks (a user message's, a tool result's), where each is."""
    for i, message in enumerate(req.messages):
        if not isinstance(message, UserTurn) or isinstance(message.content, str):
            continue
        for j, block in enumerate(message.content):
            if isinstance(block, ImageBlock):
                yield f"messages[{i}].content[{j}].source", block
            elif isinstance(block, ToolResultBlock) and isinstance(block.content, list):
                for k, inner in enumerate(block.content):
                    if isinstance(inner, ImageBlock):
                        yield f"messages[{i}].content[{j}].content[{k}].source", inner


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


def _user_messages(
    content: str | Sequence[TextBlock | ImageBlock | ToolResultBlock],
) -> list[JSON]:
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    out: list[JSON] = [
        {"role": "tool", "tool_call_id": b.tool_use_id, "content": _said(b.content)}
        for b in content
        if isinstance(b, ToolResultBlock)
    ]
    said = [b for b in content if isinstance(b, TextBlock | ImageBlock)]
    if said or not out:
        out.append({"role": "user", "content": _said(said)})
    return out


def _said(content: str | Sequence[TextBlock | ImageBlock] | None) -> str | list[JSON]:
    """Text and image blocks as a message's content (``content_parts``)."""
    if content is None or isinstance(content, str):
        return content or ""
    return content_parts(b.text if isinstance(b, TextBlock) else b for b in content)


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


def tool_choice(req: MessagesRequest | CountTokensRequest) -> tuple[str | JSON | None, bool]:
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


def messages_turn_request(
    req: MessagesRequest,
    agent: AgentIdentity | None = None,
    images: Mapping[str, bytes] | None = None,
) -> TurnRequest:
    """A Messages request as the canonical turn request (``agent``: who asks, from its
    headers; ``images``: its images' bytes by digest, ``check_images`` of
    ``anthropic_images``). ``extras`` records what the turn cannot honour but a client's retry
    resends unchanged (never ``stream``)."""
    choice, parallel = tool_choice(req)
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
        images=images or {},
    )
