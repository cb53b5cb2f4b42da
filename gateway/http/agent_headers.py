"""The agent identity a request's headers carry (Claude Code's, Codex's, turnstream's own), read
into ``gateway.core.agents.AgentIdentity``. PURE: headers in, identity out.

(A stub until issue 35's edge lands: it reads nothing yet.)
"""

from __future__ import annotations

from collections.abc import Mapping

from gateway.core.agents import AgentIdentity

__all__ = ["agent_identity"]


def agent_identity(headers: Mapping[str, str]) -> AgentIdentity | None:
    """The identity ``headers`` name (ASGI-lowercased names); None: they name none."""
    return None
