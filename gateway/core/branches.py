"""Which kept turn of a session a request continues or repeats, and how a turn joins the tree.

Read-only questions asked of a session's state (``gateway.core.aggregate.SessionState``) on the
way in (``placement``: where a request joins the tree, by its agent's identity and its tokens;
``continued_turn``: the conversation a request extends furthest; ``resent_turn``: a client's
resend of a conversation's tip) and on the way out (``attachment``: the metric's label). PURE.

Identity first, tokens last (DESIGN §4, "Identity comes from the client"): a known agent's turn
continues that agent's own conversation; a new agent's first turn is a fork of its parent agent's
spawning turn or a fresh conversation, as its messages say; where the client's claim and the
tokens disagree the tokens decide and the disagreement is recorded (``Placement.mismatch``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from gateway.core.agents import MAIN_AGENT, AgentIdentity
from gateway.core.aggregate import JSON, SessionState, TurnNode
from gateway.core.conversation import MessageKey, message_keys
from schemas.events import TurnCompleted

__all__ = [
    "Attachment",
    "Placement",
    "attachment",
    "continued_turn",
    "owned_by",
    "placement",
    "resent_turn",
]

Attachment = Literal["continued", "branched", "new"]


def owned_by(node: TurnNode, agent: str | None) -> bool:
    """Whether kept turn ``node`` is a turn of agent ``agent`` (None: of no named agent). A turn
    recorded without an identity counts as the main agent's too: a client's main agent names
    itself by sending nothing (Claude Code), so its sub-agents' parent is ``main``."""
    owner = node.event.agent.get("id")
    return owner == agent or (owner is None and agent == MAIN_AGENT)


def continued_turn(
    state: SessionState,
    messages: Sequence[JSON],
    tools: list[JSON] | None,
    keys: Sequence[MessageKey] | None = None,
    among: Iterable[TurnNode] | None = None,
) -> TurnNode | None:
    """The kept turn whose conversation ``messages`` extends furthest (a strict prefix under
    ``message_key``, with the same tools); ties go to the most recent. ``keys``: the messages'
    keys, where the caller has them (the request's, ``TurnRequest.keys``); ``among``: the nodes
    to consider (default: all kept). A turn whose client went away (``client_gone``) is never
    continued: its client never saw it, so a conversation extending it is a coincidence."""
    keys = message_keys(messages) if keys is None else tuple(keys)
    n = len(keys)
    nodes = state.nodes.values() if among is None else among
    # The longest first (ties: the most recent), so the first that matches is the one: in a
    # linear session every earlier turn's conversation is a prefix too, and comparing each of
    # them in full (a long first message in each) made a turn's cost grow with its context.
    for node in sorted(nodes, key=_length_then_turn, reverse=True):
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
            and not node.event.client_gone
        ):
            return node
    return None


def _length_then_turn(node: TurnNode) -> tuple[int, int]:
    return len(node.keys), node.turn


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a request joins its session's tree (``placement``)."""

    continued: TurnNode | None  # the kept turn its prompt extends token for token; None: rendered
    # The delta base of a rendered prompt where the identity chose one (a fork's spawning turn);
    # None: the kept turn sharing the longest token prefix (``prefix_parent``).
    base: int | None = None
    resolved_kind: str = ""  # "main" | "fork" | "fresh"; "" without an identity
    mismatch: str = ""  # how the tokens contradicted the client's claim; "" where they agreed
    # A turn this copy of the session lacks (another gateway's) could place it otherwise: ask
    # the log first (``unsure``).
    unsure: bool = False

    def record(self, agent: AgentIdentity | None) -> JSON:
        """``TurnCompleted.agent``: the identity as sent, and how the tokens resolved it."""
        if agent is None:
            return {}
        recorded: JSON = {**agent.record(), "resolved_kind": self.resolved_kind}
        if self.mismatch:
            recorded["mismatch"] = self.mismatch
        return recorded


def placement(
    state: SessionState,
    messages: Sequence[JSON],
    tools: list[JSON] | None,
    keys: Sequence[MessageKey],
    agent: AgentIdentity | None,
) -> Placement:
    """``_placement``, with whether a turn this copy lacks could change it (``unsure``): the
    messages after the conversation it continues hold an assistant message (a reply this copy
    may not know: a turn another gateway served), or it is a sub-agent's first turn here (its
    parent's spawning turn, or its own earlier turns, may be another gateway's). Where neither
    holds, no turn the log may hold beyond this copy extends further than the one chosen: a
    turn's conversation ends with its reply."""
    place = _placement(state, messages, tools, keys, agent)
    done = 0 if place.continued is None else len(place.continued.conversation)
    unsure = any(m.get("role") == "assistant" for m in messages[done:])
    if not unsure and agent is not None and agent.parent is not None:
        unsure = not any(owned_by(node, agent.id) for node in state.nodes.values())
    return replace(place, unsure=True) if unsure else place


def _placement(
    state: SessionState,
    messages: Sequence[JSON],
    tools: list[JSON] | None,
    keys: Sequence[MessageKey],
    agent: AgentIdentity | None,
) -> Placement:
    """Where a request of ``agent`` with these messages joins the tree:

    * no identity: the kept turn it extends furthest, else rendered (today's prefix rule);
    * an agent with kept turns: the kept turn OF THAT AGENT it extends furthest; extending none
      of its own but another agent's, the tokens win (that turn, with a mismatch); none at all:
      rendered (a rewritten history: the fold makes it a fork);
    * a root agent's first turn: ``main``, as without an identity;
    * another new agent's first turn: a ``fork`` where its messages start with the whole request
      of one of its parent agent's turns (the spawning turn: the longest such request), rendered
      in full and delta-encoded against it (Claude Code rewrites the spawning assistant message
      to keep only the fork's own tool_use: its prompt does not extend that turn); else
      ``fresh``, a new conversation (its delta base: the longest shared token prefix).
    """
    if agent is None:
        return Placement(continued_turn(state, messages, tools, keys))
    own = [node for node in state.nodes.values() if owned_by(node, agent.id)]
    if own:
        # As its latest kept turn resolved it (turns recorded without an identity: main's).
        kind = str(max(own, key=_turn).event.agent.get("resolved_kind") or "main")
        mine = continued_turn(state, messages, tools, keys, own)
        if mine is not None:
            return Placement(mine, resolved_kind=kind)
        other = continued_turn(state, messages, tools, keys)
        if other is None:
            return Placement(None, resolved_kind=kind)
        whose = other.event.agent.get("id") or "unnamed"
        mismatch = f"extends turn {other.turn} of agent {whose}, not its own"
        return Placement(other, resolved_kind=kind, mismatch=mismatch)
    if agent.parent is None:
        return Placement(continued_turn(state, messages, tools, keys), resolved_kind="main")
    spawning = _spawning_turn(state, keys, agent.parent)
    if spawning is not None:
        mismatch = ""
        if agent.kind == "fresh":
            mismatch = (
                f"claimed fresh, but its messages start with the request of turn "
                f"{spawning.turn} of agent {agent.parent} (a fork)"
            )
        return Placement(None, spawning.turn, "fork", mismatch)
    mismatch = ""
    if agent.kind == "fork":
        mismatch = (
            f"claimed fork, but its messages start with no request of agent {agent.parent} "
            "(a fresh conversation)"
        )
    return Placement(None, resolved_kind="fresh", mismatch=mismatch)


def _turn(node: TurnNode) -> int:
    return node.turn


def _spawning_turn(state: SessionState, keys: Sequence[MessageKey], parent: str) -> TurnNode | None:
    """Of agent ``parent``'s kept turns, the one with the longest request (its conversation
    without its reply) that ``keys`` start with; ties: the most recent."""
    best: TurnNode | None = None
    for node in state.nodes.values():
        asked = len(node.keys) - 1
        if asked <= 0 or asked > len(keys) or not owned_by(node, parent):
            continue
        if best is not None and (asked, node.turn) < (len(best.keys) - 1, best.turn):
            continue
        if node.keys[asked - 1 :: -1] == tuple(keys[asked - 1 :: -1]):
            best = node
    return best


def resent_turn(
    state: SessionState,
    messages: Sequence[JSON],
    tools: list[JSON] | None,
    record: JSON,
    keys: Sequence[MessageKey] | None = None,
    agent: str | None = None,
) -> TurnCompleted | None:
    """The kept turn of agent ``agent`` (None: of none named) whose request
    ``messages``/``tools``/``record`` is again (a client's retry: after a 5xx, a cut stream, a
    lost reply), else None.

    Clients resend the same request when they did not get (all of) the answer; answering it
    with the recorded turn keeps one model call one turn. Only a conversation's tip qualifies
    (a turn no later turn continued: e.g. the main agent's last turn after a sub-agent took
    one); the request of a turn that was continued is a new turn, a retry that branches. Two
    agents' identical requests are two turns (a fan-out of identical sub-agents: one sample
    each), and a turn whose client went away is never answered again (it stays the dead end
    the client left: the retry samples anew). ``keys``: as for ``continued_turn``."""
    if not record:
        return None  # events older than TurnCompleted.request: never a resend
    tools = tools or None
    asked = None if keys is None else tuple(keys)
    for node in sorted(state.nodes.values(), key=_turn, reverse=True):
        if node.continued or len(node.keys) != len(messages) + 1 or node.event.client_gone:
            continue
        if node.event.request != record or node.tools != tools:
            continue
        if node.event.agent.get("id") != agent:
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
