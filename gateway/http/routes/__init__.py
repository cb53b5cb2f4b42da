"""The routes, thin (parse, call the serving code, shape the reply): one module per API
surface, each route registered once for the three scopes of a session (``ScopedRoutes``)."""

from gateway.http.routes.anthropic_routes import add_anthropic_routes
from gateway.http.routes.openai_routes import add_openai_routes
from gateway.http.routes.responses_routes import add_responses_routes
from gateway.http.routes.scoped_routes import (
    SESSION_HEADERS,
    DirectRoute,
    ScopedRoutes,
    SessionRef,
    errors,
)
from gateway.http.routes.session_routes import add_session_routes

__all__ = [
    "SESSION_HEADERS",
    "DirectRoute",
    "ScopedRoutes",
    "SessionRef",
    "add_anthropic_routes",
    "add_openai_routes",
    "add_responses_routes",
    "add_session_routes",
    "errors",
]
