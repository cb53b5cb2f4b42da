"""The gateway's domain core: the session aggregate (``aggregate``: pure data, changed only by
applying events), where a request joins the session's tree and which kept turn it continues or
resends (``branches``: by the client's agent identity, then its tokens), the canonical
conversation every API translates into (``conversation``) and the sessions held in memory
(``session_store``: each state with its append lock, its requests in flight and the caches its
live turns leave; ``SessionLog``: what the gateway asks the log, which decides). Knows no HTTP,
no API surface and no backend."""

from gateway.core.aggregate import Kept, SessionState, TurnDraft, TurnNode, apply, fold, turn_event
from gateway.core.branches import (
    Placement,
    attachment,
    continued_turn,
    owned_by,
    placement,
    resent_turn,
)
from gateway.core.conversation import MessageKey, TurnRequest, message_key, message_keys
from gateway.core.session_store import (
    Asked,
    ContextCache,
    Flight,
    ReadAfter,
    Session,
    SessionKey,
    SessionLog,
    SessionStore,
)

__all__ = [
    "Asked",
    "ContextCache",
    "Flight",
    "Kept",
    "MessageKey",
    "Placement",
    "ReadAfter",
    "Session",
    "SessionKey",
    "SessionLog",
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
    "owned_by",
    "placement",
    "resent_turn",
    "turn_event",
]
