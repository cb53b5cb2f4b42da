"""The gateway's domain core: the session aggregate (``aggregate``: pure data, changed only by
applying events), which kept turn a request continues or resends (``branches``), the canonical
conversation every API translates into (``conversation``) and the sessions held in memory
(``session_store``: each state with its lock and the caches its live turns leave). Knows no HTTP,
no API surface and no backend."""

from gateway.core.aggregate import Kept, SessionState, TurnDraft, TurnNode, apply, fold, turn_event
from gateway.core.branches import attachment, continued_turn, resent_turn
from gateway.core.conversation import MessageKey, TurnRequest, message_key, message_keys
from gateway.core.session_store import ContextCache, Session, SessionKey, SessionStore

__all__ = [
    "ContextCache",
    "Kept",
    "MessageKey",
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
    "message_keys",
    "resent_turn",
    "turn_event",
]
