"""``turnstream gateway``: the OpenAI-compatible gateway (the ``gateway`` package) as a service.

Each module one step, none importing a later one:

- ``settings``: ``GatewaySettings``, its flags (``up`` extends them);
- ``assembly``: ``build_gateway``, the parts put together (log publisher, tokenizer, backend,
  policy watch, sessions, app), also what ``up`` and the demo mount in-process;
- ``http``: the listening socket and the uvicorn server around an app;
- ``workers``: ``--workers N``, the supervisor of N gateway processes on one port;
- ``worker_process``: one of those processes (``python -m``, not imported here);
- ``command``: ``GatewayCommand``, one process or the supervisor.
"""

from __future__ import annotations

from turnstream.services.gateway.assembly import (
    Gateway,
    build_backend,
    build_gateway,
    import_gateway_modules,
    local_backend_class,
    model_name,
    require_local_backend,
    stop_token_ids,
)
from turnstream.services.gateway.command import GatewayCommand
from turnstream.services.gateway.http import http_server, http_url, listening_socket, serve_until
from turnstream.services.gateway.settings import GatewaySettings
from turnstream.services.gateway.workers import WorkerPool, gateway_workers, serve_workers

__all__ = [
    "Gateway",
    "GatewayCommand",
    "GatewaySettings",
    "WorkerPool",
    "build_backend",
    "build_gateway",
    "gateway_workers",
    "http_server",
    "http_url",
    "import_gateway_modules",
    "listening_socket",
    "local_backend_class",
    "model_name",
    "require_local_backend",
    "serve_until",
    "serve_workers",
    "stop_token_ids",
]
