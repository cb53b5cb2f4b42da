"""``--model-aliases`` through the real ``openai`` and ``anthropic`` SDKs: the default names of
Claude Code and Codex (``claude-...``, ``gpt-...``) are served by the one model the gateway
serves, each reply carries the name its request asked for, the log records the asked name on
the turn and the served one on the session; other names are still a 404 naming the setting."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from eventlog.server import NatsServer
from schemas import SessionOpened
from tests.e2e.test_gateway import FAST_PUBLISH, events_of, turns_of
from tests.helpers.gateway_process import GatewayProcess

pytestmark = pytest.mark.integration

CLAUDE = "claude-sonnet-4-6"
CODEX = "gpt-5.2-codex"
HI: list[Any] = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def gateway(
    nats_server: NatsServer, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    process = GatewayProcess(
        nats_server.url,
        tiny_model_dir,
        tmp_path_factory.mktemp("gateway"),
        *FAST_PUBLISH,
        *("--model-aliases", "claude-*=tiny", "--model-aliases", "gpt-5*=tiny"),
    )
    yield process
    process.stop()


def opened_model(nats_server: NatsServer, sid: str) -> str:
    [opened] = [e for e in events_of(nats_server, sid) if isinstance(e, SessionOpened)]
    return opened.model


def test_claude_codes_default_name_is_served_answered_and_recorded_as_asked(
    gateway: GatewayProcess, nats_server: NatsServer
) -> None:
    sid = str(uuid.uuid4())
    claude = anthropic.Anthropic(
        base_url=gateway.url,  # as Claude Code: its own session header opens the session
        api_key="unused",
        max_retries=0,
        default_headers={"X-Claude-Code-Session-Id": sid},
    )
    whole = claude.messages.create(model=CLAUDE, max_tokens=8, messages=HI)
    assert whole.model == CLAUDE
    with claude.messages.stream(model="claude-haiku-4-5", max_tokens=8, messages=HI) as stream:
        streamed = stream.get_final_message()
    assert streamed.model == "claude-haiku-4-5"
    count = claude.messages.count_tokens(model=CLAUDE, messages=HI)
    assert count.input_tokens > 0

    turns = turns_of(events_of(nats_server, sid))
    assert [t.request["model"] for t in turns] == [CLAUDE, "claude-haiku-4-5"]
    assert opened_model(nats_server, sid) == "tiny"


def test_codexs_default_name_is_served_by_chat_and_responses(
    gateway: GatewayProcess, nats_server: NatsServer
) -> None:
    session = gateway.session()
    sid = str(session["session_id"])
    client = openai.OpenAI(base_url=str(session["base_url"]), api_key="unused", max_retries=0)
    chat = client.chat.completions.create(model=CODEX, messages=HI, max_tokens=8)
    assert chat.model == CODEX
    chunks = list(
        client.chat.completions.create(
            model=CODEX,
            messages=[*HI, {"role": "user", "content": "again"}],
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert {c.model for c in chunks} == {CODEX}
    response = client.responses.create(model=CODEX, input="hello", max_output_tokens=8)
    assert response.model == CODEX
    events = client.responses.create(
        model="tiny", input="hello there", max_output_tokens=8, stream=True
    )
    # The served name, asked by name, is answered as itself (every event's response object).
    assert {e.response.model for e in events if hasattr(e, "response")} == {"tiny"}
    completion = client.completions.create(model=CODEX, prompt="abc", max_tokens=4)
    assert completion.model == CODEX

    turns = turns_of(events_of(nats_server, sid))
    assert [t.request["model"] for t in turns] == [CODEX, CODEX, CODEX, "tiny", CODEX]
    assert opened_model(nats_server, sid) == "tiny"


def test_a_name_no_alias_matches_is_still_a_404_naming_the_setting(
    gateway: GatewayProcess,
) -> None:
    session = gateway.session()
    client = openai.OpenAI(base_url=str(session["base_url"]), api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as refused:
        client.chat.completions.create(model="o3-mini", messages=HI, max_tokens=8)
    assert "--model-aliases 'o3-*=tiny'" in str(refused.value), refused.value
    claude = anthropic.Anthropic(
        base_url=f"{gateway.url}/sessions/{session['session_id']}", api_key="k", max_retries=0
    )
    with pytest.raises(anthropic.NotFoundError) as not_served:
        claude.messages.create(model="Claude-Sonnet", max_tokens=8, messages=HI)  # case counts
    assert "--model-aliases" in str(not_served.value)
    long_name = "ü" * 50_000  # a client's name, shown cut in the message
    with pytest.raises(openai.NotFoundError) as too_long:
        client.chat.completions.create(model=long_name, messages=HI, max_tokens=8)
    assert len(str(too_long.value)) < 2_000, len(str(too_long.value))
    info = httpx.get(f"{gateway.url}/v1/sessions/{session['session_id']}", timeout=10).json()
    assert info["turns"] == 0


def test_the_model_list_names_the_served_model_only(gateway: GatewayProcess) -> None:
    """A glob is no model id: a client choosing from the list chooses the served model."""
    listed = httpx.get(f"{gateway.url}/v1/models", timeout=10).json()
    assert [m["id"] for m in listed["data"]] == ["tiny"]
