"""What a remote backend serves, asked of its ``GET /v1/models`` (vLLM and SGLang both answer it).

vLLM lists each served model as ``{"id": <served name>, "max_model_len": <context>, ...}``;
SGLang's model card has the same two fields. The gateway sends the served name in every request
and needs the context length to refuse over-long prompts, so with these two read from the
backend, ``--model-name`` and ``--max-context`` only override.

Replicas of one model must agree on the name; the context taken is the smallest any of them
serves. A backend still starting is waited for (``wait_s``), since a gateway and its inference
servers usually start together and vLLM takes a minute or more to answer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from schemas.errors import TurnstreamError

__all__ = ["ServedModel", "parse_models", "served_model"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServedModel:
    name: str
    max_context: int | None  # None: the backend did not say


def models_url(base_url: str) -> str:
    """``/v1/models`` of a backend given with or without the ``/v1`` an OpenAI client takes."""
    return f"{base_url.rstrip('/').removesuffix('/v1')}/v1/models"


def parse_models(body: Any, url: str) -> ServedModel:
    """The one model a ``/v1/models`` answer lists; TurnstreamError naming what is wrong.

    >>> parse_models({"data": [{"id": "qwen", "max_model_len": 4096}]}, "u")
    ServedModel(name='qwen', max_context=4096)
    >>> parse_models({"data": [{"id": "qwen"}]}, "u").max_context is None
    True
    """
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list) or not data:
        raise TurnstreamError(f"{url} lists no model (expected {{'data': [{{'id': ...}}]}})")
    ids = [m.get("id") for m in data if isinstance(m, dict)]
    if len(data) > 1:
        raise TurnstreamError(
            f"{url} serves {len(data)} models ({ids}): pass --model-name to say which one"
        )
    card = data[0]
    name = card.get("id") if isinstance(card, dict) else None
    if not isinstance(name, str) or not name:
        raise TurnstreamError(f"{url} lists a model without an id: {card!r}")
    length = card.get("max_model_len")
    valid = isinstance(length, int) and not isinstance(length, bool) and length > 0
    return ServedModel(name, length if valid else None)


async def served_model(
    base_urls: Sequence[str], *, wait_s: float = 120.0, client: httpx.AsyncClient | None = None
) -> ServedModel:
    """What every replica serves: one name, the smallest context any of them gives."""
    owned = client is None
    http = client or httpx.AsyncClient(timeout=10.0)
    try:
        models = [await _ask(http, models_url(url), wait_s) for url in base_urls]
    finally:
        if owned:
            await http.aclose()
    names = {m.name for m in models}
    if len(names) > 1:
        raise TurnstreamError(
            f"the replicas serve different models ({sorted(names)}): one gateway fronts "
            f"replicas of one model; pass --model-name to override"
        )
    lengths = [m.max_context for m in models if m.max_context is not None]
    return ServedModel(models[0].name, min(lengths) if lengths else None)


async def _ask(http: httpx.AsyncClient, url: str, wait_s: float) -> ServedModel:
    deadline = time.monotonic() + wait_s
    waited = False
    while True:
        try:
            answer = await http.get(url)
        except httpx.HTTPError as exc:
            problem = f"{type(exc).__name__}: {exc}"
        else:
            if answer.status_code == 200:
                try:
                    return parse_models(answer.json(), url)
                except ValueError as exc:
                    raise TurnstreamError(f"{url} did not answer JSON: {exc}") from exc
            problem = f"HTTP {answer.status_code}"
            if answer.status_code not in (502, 503, 504):  # not "starting": asking again is moot
                raise TurnstreamError(
                    f"{url} answered {problem}: is it a vLLM or SGLang server? Pass "
                    f"--model-name and --max-context to skip asking it"
                )
        if time.monotonic() >= deadline:
            raise TurnstreamError(
                f"the backend at {url} did not answer within {wait_s:g} s ({problem}): start it "
                f"first, raise --backend-wait-s, or pass --model-name and --max-context"
            )
        if not waited:
            log.info("waiting for the backend at %s to answer (%s)", url, problem)
            waited = True
        await asyncio.sleep(1.0)
