"""The gateway's HTTP edge: everything that knows a request is HTTP, in front of the serving
code (``gateway.serving``), which never sees one.

- ``app``: ``create_app`` assembles the FastAPI app; ``GatewayApp`` serves the /v1 POST routes
  on a short path of its own; one error mapping answers every route, unknown ones included.
- ``guard``: ``RequestGuard``, the checks before any route runs (API keys and their runs, a body
  read under a size limit and a deadline, decoded strictly once).
- ``kept_bodies``: a conversation a client resends, decoded only where it grew.
- ``routes/``: the thin routes, one module per API surface, each route registered once for the
  three ways a client names its session (``ScopedRoutes``).
- ``handoff``: with ``--workers N``, a connection moved to the worker process that holds its
  session; ``request_heads``: the request framing and the session rules it routes by.

The request and response models, and the SSE framing of streamed replies, are the protocol's
(``gateway.protocol``): the serving code writes them too.
"""

from gateway.http.app import GatewayApp, Health, create_app
from gateway.http.guard import BodyLimits, GuardedRoute, RequestGuard
from gateway.http.handoff import Handoff, OwnerRouted, owner_routed
from gateway.http.kept_bodies import KeptBodies
from gateway.http.request_heads import session_of
from gateway.http.routes import ScopedRoutes, SessionRef

__all__ = [
    "BodyLimits",
    "GatewayApp",
    "GuardedRoute",
    "Handoff",
    "Health",
    "KeptBodies",
    "OwnerRouted",
    "RequestGuard",
    "ScopedRoutes",
    "SessionRef",
    "create_app",
    "owner_routed",
    "session_of",
]
