"""Which kept turn of a session a request continues or repeats, and how a turn joins the tree.

Read-only questions asked of a session's state (``gateway.core.aggregate.SessionState``) on the
way in (``continued_turn``: the conversation a request extends furthest; ``resent_turn``: a
client's resend of a conversation's tip) and on the way out (``attachment``: the metric's
label). PURE.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from gateway.core.aggregate import JSON, SessionState, TurnNode
from gateway.core.conversation import MessageKey, message_keys
from schemas.events import TurnCompleted

__all__ = ["Attachment", "attachment", "continued_turn", "resent_turn"]

Attachment = Literal["continued", "branched", "new"]


def continued_turn(
    state: SessionState,
    messages: Sequence[JSON],
    tools: list[JSON] | None,
    keys: Sequence[MessageKey] | None = None,
) -> TurnNode | None:
    """The kept turn whose conversation ``messages`` extends furthest (a strict prefix under
    ``message_key``, with the same tools); ties go to the most recent. ``keys``: the messages'
    keys, where the caller has them (the request's, ``TurnRequest.keys``)."""
    keys = message_keys(messages) if keys is None else tuple(keys)
    n = len(keys)
    # The longest first (ties: the most recent), so the first that matches is the one: in a
    # linear session every earlier turn's conversation is a prefix too, and comparing each of
    # them in full (a long first message in each) made a turn's cost grow with its context.
    for node in sorted(state.nodes.values(), key=_length_then_turn, reverse=True):
        m = len(node.keys)
        if not 0 < m < n or node.event.request.get("api") == "completions":
            continue
        # Cheap tests first: the reply (the conversation's last message) is what differs most;
        # then the rest from the end, where conversations differ (their first messages, e.g. a
        # long system prompt or task, are what sub-agents share).
        if (
            node.keys[-1] == keys[m - 1]
            and node.tools == tools
            and node.keys[::-1] == keys[m - 1 :: -1]
        ):
            return node
    return None


def _length_then_turn(node: TurnNode) -> tuple[int, int]:
    return len(node.keys), node.turn


def resent_turn(
    state: SessionState,
    messages: Sequence[JSON],
    tools: list[JSON] | None,
    record: JSON,
    keys: Sequence[MessageKey] | None = None,
) -> TurnCompleted | None:
    """The kept turn whose request ``messages``/``tools``/``record`` is again (a client's
    retry: after a 5xx, a cut stream, a lost reply), else None.

    Clients resend the same request when they did not get (all of) the answer; answering it
    with the recorded turn keeps one model call one turn. Only a conversation's tip qualifies
    (a turn no later turn continued: e.g. the main agent's last turn after a sub-agent took
    one); the request of a turn that was continued is a new turn, a retry that branches.
    ``keys``: as for ``continued_turn``."""
    if not record:
        return None  # events older than TurnCompleted.request: never a resend
    tools = tools or None
    asked = None if keys is None else tuple(keys)
    for node in sorted(state.nodes.values(), key=lambda n: n.turn, reverse=True):
        if node.continued or len(node.keys) != len(messages) + 1:
            continue
        if node.event.request != record or node.tools != tools:
            continue
        asked = message_keys(messages) if asked is None else asked
        if node.keys[:-1] == asked:
            return node.event
    return None


def attachment(state: SessionState, event: TurnCompleted) -> Attachment:
    """How ``event`` (not yet applied) joins the tree: it continues a conversation's tip, it
    branches off a kept turn (a second continuation, an edited history), or it is new."""
    if event.parent < 0:
        return "new"
    node = state.nodes.get(event.parent)
    if node is not None and not node.continued and event.prefix_len == len(node.context_ids):
        return "continued"
    return "branched"
