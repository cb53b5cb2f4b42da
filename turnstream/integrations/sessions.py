"""The gateway's session API as a client sees it (DESIGN §4): open a session, close it.

``POST /v1/sessions {run, group, metadata}`` answers the session's id and its OpenAI
``base_url``, which the agent uses as it would any OpenAI endpoint; ``POST
/v1/sessions/{id}/close {status, reward}`` ends it, and the fold worker turns it into
trajectories. httpx errors and error answers become ``GatewayUnavailable`` / ``GatewayRefused``
here, naming the gateway and what to check.

A request that never reached the gateway (connection refused) or that it answered with 503 (the
log was unavailable) is tried again, up to ``tries`` times. A close retried after a lost answer
may find the session closed by its own first attempt: a retried close that gets 409
``session_closed`` counts as done.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import httpx

from schemas.events import JSON, SessionStatus
from turnstream.integrations.errors import (
    GatewayRefused,
    GatewayUnavailable,
    SessionClosedElsewhere,
)

__all__ = ["ClosedSession", "GatewaySessions", "OpenedSession"]

log = logging.getLogger(__name__)

# The gateway (uvicorn) drops idle keep-alive connections after 5 s; a request sent on one it is
# closing fails. Dropping ours sooner avoids that race (turnstream.demo.agents does the same).
_KEEPALIVE_EXPIRY_S = 1.0
_RETRY_DELAYS_S = (0.25, 1.0, 2.0)


@dataclass(frozen=True)
class OpenedSession:
    session_id: str
    run: str
    group: str | None
    base_url: str  # the session's OpenAI base URL (".../sessions/<id>/v1")


@dataclass(frozen=True)
class ClosedSession:
    session_id: str
    status: str
    turns: int  # turns the gateway served; 0: the agent never called the model


class GatewaySessions:
    """The session API of the gateway at ``gateway_url`` (one connection pool; share it)."""

    def __init__(
        self,
        gateway_url: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 30.0,
        tries: int = len(_RETRY_DELAYS_S) + 1,
    ) -> None:
        self.url = gateway_url.rstrip("/")
        self.api_key = api_key
        self.tries = max(1, tries)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(
            base_url=self.url,
            headers=headers,
            timeout=timeout_s,
            limits=httpx.Limits(keepalive_expiry=_KEEPALIVE_EXPIRY_S),
        )
        self._model: str | None = None
        self._background: set[asyncio.Future[ClosedSession]] = set()

    async def open(self, *, run: str, group: str | None, metadata: JSON) -> OpenedSession:
        body = {"run": run, "group": group, "metadata": metadata}
        answer = await self._request(
            "POST", "/v1/sessions", body, what=f"opening a session of run {run!r}"
        )
        return OpenedSession(str(answer["session_id"]), run, group, str(answer["base_url"]))

    async def close(
        self, session: OpenedSession, *, reward: float | None, status: SessionStatus = "completed"
    ) -> ClosedSession:
        """Close ``session`` with ``reward`` (None: none, e.g. a failed agent). Raises
        ``SessionClosedElsewhere`` when something else closed it first (the reaper)."""
        body: dict[str, Any] = {"status": status, "reward": reward}
        answer = await self._request(
            "POST",
            f"/v1/sessions/{session.session_id}/close",
            body,
            what=f"closing session {session.run}/{session.session_id}",
            headers={"X-Run-Id": session.run},
            closing=True,
        )
        if answer is None:  # a retry found it closed, by our own earlier attempt
            return ClosedSession(session.session_id, status, await self.turns(session))
        return ClosedSession(session.session_id, str(answer["status"]), int(answer["turns"]))

    async def served_model(self) -> str:
        """The model name the gateway serves (what an OpenAI request's ``model`` must say)."""
        if self._model is None:
            answer = await self._request("GET", "/v1/models", None, what="listing its models")
            models = answer.get("data") or []
            if not models:
                raise GatewayRefused(f"the gateway at {self.url} lists no model", status=200)
            self._model = str(models[0]["id"])
        return self._model

    def close_in_background(self, session: OpenedSession, *, status: SessionStatus) -> None:
        """Close ``session`` without a reward and without waiting (a cancelled episode's last
        act); a failure is logged."""
        closing = asyncio.ensure_future(self.close(session, reward=None, status=status))
        self._background.add(closing)  # asyncio keeps only weak references to tasks

        def done(future: asyncio.Future[ClosedSession]) -> None:
            self._background.discard(future)
            if not future.cancelled() and future.exception() is not None:
                log.warning("closing session %s failed: %s", session.session_id, future.exception())

        closing.add_done_callback(done)

    async def aclose(self) -> None:
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        await self._http.aclose()

    async def turns(self, session: OpenedSession) -> int:
        """How many turns the gateway served in ``session`` so far."""
        answer = await self._request(
            "GET",
            f"/v1/sessions/{session.session_id}",
            None,
            what=f"reading session {session.run}/{session.session_id}",
            headers={"X-Run-Id": session.run},
        )
        return int(answer["turns"])

    async def _request(
        self,
        method: str,
        path: str,
        body: JSON | None,
        *,
        what: str,
        headers: dict[str, str] | None = None,
        closing: bool = False,
    ) -> Any:
        """The JSON answer; None for a retried close that found the session closed."""
        for attempt in range(self.tries):
            retry = attempt + 1 < self.tries
            try:
                response = await self._http.request(method, path, json=body, headers=headers)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:  # never reached it
                if retry:
                    await asyncio.sleep(_RETRY_DELAYS_S[min(attempt, len(_RETRY_DELAYS_S) - 1)])
                    continue
                raise GatewayUnavailable(
                    f"{what}: cannot reach the gateway at {self.url} ({exc!r}); is "
                    f"`turnstream up` (or `turnstream gateway`) running there?"
                ) from exc
            except httpx.HTTPError as exc:  # sent, answer lost: only a close is safe to repeat
                if closing and retry:
                    await asyncio.sleep(_RETRY_DELAYS_S[min(attempt, len(_RETRY_DELAYS_S) - 1)])
                    continue
                raise GatewayUnavailable(
                    f"{what}: no answer from the gateway at {self.url} ({exc!r})"
                ) from exc
            if response.status_code == 503 and retry:  # the log was unavailable: nothing done
                await asyncio.sleep(_RETRY_DELAYS_S[min(attempt, len(_RETRY_DELAYS_S) - 1)])
                continue
            if response.status_code == 200:
                return response.json()
            code, message = _error_of(response)
            if response.status_code == 409 and code == "session_closed":
                if closing and attempt > 0:
                    log.info("%s: closed already by our earlier attempt", what)
                    return None
                raise SessionClosedElsewhere(
                    f"{what}: the gateway says {message}", status=409, code=code
                )
            raise GatewayRefused(
                f"{what}: the gateway at {self.url} answered {response.status_code}: {message}",
                status=response.status_code,
                code=code,
            )
        raise AssertionError("unreachable: the last try returns or raises")


def _error_of(response: httpx.Response) -> tuple[str | None, str]:
    """The OpenAI error body's code and message, or the raw text."""
    try:
        error = response.json()["error"]
        return error.get("code"), str(error.get("message"))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None, response.text[:500]
