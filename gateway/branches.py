"""Which kept turn of a session a request continues or repeats, and how a turn joins the tree.

Read-only questions asked of a session's state (``gateway.turns.SessionState``) on the way in
(``continued_turn``: the conversation a request extends furthest; ``resent_turn``: a client's
resend of a conversation's tip) and on the way out (``attachment``: the metric's label). PURE.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from gateway.turns import JSON, MessageKey, SessionState, TurnNode, message_keys
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
    keys, when the caller has them."""
    keys = message_keys(messages) if keys is None else tuple(keys)
    n = len(keys)
    best: TurnNode | None = None
    for node in state.nodes.values():
        m = len(node.keys)
        if not 0 < m < n or node.event.request.get("api") == "completions":
            continue
        if best is not None and (m, node.turn) < (len(best.keys), best.turn):
            continue
        # Cheap tests first: the reply (the conversation's last message) is what differs most.
        if node.keys[-1] != keys[m - 1] or node.tools != tools or keys[:m] != node.keys:
            continue
        best = node
    return best


def resent_turn(
    state: SessionState, messages: Sequence[JSON], tools: list[JSON] | None, record: JSON
) -> TurnCompleted | None:
    """The kept turn whose request ``messages``/``tools``/``record`` is again (a client's
    retry: after a 5xx, a cut stream, a lost reply), else None.

    Clients resend the same request when they did not get (all of) the answer; answering it
    with the recorded turn keeps one model call one turn. Only a conversation's tip qualifies
    (a turn no later turn continued: e.g. the main agent's last turn after a sub-agent took
    one); the request of a turn that was continued is a new turn, a retry that branches."""
    if not record:
        return None  # events older than TurnCompleted.request: never a resend
    tools = tools or None
    keys: tuple[MessageKey, ...] | None = None
    for node in sorted(state.nodes.values(), key=lambda n: n.turn, reverse=True):
        if node.continued or len(node.keys) != len(messages) + 1:
            continue
        if node.event.request != record or node.tools != tools:
            continue
        keys = message_keys(messages) if keys is None else keys
        if node.keys[:-1] == keys:
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
