"""Thin routes per API surface: parse, call the serving code, shape the reply."""

from gateway.routers.openai import openai_routes
from gateway.routers.sessions import session_routes

__all__ = ["openai_routes", "session_routes"]
