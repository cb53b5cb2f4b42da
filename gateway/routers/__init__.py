"""Thin routes per API surface: parse, call the serving code, shape the reply."""

from gateway.routers.anthropic import anthropic_routes
from gateway.routers.openai import openai_routes
from gateway.routers.responses import responses_routes
from gateway.routers.sessions import session_routes

__all__ = ["anthropic_routes", "openai_routes", "responses_routes", "session_routes"]
