"""What gateways sharing one log must get right, checked on one session's stored events (PURE).

Behind a load balancer without affinity a session's turns land on whichever gateway; a gateway
that acts on a stale copy of the session shows in the log in two ways, counted here:

- a **re-tokenized continuation**: a turn that continues a stored turn (its conversation
  extends that turn's whole conversation, messages + reply, as the gateway itself decides it:
  ``gateway.core.branches.continued_turn`` on the state ``gateway.core.aggregate.apply`` folds
  from the events before it) whose prompt does not hold that turn's whole context (prompt +
  completion ids) token for token: it was delta-encoded against another turn, or its
  ``prefix_len`` is shorter. The gateway rendered the reply it did not know from its text, so
  the trainer sees tokens the model never sampled;
- a **turn served after close**: a completion the client received 200 for whose event is stored
  after the session's close (a gateway that did not know of the close). A completion the client
  received that is not in the log at all is the audit's ``lost``, not counted again here.

>>> retokenized_continuations([])
[]
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from gateway.core.aggregate import SessionState, TurnNode, apply
from gateway.core.branches import continued_turn
from schemas.events import SessionClosed, SessionEvent, TurnCompleted

__all__ = ["retokenized_continuations", "served_after_close"]


def retokenized_continuations(events: Sequence[SessionEvent]) -> list[str]:
    """A line for each turn of ``events`` (one session's, trusted, in stream order) that
    continues a stored turn without holding that turn's whole context."""
    found: list[str] = []
    state: SessionState | None = None
    for event in events:
        after = apply(state, event)
        if isinstance(event, TurnCompleted) and state is not None and after is not None:
            node = after.nodes.get(event.turn)
            if node is not None and node.event is event:
                continued = continued_turn(
                    state, node.conversation[:-1], node.tools, node.keys[:-1]
                )
                if continued is not None and not _holds(state, event, continued):
                    found.append(
                        f"{event.session} turn {event.turn}: continues turn {continued.turn} "
                        f"({len(continued.context_ids)} tokens) but is delta-encoded against "
                        f"turn {event.parent} with prefix_len {event.prefix_len}"
                    )
        state = after
    return found


def _holds(state: SessionState, event: TurnCompleted, continued: TurnNode) -> bool:
    """Whether ``event``'s prompt starts with the whole context of ``continued``, or of a turn
    with the same conversation (two replies with one text: the client's could be either)."""
    parent = state.nodes.get(event.parent)
    return (
        parent is not None
        and parent.keys == continued.keys
        and parent.tools == continued.tools
        and event.prefix_len == len(parent.context_ids)
    )


def served_after_close(
    events: Sequence[SessionEvent], seqs: Sequence[int], received: Iterable[str]
) -> list[str]:
    """A line for each reply id in ``received`` (completions a client got 200 for) whose turn
    is stored after the session's first close; ``seqs``: each event's stream sequence."""
    close = next(
        ((seq, e) for seq, e in zip(seqs, events, strict=True) if isinstance(e, SessionClosed)),
        None,
    )
    if close is None:
        return []
    closed_at, closed = close
    stored = {
        e.reply: (seq, e)
        for seq, e in reversed(list(zip(seqs, events, strict=True)))  # the first stored wins
        if isinstance(e, TurnCompleted)
    }
    found: list[str] = []
    for reply in received:
        seq, turn = stored.get(reply, (0, None))
        if turn is not None and seq > closed_at:
            found.append(
                f"{turn.session} turn {turn.turn} (seq {seq}): served after the session's "
                f"close (seq {closed_at}, {closed.status}, {closed.num_turns} turns)"
            )
    return found
