"""A stand-in inference server for the remote backends: an ``httpx.MockTransport`` handler
behind the gateway's backend ``Transport`` interface (``gateway.backends.transport``).

vLLM and SGLang need a GPU (vLLM's CPU build runs in tests/deploy), so the adapter tests answer
their requests with handlers: ``handler(request: httpx.Request) -> httpx.Response``, which may
raise the httpx errors a real transport raises (at the request, or mid-body from the response's
stream). The request the handler sees carries what the gateway sent: method, URL, headers
(Host and Content-Length included) and body.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

import httpx

from gateway.backends.transport import Headers, Response, Target

__all__ = ["HandlerTransport"]

Handler = Callable[[httpx.Request], httpx.Response | Coroutine[Any, Any, httpx.Response]]


class HandlerTransport:
    """Answers each request with ``handler``; says whether it was closed."""

    def __init__(self, handler: Handler) -> None:
        self._mock = httpx.MockTransport(handler)
        self.closed = False

    async def request(
        self,
        method: bytes,
        target: Target,
        *,
        body: bytes,
        headers: Headers,
        timeouts: httpx.Timeout,
    ) -> Response:
        if self.closed:
            raise RuntimeError("the transport is closed")
        request = httpx.Request(
            method.decode(),
            target.url,
            headers=[(b"host", target.host), *headers, (b"content-length", b"%d" % len(body))],
            content=body,
            extensions={"timeout": timeouts.as_dict()},
        )
        response = await self._mock.handle_async_request(request)
        return Response(
            response.status_code, response.headers.raw, response.aiter_bytes(), response.aclose
        )

    async def aclose(self) -> None:
        self.closed = True
