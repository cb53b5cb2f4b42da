"""The OpenAI Responses API as Codex CLI and the OpenAI Agents SDK use it: a real gateway
process, the real ``openai`` SDK (``client.responses.create``) and the Agents SDK's default
Responses model, the tiny model fitted to call ``get_weather``, a real nats-server.

Each turn after a tool's output must EXTEND the previous turn (its prompt = the previous
prompt + the sampled completion + only the new messages), whichever way the client sends the
history back: echoed items, or ``previous_response_id``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import agents
import httpx
import openai
import pytest

from eventlog import connect, read_session
from eventlog.server import NatsServer
from schemas import SessionEvent, TurnCompleted
from tests.helpers.gateway_process import GatewayProcess
from tests.helpers.tiny_model import WEATHER_QUESTION, WEATHER_RESULT, WEATHER_TOOLS

pytestmark = pytest.mark.integration

QUESTION = WEATHER_QUESTION[0]["content"]
WEATHER = WEATHER_TOOLS[0]["function"]
# The same tool, flat as the Responses API sends it: canonically identical to the tool the
# model was fitted with, so the model calls it and answers from its result.
TOOL = {"type": "function", "strict": False, **WEATHER}
ASK: dict[str, Any] = {"model": "tiny", "tools": [TOOL], "temperature": 0, "max_output_tokens": 96}


@pytest.fixture(scope="module")
def gateway(
    nats_server: NatsServer, tool_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    process = GatewayProcess(nats_server.url, tool_model_dir, tmp_path_factory.mktemp("gateway"))
    yield process
    process.stop()


def turns_of(server: NatsServer, session: str) -> list[TurnCompleted]:
    async def read() -> list[SessionEvent]:
        nc = await connect(server.url)
        try:
            return await read_session(nc.jetstream(), "e2e", session)
        finally:
            await nc.close()

    events = asyncio.run(read())
    return sorted((e for e in events if isinstance(e, TurnCompleted)), key=lambda e: e.turn)


def response_id_of(turn: TurnCompleted) -> str:
    """The id of the response a turn answered: its session and its reply id (12 hex digits,
    made per request, never the turn index)."""
    assert len(turn.reply_id) == 12 and int(turn.reply_id, 16) >= 0, turn.reply_id
    return f"resp_{turn.session}_{turn.reply_id}"


def assert_extends(turns: list[TurnCompleted], new_roles: list[str]) -> None:
    """Each turn's prompt is the previous prompt + its completion + only the new messages."""
    context: list[int] = []
    for index, turn in enumerate(turns):
        if index:
            assert turn.prefix_len == len(context), f"turn {index} forked"
            assert [m["role"] for m in turn.new_messages] == new_roles
        context = context[: turn.prefix_len] + turn.prompt_ids.tolist()
        context += turn.completion_ids.tolist()


def client_for(session: dict[str, Any]) -> openai.OpenAI:
    return openai.OpenAI(base_url=str(session["base_url"]), api_key="x", max_retries=0)


def echoed(response: Any) -> list[dict[str, Any]]:
    """The output items as a client sends them back (re-serialized by the SDK)."""
    return [item.model_dump(exclude_none=True) for item in response.output]


def tool_outputs(response: Any) -> list[Any]:
    return [
        {"type": "function_call_output", "call_id": item.call_id, "output": WEATHER_RESULT}
        for item in response.output
        if item.type == "function_call"
    ]


def test_a_tool_call_turn_then_its_answer_extend_one_conversation(
    gateway: GatewayProcess, nats_server: NatsServer
) -> None:
    session = gateway.session()
    sid = str(session["session_id"])
    client = client_for(session)
    history: list[Any] = [{"role": "user", "content": QUESTION}]

    first = client.responses.create(input=history, **ASK)
    assert first.status == "completed"
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}

    history += [*echoed(first), *tool_outputs(first)]
    events = list(client.responses.create(input=history, stream=True, **ASK))
    numbers = [e.sequence_number for e in events]
    assert numbers == sorted(set(numbers)), "sequence numbers increase"
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    second = events[-1].response
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == second.output_text and "18" in text

    turns = turns_of(nats_server, sid)
    assert [first.id, second.id] == [response_id_of(turn) for turn in turns]
    assert_extends(turns, ["tool"])
    assert turns[1].request["api"] == "responses"
    for response, turn in zip((first, second), turns, strict=True):
        assert response.usage is not None
        assert response.usage.output_tokens == len(turn.completion_ids)
        assert response.usage.input_tokens == turn.prefix_len + len(turn.prompt_ids)
    assert turns[0].tool_calls[0]["id"] == call.call_id
    assert turns[1].text == second.output_text


def test_streamed_tool_calls_come_as_items_and_the_echo_extends_the_turn(
    gateway: GatewayProcess, nats_server: NatsServer
) -> None:
    """Codex's way: streamed, every item echoed back verbatim (as the done events carried it)."""
    session = gateway.session()
    sid = str(session["session_id"])
    client = client_for(session)
    history: list[Any] = [{"type": "message", "role": "user", "content": QUESTION}]
    ask = {**ASK, "tool_choice": "required", "parallel_tool_calls": True, "store": False}

    events = list(client.responses.create(input=history, stream=True, **ask))
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [item.type for item in done] == [i.type for i in events[-1].response.output]
    calls = [item for item in done if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    # Codex resends a request whose stream broke: the recorded turn again, same ids.
    resent = list(client.responses.create(input=history, stream=True, **ask))
    [turn] = turns_of(nats_server, sid)
    assert resent[-1].response.id == events[-1].response.id == response_id_of(turn)
    assert [i.call_id for i in resent[-1].response.output if i.type == "function_call"] == [
        c.call_id for c in calls
    ]
    assert len(turns_of(nats_server, sid)) == 1
    history += [item.model_dump() for item in done]  # verbatim, None fields included
    history += tool_outputs(events[-1].response)

    answer = client.responses.create(input=history, **ask | {"tool_choice": "auto"})
    assert answer.id == response_id_of(turns_of(nats_server, sid)[1])
    assert_extends(turns_of(nats_server, sid), ["tool"])


def test_previous_response_id_continues_its_turn_and_a_resend_adds_none(
    gateway: GatewayProcess, nats_server: NatsServer
) -> None:
    session = gateway.session()
    sid = str(session["session_id"])
    client = client_for(session)
    first = client.responses.create(input=QUESTION, **ASK)
    follow = {"previous_response_id": first.id, "input": tool_outputs(first), **ASK}

    second = client.responses.create(**follow)
    assert second.previous_response_id == first.id
    again = client.responses.create(**follow)  # the same body: a client's retry
    assert again.id == second.id and again.output_text == second.output_text
    streamed = list(client.responses.create(**follow, stream=True))
    assert streamed[-1].response.id == second.id

    turns = turns_of(nats_server, sid)
    assert len(turns) == 2, "a resent request is answered with its turn, not a new one"
    assert [first.id, second.id] == [response_id_of(turn) for turn in turns]
    assert_extends(turns, ["tool"])
    assert turns[1].request["previous_response_id"] == first.id

    # An earlier response, other input: a branch off it (the session is a tree).
    branch = client.responses.create(**{**follow, "input": "And tomorrow?"})
    assert branch.id == response_id_of(turns_of(nats_server, sid)[2])
    assert turns_of(nats_server, sid)[2].parent_turn == 0
    for bad, why in (
        (f"resp_{sid}_9", "holds no such response"),  # an index, not its id
        (f"resp_{sid}_0123456789ab", "holds no such response"),
        ("resp_other_0", "of session 'other'"),
        ("nope", "previous_response_id"),
    ):
        body = {**follow, "previous_response_id": bad, "input": "And tomorrow?"}
        refused = httpx.post(f"{session['base_url']}/responses", json=body)
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["param"] == "previous_response_id" and why in error["message"], error


def test_the_global_route_takes_codexs_session_header_or_the_previous_response(
    gateway: GatewayProcess, nats_server: NatsServer
) -> None:
    sid = "codex-0198a2b3-c4d5"
    codex = openai.OpenAI(
        base_url=f"{gateway.url}/v1",
        api_key="x",
        max_retries=0,
        default_headers={"session-id": sid},
    )
    first = codex.responses.create(input=QUESTION, **ASK)
    assert first.id == response_id_of(turns_of(nats_server, sid)[0])
    # No header: the session is the one previous_response_id names.
    anonymous = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
    second = anonymous.responses.create(
        previous_response_id=first.id, input=tool_outputs(first), **ASK
    )
    assert second.id == response_id_of(turns_of(nats_server, sid)[1])
    assert_extends(turns_of(nats_server, sid), ["tool"])

    missing = httpx.post(
        f"{gateway.url}/v1/responses",
        json={"input": "hi", "previous_response_id": "resp_never-opened_0"},
    )
    assert missing.status_code == 400
    assert missing.json()["error"]["param"] == "previous_response_id"
    no_session = httpx.post(f"{gateway.url}/v1/responses", json={"input": "hi"})
    assert no_session.status_code == 400 and "session" in no_session.json()["error"]["message"]


def _weather_tool() -> agents.FunctionTool:
    async def invoke(context: Any, arguments: str) -> str:
        assert json.loads(arguments) == {"city": "Paris"}
        return WEATHER_RESULT

    return agents.FunctionTool(
        name="get_weather",
        description=WEATHER["description"],
        params_json_schema=WEATHER["parameters"],
        on_invoke_tool=invoke,
        strict_json_schema=False,
    )


def _agent(client: openai.AsyncOpenAI) -> agents.Agent[Any]:
    return agents.Agent(
        name="weather",
        model=agents.OpenAIResponsesModel(model="tiny", openai_client=client),
        tools=[_weather_tool()],
        # Named: the call does not depend on the model; reset after the call (the default),
        # so the second model call answers.
        model_settings=agents.ModelSettings(
            temperature=0, max_tokens=96, tool_choice="get_weather"
        ),
    )


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
async def test_the_agents_sdk_runs_a_tool_and_answers_in_one_extended_session(
    gateway: GatewayProcess, nats_server: NatsServer, streamed: bool
) -> None:
    agents.set_tracing_disabled(True)
    if streamed:  # Codex's way in: the global route and a session header
        sid = "agents-streamed-1"
        client = openai.AsyncOpenAI(
            base_url=f"{gateway.url}/v1",
            api_key="x",
            max_retries=0,
            default_headers={"X-Session-Id": sid},
        )
    else:
        session = gateway.session()
        sid = str(session["session_id"])
        client = openai.AsyncOpenAI(base_url=str(session["base_url"]), api_key="x", max_retries=0)
    agent = _agent(client)
    if streamed:
        run = agents.Runner.run_streamed(agent, QUESTION, max_turns=3)
        async for _ in run.stream_events():
            pass
        output = run.final_output
    else:
        output = (await agents.Runner.run(agent, QUESTION, max_turns=3)).final_output
    await client.close()

    turns = await asyncio.to_thread(turns_of, nats_server, sid)
    assert len(turns) == 2
    assert turns[0].tool_calls[0]["function"]["name"] == "get_weather"
    assert_extends(turns, ["tool"])
    assert output == turns[1].text and "18" in output


def test_errors_are_400s_with_openai_bodies_naming_the_field(gateway: GatewayProcess) -> None:
    session = gateway.session()
    url = f"{session['base_url']}/responses"
    image = {"type": "input_image", "image_url": "http://x/y.png"}
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text", "structured"),
        ({"input": [{"role": "user", "content": [image]}]}, "input", "does not fetch images"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "item_reference"),
        ({"input": [{"type": "local_shell_call", "id": "x"}]}, "input", "function_call"),
        ({"conversation": "conv_1"}, "", "'conversation' is not supported"),
        ({"tool_choice": {"type": "function", "name": "f"}}, "", "not among"),
        ({"tool_choice": "required"}, "", "needs function tools"),
        ({"tools": [{"name": "no-type"}]}, "tools", "type"),
        ({"input": 5}, "input", "input"),
        ({"temperature": 3}, "temperature", "temperature"),
        ({"previous_response_id": "msg_1"}, "previous_response_id", "pattern"),
    ]
    for extra, param, words in cases:
        refused = httpx.post(url, json={"model": "tiny", "input": "hi", **extra})
        assert refused.status_code == 400, (extra, refused.text)
        error = refused.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert error["param"].startswith(param) and words in error["message"], (extra, error)
    with pytest.raises(openai.NotFoundError, match="not served"):
        client_for(session).responses.create(model="gpt-5", input="hi")


def test_codexs_captured_requests_are_accepted(gateway: GatewayProcess) -> None:
    """Codex's real bodies pass validation (tools of every type, developer messages,
    reasoning, include, client_metadata, ...); their ~40k byte-level tokens are over the tiny
    model's context, so the answer is the context-length 413, not a 400."""
    fixtures = Path(__file__).parents[1] / "fixtures" / "agents" / "codex"
    for k in (1, 2, 3):
        captured = json.loads((fixtures / f"request_{k}.json").read_text())
        headers = {"session-id": captured["headers"]["session-id"]}
        response = httpx.post(f"{gateway.url}/v1/responses", json=captured["body"], headers=headers)
        assert response.status_code == 413, response.text
        assert response.json()["error"]["code"] == "context_length_exceeded"
