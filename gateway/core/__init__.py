"""The gateway's domain core: the session aggregate, its branches, the canonical conversation and
the sessions held in memory. Pure but for the store's locks; knows no HTTP and no API surface."""

from gateway.core.aggregate import Kept, SessionState, TurnDraft, TurnNode, apply, fold, turn_event
from gateway.core.branches import attachment, continued_turn, resent_turn
from gateway.core.conversation import TurnRequest, message_key
from gateway.core.session_store import Session, SessionKey, SessionStore

__all__ = [
    "Kept",
    "Session",
    "SessionKey",
    "SessionState",
    "SessionStore",
    "TurnDraft",
    "TurnNode",
    "TurnRequest",
    "apply",
    "attachment",
    "continued_turn",
    "fold",
    "message_key",
    "resent_turn",
    "turn_event",
]
