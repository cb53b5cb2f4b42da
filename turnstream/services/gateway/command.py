"""``turnstream gateway``: the OpenAI-compatible gateway as a service.

One process (``--workers 1``): bind the port, open the log, build the gateway
(``assembly.build_gateway``) and serve it until SIGINT / SIGTERM. ``--workers N``: this process
is their supervisor (``workers.serve_workers``).
"""

from __future__ import annotations

import asyncio
import logging

from turnstream.services.gateway.assembly import (
    build_gateway,
    import_gateway_modules,
    require_local_backend,
)
from turnstream.services.gateway.http import http_server, http_url, listening_socket, serve_until
from turnstream.services.gateway.settings import GatewaySettings
from turnstream.services.gateway.workers import serve_workers
from turnstream.stack.event_log import open_log
from turnstream.stack.process import run_service, settle_heap, stop_on_signals

__all__ = ["GatewayCommand"]

log = logging.getLogger(__name__)


class GatewayCommand(GatewaySettings):
    __doc__ = GatewaySettings.__doc__

    def cli_cmd(self) -> None:
        if self.backend == "local":
            require_local_backend()
        if self.workers > 1:
            asyncio.run(serve_workers(self))  # the supervisor of ``worker_process``es
            return
        run_service(self._serve())

    async def _serve(self) -> None:
        stop = stop_on_signals()
        # Bound first: a port in use is said before the model loads and the log starts.
        with listening_socket(self.host, self.port) as listener:
            import_gateway_modules(self)
            async with (
                open_log(self, name="turnstream-gateway", stop=stop) as event_log,
                build_gateway(self, event_log) as gateway,
            ):
                server = http_server(gateway.app)
                settle_heap()
                log.info(
                    "gateway on %s (backend %s, log %s, run %s)",
                    http_url(self.host, listener.getsockname()[1]),
                    gateway.backend.id,
                    event_log.url,
                    self.run,
                )
                await serve_until(server, stop, [listener])
