"""What a remote backend serves, read from its /v1/models (gateway.backends.served_model).

The backends are ``httpx.MockTransport`` handlers answering as vLLM documents its model list
(no vLLM runs in ``make test``; tests/deploy asks a real one).
"""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from gateway.backends.served_model import ServedModel, served_model
from schemas.errors import TurnstreamError

Handler = Callable[[httpx.Request], httpx.Response]


def vllm(name: str, length: int | None = 4096) -> httpx.Response:
    card: dict[str, object] = {"id": name, "object": "model", "owned_by": "vllm", "root": name}
    if length is not None:
        card["max_model_len"] = length
    return httpx.Response(200, json={"object": "list", "data": [card]})


def client(route: Callable[[str], httpx.Response]) -> httpx.AsyncClient:
    def handle(request: httpx.Request) -> httpx.Response:
        assert request.method == "GET" and request.url.path == "/v1/models", request.url
        return route(request.url.host)

    return httpx.AsyncClient(transport=httpx.MockTransport(handle))


async def test_the_name_and_the_smallest_context_of_the_replicas() -> None:
    lengths = {"a": 8192, "b": 4096}
    async with client(lambda host: vllm("qwen", lengths[host])) as http:
        got = await served_model(["http://a:8000/v1", "http://b:8000"], client=http)
    assert got == ServedModel("qwen", 4096)


async def test_a_backend_that_does_not_say_its_context() -> None:
    async with client(lambda host: vllm("qwen", None)) as http:
        assert await served_model(["http://a"], client=http) == ServedModel("qwen", None)


@pytest.mark.parametrize(
    ("route", "says"),
    [
        (lambda host: vllm(host), "the replicas serve different models"),
        (lambda host: httpx.Response(404, json={"detail": "Not Found"}), "answered HTTP 404"),
        (
            lambda host: httpx.Response(200, json={"data": [{"id": "a"}, {"id": "b"}]}),
            "serves 2 models",
        ),
        (lambda host: httpx.Response(200, json={"data": []}), "lists no model"),
        (lambda host: httpx.Response(200, text="<html>"), "did not answer JSON"),
    ],
)
async def test_what_cannot_be_used_is_named(
    route: Callable[[str], httpx.Response], says: str
) -> None:
    async with client(route) as http:
        with pytest.raises(TurnstreamError, match=says):
            await served_model(["http://a", "http://b"], client=http, wait_s=0)


async def test_a_backend_still_starting_is_waited_for() -> None:
    answers = iter([httpx.Response(503), httpx.Response(503), vllm("qwen")])
    async with client(lambda host: next(answers)) as http:
        assert await served_model(["http://a"], client=http, wait_s=10) == ServedModel("qwen", 4096)


async def test_a_backend_that_never_answers_says_what_to_do() -> None:
    def refuse(host: str) -> httpx.Response:
        raise httpx.ConnectError("connection refused")

    async with client(refuse) as http:
        with pytest.raises(TurnstreamError, match="pass --model-name and --max-context"):
            await served_model(["http://a"], client=http, wait_s=0)


@pytest.mark.parametrize("url", ["ftp://gpu-1:8000", "gpu-1:8000", "http://", "http:///v1"])
def test_a_backend_url_that_is_not_http_is_a_settings_error(url: str) -> None:
    from pydantic import ValidationError

    from turnstream.services.gateway.settings import GatewaySettings

    with pytest.raises(ValidationError, match="is not an http:// or https:// URL"):
        GatewaySettings(backend="vllm", backend_urls=["http://gpu-0:8000", url])
    assert GatewaySettings(backend="vllm", backend_urls=["HTTPS://gpu-0/v1"]).backend_urls
