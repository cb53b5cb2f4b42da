"""An agent that sees, through each API: the real ``openai`` (Chat Completions, Responses) and
``anthropic`` SDKs send a Pillow-drawn screen every turn to a real gateway serving the built-in
tiny vision-language model (``--model tiny-vl``), and the log's ``TurnCompleted`` events show
each turn's image placeholders expanded as the model's processor expands them, each later turn
continuing the earlier one token for token, and each screen named once, by the turn that first
showed it. Then hostile images, on every API: each a 4xx naming what was wrong, never a 5xx,
and the gateway serving after them.
"""

from __future__ import annotations

import asyncio
import base64
import io
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from PIL import Image, ImageDraw

from consumers.recording import read_recording
from eventlog import JetStreamImageStore, LogSettings, connect
from eventlog.server import NatsServer
from gateway.images.vision import VisionSpec
from gateway.model.tiny_vl import ensure_tiny_vl_model
from schemas import TurnCompleted
from schemas.images import content_digest
from tests.e2e.test_gateway import FAST_PUBLISH, events_of, full_prompts, turns_of
from tests.helpers.gateway_process import GatewayProcess
from tests.helpers.streams import stream_payloads
from tests.integration.test_replay import cli
from tests.unit.test_image_intake import flat_png

pytestmark = pytest.mark.integration

ASK: dict[str, Any] = {"model": "tiny", "max_tokens": 6, "temperature": 0}


def screen(k: int) -> bytes:
    """Turn ``k``'s screenshot: a window drawn at another place and size each turn (so each
    turn's image is new, and the sizes give different placeholder counts)."""
    image = Image.new("RGB", (56 + 28 * k, 84), "white")
    draw = ImageDraw.Draw(image)
    draw.rectangle((4 + 6 * k, 8, 40 + 6 * k, 60), outline="navy", fill=(200, 30 * k, 90))
    draw.text((6, 64), f"step {k}", fill="black")
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


SCREENS = [screen(k) for k in range(3)]


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{b64(data)}"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The gateway's data dir, its tiny-vl model made in it first (as the gateway makes it)."""
    data_dir = tmp_path_factory.mktemp("gateway")
    ensure_tiny_vl_model(data_dir / "models")
    return data_dir


@pytest.fixture(scope="module")
def gateway(nats_server: NatsServer, model_dir: Path) -> Iterator[GatewayProcess]:
    process = GatewayProcess(nats_server.url, Path("tiny-vl"), model_dir, *FAST_PUBLISH)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def vision(model_dir: Path) -> VisionSpec:
    spec = VisionSpec.load(ensure_tiny_vl_model(model_dir / "models"))
    assert spec is not None
    return spec


def placeholders(vision: VisionSpec, data: bytes) -> tuple[int, tuple[int, int, int]]:
    with Image.open(io.BytesIO(data)) as image:
        return vision.placeholders(*image.size)


def assert_sees_each_screen_once(turns: list[TurnCompleted], vision: VisionSpec) -> None:
    """Three turns, each showing its new screen (and the earlier ones, resent): placeholders
    expanded, each turn continuing the last token for token, each screen named by one event."""
    assert [t.turn for t in turns] == [0, 1, 2]
    prompts = full_prompts(turns)
    for t, turn in enumerate(turns):
        [ref] = turn.images  # the resent screens are the kept context's: not named again
        assert ref.sha256 == content_digest(SCREENS[t])
        length, grid = placeholders(vision, SCREENS[t])
        assert (ref.length, tuple(ref.grid), ref.mime) == (length, grid, "image/png")
        assert ref.offset >= turn.prefix_len
        prompt = prompts[t]
        assert prompt[ref.offset : ref.end] == [vision.image_token_id] * length
        shown = sum(placeholders(vision, s)[0] for s in SCREENS[: t + 1])
        assert prompt.count(vision.image_token_id) == shown
        if t:  # tokens in, tokens out: the parent's whole context, then the new tokens
            assert turn.prefix_len == len(prompts[t - 1]) + len(turns[t - 1].completion_ids)
    assert turns[0].new_messages[-1]["content"][1]["image"] == "sha256:" + turns[0].images[0].sha256


def test_chat_completions_agent_sees_a_screen_every_turn(
    gateway: GatewayProcess, nats_server: NatsServer, vision: VisionSpec
) -> None:
    session = gateway.session()
    client = openai.OpenAI(base_url=str(session["base_url"]), api_key="unused", max_retries=0)
    messages: list[Any] = [{"role": "system", "content": "You operate a computer."}]
    for k, shot in enumerate(SCREENS):
        parts = [
            {"type": "text", "text": f"Screen {k}:"},
            {"type": "image_url", "image_url": {"url": data_url(shot), "detail": "high"}},
        ]
        messages.append({"role": "user", "content": parts})
        if k < 2:
            reply = client.chat.completions.create(messages=messages, **ASK)
            text = reply.choices[0].message.content
        else:  # streamed: the same translation, the same turn
            chunks = client.chat.completions.create(messages=messages, stream=True, **ASK)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        messages.append({"role": "assistant", "content": text})
    again = client.chat.completions.create(messages=messages[:-1], **ASK)
    assert again.choices[0].message.content == messages[-1]["content"], "a resend: its reply"
    turns = turns_of(events_of(nats_server, str(session["session_id"])))
    assert_sees_each_screen_once(turns, vision)


def test_responses_agent_sees_a_screen_every_turn_continuing_by_previous_response_id(
    gateway: GatewayProcess, nats_server: NatsServer, vision: VisionSpec
) -> None:
    session = gateway.session()
    client = openai.OpenAI(base_url=str(session["base_url"]), api_key="unused", max_retries=0)
    previous: str | None = None
    ask = {"model": "tiny", "max_output_tokens": 6, "temperature": 0}
    for k, shot in enumerate(SCREENS):
        parts = [
            {"type": "input_text", "text": f"Screen {k}:"},
            {"type": "input_image", "image_url": data_url(shot), "detail": "auto"},
        ]
        # Only the new screen is sent: the earlier ones' bytes are the gateway's to keep.
        follow = {} if previous is None else {"previous_response_id": previous}
        response = client.responses.create(
            input=[{"role": "user", "content": parts}], **follow, **ask
        )
        previous = response.id
    turns = turns_of(events_of(nats_server, str(session["session_id"])))
    assert_sees_each_screen_once(turns, vision)


def test_anthropic_agent_sees_a_screen_every_turn(
    gateway: GatewayProcess, nats_server: NatsServer, vision: VisionSpec
) -> None:
    session = gateway.session()
    sid = str(session["session_id"])
    client = anthropic.Anthropic(
        base_url=f"{gateway.url}/sessions/{sid}", api_key="unused", max_retries=0
    )
    messages: list[Any] = []
    for k, shot in enumerate(SCREENS):
        image = {"type": "base64", "media_type": "image/png", "data": b64(shot)}
        blocks = [{"type": "text", "text": f"Screen {k}:"}, {"type": "image", "source": image}]
        messages.append({"role": "user", "content": blocks})
        counted = client.messages.count_tokens(model="tiny", messages=messages)
        reply = client.messages.create(
            model="tiny", max_tokens=6, messages=messages, extra_body={"temperature": 0}
        )
        if k == 0:  # a first turn is rendered from scratch, as count_tokens renders it
            assert counted.input_tokens == reply.usage.input_tokens
        messages.append({"role": "assistant", "content": [b.model_dump() for b in reply.content]})
    assert_sees_each_screen_once(turns_of(events_of(nats_server, sid)), vision)


def test_a_recording_of_the_agents_replays_into_a_fresh_stack_byte_for_byte(
    gateway: GatewayProcess, nats_server: NatsServer, tmp_path: Path
) -> None:
    """The agents above, recorded (``turnstream record``) and replayed into an empty nats-server
    (``turnstream replay``): the same events, byte for byte, and the same images in its store,
    byte for byte: a recording is self-contained."""
    session = gateway.session()  # one more agent, so the run holds a screen sent again
    client = openai.OpenAI(base_url=str(session["base_url"]), api_key="unused", max_retries=0)
    for k in (0, 1):
        parts = [{"type": "image_url", "image_url": {"url": data_url(SCREENS[k])}}]
        client.chat.completions.create(messages=[{"role": "user", "content": parts}], **ASK)
    recording = tmp_path / "e2e.parquet"
    done = cli("record", "--log.url", nats_server.url, "--run", "e2e", "-o", str(recording))
    assert done.returncode == 0, done.stderr
    recorded = read_recording(recording)
    assert set(recorded.images) >= {content_digest(s) for s in SCREENS}
    assert recorded.meta.images_missing == ()
    fresh = NatsServer(tmp_path / "fresh").start()
    try:
        done = cli("replay", str(recording), "--log.url", fresh.url)
        assert done.returncode == 0, done.stderr

        async def read_back() -> tuple[list[tuple[str, bytes]], dict[str, bytes]]:
            nc = await connect(fresh.url, name="check")
            try:
                store = await JetStreamImageStore.open(nc, LogSettings(url=fresh.url))
                images = {d: await store.get(d) for d in await store.digests()}
                events = await stream_payloads(nc.jetstream(), "EVENTS")
                return [(subject, data) for _, subject, data in events], images
            finally:
                await nc.close()

        events, images = asyncio.run(read_back())
    finally:
        fresh.stop()
    assert events == [(e.subject, e.data) for e in recorded.events]
    assert images == recorded.images


# -- hostile images -----------------------------------------------------------------------

BIG = b"\x89PNG\r\n\x1a\n" + bytes(30 << 20)  # 30 MB: over the body limit, and the image's
JUNK_TYPE = "ïmage/p\u0000ng\U0001f4a9\u202e"


def chat_body(*images: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    urls = [
        {"type": "image_url", "image_url": {"url": i.get("url") or data_url(i["data"], i["type"])}}
        for i in images
    ]
    content = [{"type": "text", "text": "look"}, *urls]
    return "chat/completions", {**ASK, "messages": [{"role": "user", "content": content}]}


def responses_body(*images: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    parts = [
        {"type": "input_image", "image_url": i.get("url") or data_url(i["data"], i["type"])}
        for i in images
    ]
    content = [{"type": "input_text", "text": "look"}, *parts]
    body = {
        "model": "tiny",
        "max_output_tokens": 6,
        "input": [{"role": "user", "content": content}],
    }
    return "responses", body


def anthropic_body(*images: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    sources = [
        {"type": "url", "url": i["url"]}
        if "url" in i
        else {"type": "base64", "media_type": i["type"], "data": b64(i["data"])}
        for i in images
    ]
    blocks = [{"type": "text", "text": "look"}, *({"type": "image", "source": s} for s in sources)]
    body = {"model": "tiny", "max_tokens": 6, "messages": [{"role": "user", "content": blocks}]}
    return "messages", body


APIS: dict[str, tuple[Callable[..., tuple[str, dict[str, Any]]], str]] = {
    "chat": (chat_body, "messages[0].content[1].image_url"),
    "responses": (responses_body, "input[0].content[1].image_url"),
    "anthropic": (anthropic_body, "messages[0].content[1].source"),
}
PNG = {"data": SCREENS[0], "type": "image/png"}
HOSTILE: dict[str, tuple[list[dict[str, Any]], str]] = {
    "30-MB": ([{"data": BIG, "type": "image/png"}], "body|bytes"),
    "png-bomb": ([{"data": flat_png(20000, 20000), "type": "image/png"}], "decompression bomb"),
    "svg": (
        [{"data": b'<svg xmlns="http://www.w3.org/2000/svg"/>', "type": "image/svg+xml"}],
        "SVG",
    ),
    "metadata-url": ([{"url": "http://169.254.169.254/latest/meta-data/"}], "169.254.169.254"),
    "junk-media-type": ([{"data": SCREENS[0], "type": JUNK_TYPE}], "not accepted|not a data URL"),
    "100-images": ([PNG] * 100, "100 images in one request"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
@pytest.mark.parametrize("api", list(APIS))
def test_hostile_images_are_4xx_naming_the_part_and_the_gateway_serves_on(
    gateway: GatewayProcess, api: str, case: str
) -> None:
    build, where = APIS[api]
    images, words = HOSTILE[case]
    path, body = build(*images)
    sid = str(gateway.session()["session_id"])
    response = httpx.post(f"{gateway.url}/sessions/{sid}/v1/{path}", json=body, timeout=60)
    assert 400 <= response.status_code < 500, response.text[:400]
    error = response.json()
    message = error["error"]["message"]
    assert words.split("|")[0] in message or words.split("|")[-1] in message, message
    if api == "anthropic":
        assert error["type"] == "error"
    if response.status_code == 400 and case != "100-images":
        assert message.startswith(where) or where in message, message
    good_path, good = build(PNG)
    assert httpx.get(f"{gateway.url}/health", timeout=10).status_code == 200
    served = httpx.post(f"{gateway.url}/sessions/{sid}/v1/{good_path}", json=good, timeout=60)
    assert served.status_code == 200, served.text[:400]
