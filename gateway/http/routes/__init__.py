"""Thin routes per API surface: parse, call the serving code, shape the reply."""

from gateway.http.routes.anthropic_routes import anthropic_routes
from gateway.http.routes.openai_routes import openai_routes
from gateway.http.routes.responses_routes import responses_routes
from gateway.http.routes.session_routes import session_routes

__all__ = ["anthropic_routes", "openai_routes", "responses_routes", "session_routes"]
