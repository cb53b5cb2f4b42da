"""The agent identity a request's headers carry (Claude Code's, Codex's, turnstream's own), read
into ``gateway.core.agents.AgentIdentity``. PURE: headers in, identity out.

What the CLIs send was measured (``../shared/agent-clis/subagents/README.md``, sections 1-3):

=============================  ===============================  ==================================
                               Claude Code 2.1.328              Codex CLI 0.169.0
=============================  ===============================  ==================================
the agent (its conversation)   ``x-claude-code-agent-id``;      ``thread-id`` (=
                               absent: the main agent           ``x-client-request-id``), with
                               (``main``)                       ``session-id``
its parent                     ``x-claude-code-parent-agent-    ``x-codex-parent-thread-id``;
                               id``; absent: ``main`` for a     absent: a root thread
                               sub-agent
fork / fresh                   ``x-claude-code-agent-type``     ``x-codex-turn-metadata`` JSON:
                               ``fork`` / another type (opt-in  ``history_initialization``
                               hint headers)                    ``warm_fork`` / ``new``
request class                  ``x-claude-code-request-class``  ``subagent`` when
                               (opt-in)                         ``x-openai-subagent`` is sent
prompt id                      ``x-claude-code-prompt-id``      metadata ``root_turn_id`` (a
                                                                root's ``turn_id``)
=============================  ===============================  ==================================

Any other client names its agents with ``X-Turnstream-Agent`` (and ``X-Turnstream-Parent-Agent``,
``X-Turnstream-Agent-Kind``, ``X-Turnstream-Request-Class``); these take precedence over the
CLIs' headers, and the kind and request class alone relabel a CLI's request (a proxy marking a
compaction call). A request with none of them has no identity (None): the gateway attributes
it by its tokens alone, as before.

Input at the edge (issue 35's hostile client): an agent or parent id that is empty after
trimming counts as absent; one longer than 128 characters or holding a character that is not
printable is refused (``InvalidRequest`` naming the header, a 400). Labels (kind, type, request
class, prompt id) are the client's free text: their unprintable characters are dropped and they
are cut to 64 (prompt id 128) characters rather than refused. Header values reach Python as
latin-1 (ASGI); a value whose bytes are UTF-8 is read as UTF-8, so an id is the text the client
meant. A malformed ``x-codex-turn-metadata`` is ignored, never an error: it only refines what
the ids say.

>>> agent_identity({"x-claude-code-session-id": "s1"})
AgentIdentity(id='main', parent=None, kind='main', type='', request_class='', source='claude_code', prompt_id='')
>>> agent_identity({"x-turnstream-agent": "critic", "x-turnstream-parent-agent": "main"}).record()
{'id': 'critic', 'parent': 'main', 'source': 'turnstream'}
>>> agent_identity({"content-type": "application/json"}) is None
True
"""  # noqa: E501

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from gateway.core.agents import MAIN_AGENT, AgentIdentity
from gateway.errors import InvalidRequest

__all__ = ["AGENT_HEADERS", "MAX_AGENT_ID", "MAX_LABEL", "agent_identity"]

MAX_AGENT_ID = 128
"""The longest agent id (or parent id) accepted: Claude Code's are 17 characters, Codex's 36."""
MAX_LABEL = 64
"""Free-text labels (kind, type, request class) are cut to this many characters."""
_MAX_PROMPT_ID = 128

# turnstream's own
AGENT = "x-turnstream-agent"
PARENT_AGENT = "x-turnstream-parent-agent"
AGENT_KIND = "x-turnstream-agent-kind"
REQUEST_CLASS = "x-turnstream-request-class"
# Claude Code
CC_SESSION = "x-claude-code-session-id"
CC_AGENT = "x-claude-code-agent-id"
CC_PARENT = "x-claude-code-parent-agent-id"
CC_AGENT_TYPE = "x-claude-code-agent-type"
CC_REQUEST_CLASS = "x-claude-code-request-class"
CC_PROMPT = "x-claude-code-prompt-id"
# Codex
CODEX_SESSION = "session-id"
CODEX_THREAD = "thread-id"
CODEX_REQUEST = "x-client-request-id"
CODEX_PARENT = "x-codex-parent-thread-id"
CODEX_METADATA = "x-codex-turn-metadata"
CODEX_SUBAGENT = "x-openai-subagent"

AGENT_HEADERS = (
    *(AGENT, PARENT_AGENT, AGENT_KIND, REQUEST_CLASS),
    *(CC_SESSION, CC_AGENT, CC_PARENT, CC_AGENT_TYPE, CC_REQUEST_CLASS, CC_PROMPT),
    *(CODEX_SESSION, CODEX_THREAD, CODEX_REQUEST, CODEX_PARENT, CODEX_METADATA, CODEX_SUBAGENT),
)
"""Every header this module reads (lowercase, as ASGI gives them)."""
_AGENT_HEADER_NAMES = frozenset(AGENT_HEADERS)

_CODEX_ROOT_NAME = "/root"  # every v1 agent's agent_name, and a v2 root's: names no one


def agent_identity(headers: Mapping[str, str]) -> AgentIdentity | None:
    """The identity ``headers`` name (ASGI-lowercased names); None: they name none.

    Raises InvalidRequest (400, ``param`` the header) for an agent or parent id that is too long
    or not printable, or turnstream's agent headers naming no agent.
    """
    if _AGENT_HEADER_NAMES.isdisjoint(headers.keys()):
        # None of them (most clients' every request): one pass over the names, where reading
        # each of the 16 would scan the request's headers 16 times (Starlette's ``Headers``).
        return None
    own = _turnstream(headers)
    if own is not None:
        return own
    cli = _claude_code(headers) or _codex(headers)
    kind, request_class = _label(headers, AGENT_KIND), _label(headers, REQUEST_CLASS)
    if _present(headers, PARENT_AGENT) or ((kind or request_class) and cli is None):
        named = (
            PARENT_AGENT
            if _present(headers, PARENT_AGENT)
            else (AGENT_KIND if kind else REQUEST_CLASS)
        )
        raise InvalidRequest(
            f"the {named} header names no agent: send X-Turnstream-Agent (the agent's id in its "
            f"session, e.g. 'main') with it",
            param=AGENT,
        )
    if cli is not None and (kind or request_class):
        # A proxy in front of the CLI labelling its requests (a compaction call, say).
        return replace(cli, kind=kind or cli.kind, request_class=request_class or cli.request_class)
    return cli


def _turnstream(headers: Mapping[str, str]) -> AgentIdentity | None:
    agent = _agent_id(headers, AGENT)
    if agent is None:
        return None
    parent = _agent_id(headers, PARENT_AGENT)
    if parent == agent:
        raise _own_parent(PARENT_AGENT, agent)
    return AgentIdentity(
        agent,
        parent=parent,
        kind=_label(headers, AGENT_KIND) or ("main" if parent is None else ""),
        request_class=_label(headers, REQUEST_CLASS),
        source="turnstream",
    )


def _claude_code(headers: Mapping[str, str]) -> AgentIdentity | None:
    agent = _agent_id(headers, CC_AGENT)
    if agent is None and not _present(headers, CC_SESSION):
        return None
    # The main agent sends no agent id; a sub-agent no parent id when its parent is main.
    parent = _agent_id(headers, CC_PARENT)
    if agent is not None and parent is None:
        parent = MAIN_AGENT
    if agent is not None and parent == agent:
        raise _own_parent(CC_PARENT if _present(headers, CC_PARENT) else CC_AGENT, agent)
    agent_type = _label(headers, CC_AGENT_TYPE)
    if agent is None:
        kind = "main"
    elif agent_type:  # the opt-in hint headers (CLAUDE_CODE_GATEWAY_HINT_HEADERS=1)
        kind = "fork" if agent_type == "fork" else "fresh"
    else:
        kind = ""  # a sub-agent that does not say: its tokens will
    return AgentIdentity(
        agent or MAIN_AGENT,
        parent=parent if agent is not None else None,
        kind=kind,
        type=agent_type,
        request_class=_label(headers, CC_REQUEST_CLASS),
        source="claude_code",
        prompt_id=_label(headers, CC_PROMPT, _MAX_PROMPT_ID),
    )


def _codex(headers: Mapping[str, str]) -> AgentIdentity | None:
    thread_header = CODEX_THREAD if _present(headers, CODEX_THREAD) else CODEX_REQUEST
    thread = _agent_id(headers, thread_header)
    if thread is None or not _present(headers, CODEX_SESSION):
        return None
    parent = _agent_id(headers, CODEX_PARENT)
    if parent == thread:
        raise _own_parent(CODEX_PARENT, thread)
    metadata = _turn_metadata(headers.get(CODEX_METADATA))
    sub_agent = parent is not None or metadata.get("thread_source") == "subagent"
    history = metadata.get("history_initialization")
    if history == "warm_fork":
        kind = "fork"
    elif history == "new" and sub_agent:
        kind = "fresh"
    elif not sub_agent:  # "new" or "cold_resume" (codex exec resume) of a root, or unsaid
        kind = "main"
    else:
        kind = ""
    name = _clean(metadata.get("agent_name"), MAX_LABEL)
    prompt_id = metadata.get("root_turn_id") or ("" if sub_agent else metadata.get("turn_id"))
    return AgentIdentity(
        thread,
        parent=parent,
        kind=kind,
        type="" if name == _CODEX_ROOT_NAME else name,
        request_class="subagent" if _present(headers, CODEX_SUBAGENT) else "main",
        source="codex",
        prompt_id=_clean(prompt_id, _MAX_PROMPT_ID),
    )


def _turn_metadata(text: str | None) -> dict[str, Any]:
    """Codex's ``x-codex-turn-metadata`` object; {} when absent or not a JSON object."""
    if not text:
        return {}
    try:
        value = json.loads(_as_sent(text))
    except (ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


def _present(headers: Mapping[str, str], name: str) -> bool:
    value = headers.get(name)
    return value is not None and value.strip() != ""


def _as_sent(value: str) -> str:
    """The header's text as the client wrote it: ASGI decodes header bytes as latin-1, so a
    UTF-8 value arrives as mojibake; read its bytes as UTF-8 when they are UTF-8."""
    try:
        return value.encode("latin-1").decode("utf-8")
    except UnicodeError:  # not latin-1 (a str built in Python), or not UTF-8: as it is
        return value


def _agent_id(headers: Mapping[str, str], name: str) -> str | None:
    value = headers.get(name)
    if value is None or not value.strip():
        return None
    text = _as_sent(value.strip())
    if len(text) > MAX_AGENT_ID:
        raise InvalidRequest(
            f"the {name} header is {len(text)} characters long; an agent id may have at most "
            f"{MAX_AGENT_ID}: send a shorter id (or none, for a client without sub-agents)",
            param=name,
        )
    if not text.isprintable():
        bad = next(c for c in text if not c.isprintable())
        raise InvalidRequest(
            f"the {name} header holds the unprintable character {bad!r}; an agent id must be "
            f"printable text",
            param=name,
        )
    return text


def _own_parent(name: str, agent: str) -> InvalidRequest:
    return InvalidRequest(
        f"the {name} header makes agent {agent!r} its own parent: name its parent agent (or "
        f"none, for a root agent)",
        param=name,
    )


def _label(headers: Mapping[str, str], name: str, limit: int = MAX_LABEL) -> str:
    value = headers.get(name)
    return _clean(_as_sent(value), limit) if value is not None else ""


def _clean(value: object, limit: int) -> str:
    """A label as recorded: text only, its unprintable characters dropped, at most ``limit``."""
    if not isinstance(value, str):
        return ""
    return "".join(c for c in value.strip() if c.isprintable())[:limit]
