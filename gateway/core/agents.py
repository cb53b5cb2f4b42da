"""Who in a session's tree of agents asked for a turn, as its client said (PURE).

Coding agents run sub-agents through one session (DESIGN §4, "Identity comes from the client"):
Claude Code names each sub-agent (``x-claude-code-agent-id``, its parent in
``x-claude-code-parent-agent-id``; the main agent sends none), Codex each thread (``thread-id``,
``x-codex-parent-thread-id``, ``x-codex-turn-metadata``), any other client may send
``X-Turnstream-Agent`` / ``X-Turnstream-Parent-Agent``. The HTTP edge reads them into an
``AgentIdentity`` (``gateway.http.agent_headers``); the core uses it to attribute the turn to its
conversation and records it (``TurnCompleted.agent``), the fold names it in the trajectory.

A claim, not a fact: the tokens decide where they contradict it (the core records both).

>>> AgentIdentity("a9e64a5ca0980ef44", parent="main", kind="fork", source="claude_code").record()
{'id': 'a9e64a5ca0980ef44', 'parent': 'main', 'kind': 'fork', 'source': 'claude_code'}
>>> AgentIdentity("main", request_class="compaction").side
True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from schemas.agents import SIDE_CLASSES

__all__ = ["MAIN_AGENT", "SIDE_CLASSES", "AgentIdentity"]

JSON = dict[str, Any]

MAIN_AGENT = "main"
"""The key of a client's root agent where the client names it by omission (Claude Code's main
agent sends no agent id)."""


@dataclass(frozen=True, slots=True)
class AgentIdentity:
    """One agent's conversation in a session's tree, as the client named it."""

    id: str
    """The conversation's key in its session: Claude Code's agent id (``main`` for the main
    agent), Codex's thread id, ``X-Turnstream-Agent``."""
    parent: str | None = None
    """Its parent agent's key; None: a root agent (or the client did not say)."""
    kind: str = ""
    """What the client says it is: ``main``, ``fork`` (starts from a copy of its parent's
    history) or ``fresh`` (a new conversation); "" when it says nothing."""
    type: str = ""
    """The client's own name for the agent's kind (Claude Code's agent type, e.g.
    ``general-purpose``; Codex v2's ``agent_name``, e.g. ``/root/fork``)."""
    request_class: str = ""
    """The client's class of the request (``main``, ``subagent``, ``compaction``, ``auxiliary``,
    ``side_reply``, ``workflow``); "" when it says nothing."""
    source: str = ""
    """Which headers said so: ``claude_code``, ``codex`` or ``turnstream``."""
    prompt_id: str = ""
    """What groups the requests one user prompt caused (Claude Code's prompt id, Codex's root
    turn id); "" when not sent."""

    @property
    def side(self) -> bool:
        """A side request (compaction, auxiliary, side reply): not the agent's own turn."""
        return self.request_class in SIDE_CLASSES

    def record(self) -> JSON:
        """The identity as ``TurnCompleted.agent`` records it (empty fields left out)."""
        fields = {
            "id": self.id,
            "parent": self.parent,
            "kind": self.kind,
            "type": self.type,
            "request_class": self.request_class,
            "source": self.source,
            "prompt_id": self.prompt_id,
        }
        return {k: v for k, v in fields.items() if v}
