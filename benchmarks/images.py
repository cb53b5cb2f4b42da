"""Benchmark: images in turns, what they cost to store and what a new one costs the gateway.

Run it from the repository root (nats-server on PATH, or in the venv's bin)::

    .venv/bin/python benchmarks/images.py           # 20-turn session, 12 paired rounds
    .venv/bin/python benchmarks/images.py --quick   # 8 turns, 4 rounds (< 60 s)

What it measures
----------------
A GUI agent's session through a real gateway (``--backend vllm`` on the tiny Qwen2-VL, its
processor's placeholders expanded by the gateway) in front of the fixed-latency stand-in of
vLLM's ``/inference/v1/generate`` (``harness/fixed_latency_backend.py``: its reply after
``--ttft-ms``), nats-server started here. Images are ~1 MB screenshots: 1280x800 PNGs, a flat
desktop with one band of noise, each turn's new one its own (``screenshot``). Chat Completions
requests with data URLs, the whole conversation resent each turn, as agents send it.

* **Storage**: a session of T turns (20; ``--quick`` 8); turn t's new user message holds the
  same screenshot every turn plus one new image, and the whole history is resent, so turn t's
  request holds 2(t+1) images. ``stored`` = the EVENTS stream's bytes + the image bucket's
  stream bytes (``OBJ_ts_images``: chunks and metadata), JetStream's own figures.
  ``naive`` = the EVENTS bytes + every image of every request inline (what a proxy recording
  requests would keep: each turn's event holding its request's images); ``naive_delta`` = the
  EVENTS bytes + each turn's NEW messages' images inline (delta-encoded events with images in
  them). ``storage_ratio`` = naive / stored; target >= 10.
* **Gateway CPU per later turn with one new image**: from the stored session's last kept turn,
  rounds of two requests, paired, the order alternating: the same continued conversation with a
  new user message holding one new ~1 MB image (``with``), and holding the same text only
  (``without``); each a new branch of the same kept turn (a different text each round, so
  neither is a resend). CPU = the gateway process's threads' on-CPU time over the request
  (/proc/PID/task/*/schedstat: ns, where /proc/PID/stat counts 10 ms ticks);
  the figures are medians over the rounds. ``image_turn_added_cpu_ms`` = with - without.
* **Where the time goes**, in this process, on the same ~1 MB image (median of 20): decoding the
  data URL's base64, the checks (Pillow: header, verify, full decode;
  ``gateway.images.check_image``), the SHA-256, the placeholder count, the upload to the image
  store (a new image each time, a real nats-server), and the base64 of the image sent to vLLM
  in the generate request's data URL.

``--profile-gateway FILE``: after the rounds, 6 more later text turns run under the gateway's
cProfile, printed by category (where a turn that resends 2T images spends its time).

The LAST line is one JSON object of these figures and the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import io
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from harness.cpu import thread_cpu_ns
from harness.gateway_profile import print_profile
from harness.options import gateway_arguments
from harness.reporting import banner, finish, gateway_machine_info, say
from harness.stack import fixed_latency_stack

JSON = dict[str, Any]
WIDTH, HEIGHT = 1280, 800
PROFILED_TURNS = 6  # later text turns run under the gateway's profiler (--profile-gateway)


def screenshot(seed: int, target: int = 1_000_000) -> bytes:
    """A ~``target``-byte PNG: a flat desktop, a title bar, and a band of noise (a photo in a
    window) whose height is chosen so the file is about ``target`` bytes."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    base = Image.new("RGB", (WIDTH, HEIGHT), (40 + seed % 50, 60, 90))
    draw = ImageDraw.Draw(base)
    draw.rectangle([0, 0, WIDTH, 30], fill=(220, 220, 220))
    draw.text((10, 8), f"screen {seed}", fill=(0, 0, 0))
    rows = 200
    for _ in range(6):  # noise costs ~3 bytes a pixel in PNG: settle the band's height
        img = base.copy()
        noise = rng.integers(0, 256, (rows, WIDTH, 3), dtype=np.uint8)
        img.paste(Image.fromarray(noise), (0, 100))
        out = io.BytesIO()
        img.save(out, format="PNG")
        size = out.tell()
        if abs(size - target) < target * 0.02:
            break
        rows = max(1, min(HEIGHT - 100, int(rows * target / size)))
    return out.getvalue()


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def image_message(text: str, *images: bytes) -> JSON:
    parts: list[JSON] = [{"type": "text", "text": text}]
    parts += [{"type": "image_url", "image_url": {"url": data_url(i)}} for i in images]
    return {"role": "user", "content": parts}


async def chat(client: httpx.AsyncClient, session: str, messages: list[JSON]) -> JSON:
    response = await client.post(
        f"/sessions/{session}/v1/chat/completions",
        json={"messages": messages, "max_tokens": 8},  # no model: the served one
    )
    if response.status_code != 200:
        raise RuntimeError(f"turn refused: {response.status_code} {response.text[:500]}")
    reply: JSON = response.json()
    return reply


async def stream_bytes(js: Any, stream: str) -> int:
    return int((await js.stream_info(stream)).state.bytes)


async def storage(client: httpx.AsyncClient, js: Any, turns: int) -> tuple[str, list[JSON], JSON]:
    """The T-turn session; its stored bytes against the naive ones."""
    opened = (await client.post("/v1/sessions", json={})).json()
    session = opened["session_id"]
    shot = screenshot(0)
    messages: list[JSON] = []
    inline = inline_new = 0
    for t in range(turns):
        new = screenshot(1000 + t)
        messages.append(image_message(f"turn {t}: what changed?", shot, new))
        reply = await chat(client, session, messages)
        messages.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"]})
        inline += (t + 1) * (len(shot) + len(new))  # every image of the request
        inline_new += len(shot) + len(new)  # the new message's
        say(f"  turn {t + 1}/{turns}: request holds {2 * (t + 1)} images")
    events = await stream_bytes(js, "EVENTS")
    objects = await stream_bytes(js, "OBJ_ts_images")
    stored = events + objects
    figures = {
        "storage_turns": turns,
        "storage_events_bytes": events,
        "storage_image_bucket_bytes": objects,
        "storage_stored_bytes": stored,
        "storage_naive_bytes": events + inline,
        "storage_naive_delta_bytes": events + inline_new,
        "storage_ratio": round((events + inline) / stored, 2),
        "storage_ratio_delta": round((events + inline_new) / stored, 2),
        "storage_images_sent": 2 * sum(range(1, turns + 1)),
        "storage_images_unique": turns + 1,
    }
    return session, messages, figures


async def cpu_rounds(
    client: httpx.AsyncClient, pid: int, session: str, history: list[JSON], rounds: int
) -> JSON:
    """Paired, alternating: one new image, or the same text alone."""
    with_ms: list[float] = []
    without_ms: list[float] = []
    for r in range(rounds):
        image = screenshot(5000 + r)
        sides = [("with", image), ("without", None)]
        if r % 2:
            sides.reverse()
        for side, png in sides:
            text = f"round {r} ({side}): and now?"
            message = image_message(text, png) if png is not None else image_message(text)
            before = thread_cpu_ns(pid)
            await chat(client, session, [*history, message])
            spent = (thread_cpu_ns(pid) - before) / 1e6
            (with_ms if side == "with" else without_ms).append(spent)
        say(f"  round {r + 1}/{rounds}: with {with_ms[-1]:.1f} ms, without {without_ms[-1]:.1f} ms")
    with_med, without_med = statistics.median(with_ms), statistics.median(without_ms)
    return {
        "image_turn_cpu_ms": round(with_med, 2),
        "text_turn_cpu_ms": round(without_med, 2),
        "image_turn_added_cpu_ms": round(with_med - without_med, 2),
        "image_turn_cpu_ratio": round(with_med / without_med, 2),
        "cpu_rounds": rounds,
    }


def _median_ms(fn: Any, n: int = 20) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - t0))
    return round(statistics.median(times), 3)


async def breakdown(js_url: str, settings_dir: Path) -> JSON:
    """The gateway's steps for one new ~1 MB image, one at a time, in this process."""
    from eventlog import JetStreamImageStore, LogSettings, connect, provision
    from gateway.images import ImageLimits, VisionSpec, check_image, image_from_data_url
    from gateway.model import ensure_tiny_vl_model

    png = screenshot(7)
    url = data_url(png)
    limits = ImageLimits()
    vision = VisionSpec.load(ensure_tiny_vl_model(settings_dir))
    assert vision is not None
    figures: JSON = {"image_bytes": len(png), "image_size": f"{WIDTH}x{HEIGHT}"}
    figures["cpu_ms_base64_decode"] = _median_ms(lambda: base64.b64decode(url[22:]))
    figures["cpu_ms_check"] = _median_ms(lambda: check_image(png, where="bench", limits=limits))
    figures["cpu_ms_sha256"] = _median_ms(lambda: hashlib.sha256(png).hexdigest())
    figures["cpu_ms_placeholders"] = _median_ms(lambda: vision.placeholders(WIDTH, HEIGHT))
    figures["cpu_ms_intake_total"] = _median_ms(
        lambda: image_from_data_url(url, where="bench", limits=limits)
    )
    figures["cpu_ms_base64_encode_for_vllm"] = _median_ms(lambda: base64.b64encode(png))
    settings = LogSettings(url=js_url)
    nc = await connect(js_url, name="bench-images")
    try:
        await provision(nc.jetstream(), settings)
        store = await JetStreamImageStore.open(nc, settings)
        uploads = []
        for i in range(20):
            fresh = png + i.to_bytes(4, "big")  # a new object each time (bytes after IEND)
            t0, c0 = time.perf_counter(), time.process_time()
            await store.put(fresh)
            uploads.append((1000 * (time.process_time() - c0), 1000 * (time.perf_counter() - t0)))
        figures["cpu_ms_upload"] = round(statistics.median(u[0] for u in uploads), 3)
        figures["wall_ms_upload"] = round(statistics.median(u[1] for u in uploads), 3)
        t0 = time.process_time()
        for _ in range(20):
            await store.put(png + (0).to_bytes(4, "big"))  # stored already: one look-up
        figures["cpu_ms_put_stored"] = round(1000 * (time.process_time() - t0) / 20, 3)
    finally:
        await nc.close()
    return figures


async def main(args: argparse.Namespace) -> None:
    started = time.perf_counter()
    info = gateway_machine_info()
    banner("images", args.quick, info)
    if args.max_inflight_per_replica is None:
        args.max_inflight_per_replica = 16
    turns = 8 if args.quick else 20
    rounds = args.rounds or (4 if args.quick else 12)
    from gateway.model import ensure_tiny_vl_model

    model_dir = ensure_tiny_vl_model(Path(args.model_cache))
    figures: JSON = {}
    with tempfile.TemporaryDirectory(dir=args.store_dir) as tmp:
        async with fixed_latency_stack(
            args, Path(tmp), 4096, "bench-images", model_dir=model_dir, completion=_reply(model_dir)
        ) as stack:
            async with httpx.AsyncClient(base_url=stack.gateway_url, timeout=120) as client:
                say(f"storage: a {turns}-turn session, a screenshot resent + a new image a turn")
                session, history, stored = await storage(client, stack.js, turns)
                figures.update(stored)
                say(f"CPU: {rounds} paired rounds, a later turn with and without a new image")
                figures.update(
                    await cpu_rounds(client, stack.procs.gateway.pid, session, history, rounds)
                )
                if args.profile_gateway:  # where a later turn's time goes, under cProfile
                    stack.procs.toggle_profile()
                    for r in range(PROFILED_TURNS):
                        await chat(client, session, [*history, image_message(f"profiled {r}")])
                    stack.procs.toggle_profile()
            figures.update(await breakdown(stack.procs.nats.url, Path(args.model_cache)))
    if args.profile_gateway:  # written when the gateway stopped
        figures["profile"] = print_profile(
            args.profile_gateway, args.profile_top, PROFILED_TURNS, figures["text_turn_cpu_ms"]
        )
    say("")
    for key, value in figures.items():
        say(f"  {key}: {value}")
    finish(figures, quick=args.quick, duration_s=time.perf_counter() - started, info=info)


def _reply(model_dir: Path) -> list[int]:
    """A short reply the tiny VL tokenizer makes, ending its turn."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [*tokenizer.encode("I see it.", add_special_tokens=False), int(tokenizer.eos_token_id)]


if __name__ == "__main__":
    asyncio.run(main(gateway_arguments(__doc__).parse_args()))
