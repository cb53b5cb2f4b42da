"""The gateway answers a turn that a raw-log-prob replica would record wrongly with a 400 OpenAI
body, streamed or not, before the stream's first event; ``--allow-raw-logprobs`` records it
with ``logprobs_kind: "raw"``.

The real app, the real openai SDK (over httpx's ASGI transport) and the real tiny model's chat
template; the vLLM replica is the stand-in of test_logprobs_probe.py (no vLLM runs in unit
tests: tests/deploy runs the real one), and the log a recorder of what would be published
(the publisher itself is tested against nats-server in tests/integration).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from gateway.backends.router import ReplicaRouter
from gateway.core.session_store import SessionStore
from gateway.http.app import create_app
from gateway.metrics import GatewayMetrics
from gateway.serving import SessionService, TurnEngine
from gateway.templates import ChatTemplate
from gateway.tools import get_parser
from schemas.events import TurnCompleted
from tests.unit.test_logprobs_probe import StandInVLLM, vllm


class _Receipt:
    seq, duplicate = 1, False


class _Publisher:
    def __init__(self) -> None:
        self.events: list[object] = []

    async def publish(self, event: object) -> _Receipt:
        self.events.append(event)
        return _Receipt()

    @property
    def turns(self) -> list[TurnCompleted]:
        return [e for e in self.events if isinstance(e, TurnCompleted)]


def stand_in_app(
    tiny_model_dir: Path,
    server: StandInVLLM,
    *,
    allow_raw_logprobs: bool = False,
    api_keys: tuple[str, ...] = (),
) -> tuple[Any, _Publisher]:
    """The gateway app on the tiny model's template, in front of one vLLM stand-in replica,
    publishing to memory."""
    publisher = _Publisher()
    engine = TurnEngine(
        template=ChatTemplate(AutoTokenizer.from_pretrained(tiny_model_dir)),
        backend=ReplicaRouter([vllm(server)], max_inflight_per_replica=4),
        publisher=publisher,  # type: ignore[arg-type]
        parser=get_parser("hermes"),
        model_name="tiny",
        metrics=GatewayMetrics(),
        allow_raw_logprobs=allow_raw_logprobs,
    )
    sessions = SessionService(store=SessionStore(), publisher=publisher, model_name="tiny")  # type: ignore[arg-type]
    app = create_app(engine=engine, sessions=sessions, default_run="run", api_keys=api_keys)
    return app, publisher


def gateway(
    tiny_model_dir: Path, server: StandInVLLM, *, allow_raw_logprobs: bool = False
) -> tuple[openai.AsyncOpenAI, _Publisher]:
    app, publisher = stand_in_app(tiny_model_dir, server, allow_raw_logprobs=allow_raw_logprobs)
    client = openai.AsyncOpenAI(
        base_url="http://gateway/v1",
        api_key="unused",
        default_headers={"X-Session-Id": "s-1"},
        max_retries=0,
        http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app=app)),  # type: ignore[arg-type]
    )
    return client, publisher


HI: Any = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_tempered_turn_on_a_raw_replica_is_a_400(
    tiny_model_dir: Path, stream: bool
) -> None:
    server = StandInVLLM("raw_logprobs")
    client, publisher = gateway(tiny_model_dir, server)
    with pytest.raises(openai.BadRequestError) as refused:
        # A stream refused after its first event would raise while iterating, not here.
        await client.chat.completions.create(
            model="tiny",
            messages=HI,
            temperature=0.5,
            max_tokens=3,
            stream=stream,
        )
    assert refused.value.status_code == 400
    error = refused.value.body
    assert isinstance(error, dict) and error["code"] == "invalid_request"
    assert error["param"] == "temperature"
    message = error["message"]
    assert message.startswith("session run/s-1: replica vllm-0")
    assert "--logprobs-mode processed_logprobs" in message and "--allow-raw-logprobs" in message
    assert server.generations == [] and publisher.turns == []


async def test_completions_are_refused_too(tiny_model_dir: Path) -> None:
    server = StandInVLLM("raw_logprobs")
    client, publisher = gateway(tiny_model_dir, server)
    with pytest.raises(openai.BadRequestError, match="processed_logprobs"):
        await client.completions.create(model="tiny", prompt="hi", top_p=0.9, max_tokens=3)
    assert server.generations == [] and publisher.turns == []


async def test_temperature_one_is_served_and_recorded_as_sampled(tiny_model_dir: Path) -> None:
    server = StandInVLLM("raw_logprobs")
    client, publisher = gateway(tiny_model_dir, server)
    await client.chat.completions.create(model="tiny", messages=HI, max_tokens=3)
    [turn] = publisher.turns
    assert turn.logprobs_kind == "sampled" and list(turn.completion_ids) == [72, 73, 74]


@pytest.mark.parametrize(("temperature", "top_p"), [(1e-6, 1.0), (0.0, 0.9), (9e-6, 0.5)])
async def test_a_greedy_turn_is_served_by_a_raw_replica(
    tiny_model_dir: Path, temperature: float, top_p: float
) -> None:
    """Issue 38: vLLM treats a temperature below 1e-5 as greedy (top_p set to 1): its log-probs
    are the raw ones whatever was asked, so a raw replica records them as sampled."""
    server = StandInVLLM("raw_logprobs")
    client, publisher = gateway(tiny_model_dir, server)
    await client.chat.completions.create(
        model="tiny", messages=HI, temperature=temperature, top_p=top_p, max_tokens=3
    )
    [turn] = publisher.turns
    assert turn.logprobs_kind == "sampled"
    assert (turn.sampling["temperature"], turn.sampling["top_p"]) == (temperature, top_p)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_the_flag_records_the_turn_as_raw(tiny_model_dir: Path, stream: bool) -> None:
    server = StandInVLLM("raw_logprobs")
    client, publisher = gateway(tiny_model_dir, server, allow_raw_logprobs=True)
    reply = await client.chat.completions.create(
        model="tiny",
        messages=HI,
        temperature=0.5,
        max_tokens=3,
        stream=stream,
    )
    if isinstance(reply, openai.AsyncStream):
        _ = [chunk async for chunk in reply]
    [turn] = publisher.turns
    assert turn.logprobs_kind == "raw" and list(turn.completion_ids) == [72, 73, 74]
    assert len(server.generations) == 1
