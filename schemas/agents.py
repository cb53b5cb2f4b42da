"""What the gateway, the fold and the trainer sink share about the agents of a session. PURE.

A turn's ``TurnCompleted.agent`` records who in a session's tree of agents asked for it, as its
client said (``gateway.core.agents.AgentIdentity.record``) and as the gateway resolved it. The
gateway labels a side request by its class; the fold gives a side request a trajectory of its
own (never a chain to continue); the sink and ``turnstream export`` leave those rows out of
training unless asked. One set, here, so the three agree (the fold and the sink must not import
the gateway).

>>> is_side_class("compaction"), is_side_class("subagent"), is_side_class("")
(True, False, False)
>>> is_side_call({"side": True, "request_class": "compaction"}), is_side_call({"side": "yes"})
(True, False)
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["SIDE_CLASSES", "is_side_call", "is_side_class"]

SIDE_CLASSES = frozenset({"compaction", "auxiliary", "side_reply", "count_tokens"})
"""Request classes that are not the agent's own turns (Claude Code's
``x-claude-code-request-class``; ``X-Turnstream-Request-Class``): recorded and labelled, left out
of training rows by default."""


def is_side_class(request_class: object) -> bool:
    """Whether ``request_class`` (as recorded: any JSON value) names a side request."""
    return isinstance(request_class, str) and request_class in SIDE_CLASSES


def is_side_call(metadata: Mapping[str, object]) -> bool:
    """Whether a trajectory's metadata says the fold made it of a side request (``side: true``):
    kept in the shards, left out of training rows unless asked (``keep_side_calls``)."""
    return metadata.get("side") is True
