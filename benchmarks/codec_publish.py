"""Benchmark: codec throughput, and our JetStream publisher against raw nats-py publishing.

Run it from the repository root::

    .venv/bin/python benchmarks/codec_publish.py           # full run, a few minutes
    .venv/bin/python benchmarks/codec_publish.py --quick   # 2 rounds, 3 codec repeats, noisier

What it measures
----------------
1. **Codec** (``schemas.codec.Codec``): encode + decode round trips of one ``TurnCompleted``
   with 1k, 32k and 128k tokens (prompt = 3/4, completion = 1/4, one float32 logprob per
   completion token) plus the fixed metadata a real turn carries (sampling, timings, usage, a
   short new user message and reply text). Tokens = prompt_ids + completion_ids. Each size is
   timed in a loop calibrated to a fixed wall time, several repeats; the median is reported
   (best alongside). Decoding maps arrays onto the message buffer (no copy), so decode cost is
   nearly independent of the token count; encode copies the arrays once. ``..._32k_with_text``
   adds ~4 characters of message / reply text per token, as a chat turn with its content would
   have, to show what strings cost next to the token arrays.

2. **Publisher** (``eventlog.publisher.JetStreamPublisher``) against raw nats-py JetStream
   publishing of *the same bytes* (same subjects shape, same ``Nats-Msg-Id`` header, same count)
   on one nats-server started by this script (file store, default ``LogSettings`` streams).
   Events are ``TurnCompleted`` sized so the encoded payload is ~1 KB and ~512 KB; they are
   encoded once, outside the timed region. Two modes:

   * ``seq``: one event at a time, waiting for each ack
     (ours ``publish_raw`` vs raw ``js.publish``);
   * ``pipelined``: all events then all acks
     (ours ``publish_many_raw`` vs raw ``js.publish_async`` + ``asyncio.gather``).

   Each run publishes into fresh subjects (its own session id, so no Msg-Id repeats and no
   duplicates), is checked afterwards (stream holds exactly N messages, no duplicate acks, no
   publisher retry) and the EVENTS stream is purged before the next run. A run that is not
   clean (on a loaded machine an ack can miss the publisher's deadline: it retries) is run
   again, up to 3 times; ``publish_runs_discarded`` counts them, and a run still not clean
   the third time is kept and counted in ``publish_runs_unclean_kept`` (its figure includes a
   retry: read it as a lower bound). Rounds alternate which side
   goes first and the median of the rounds is reported per side; ``ratio = ours / raw`` of
   events/s (equal to the MB/s ratio since the bytes are identical). A ratio near 1.0 means
   the publisher's guarantees (deadlines, retries, outbox) cost nothing measurable; below 1.0
   is overhead.

Reading the output: progress and result lines first; the LAST line is one JSON object with all
figures (``codec_tokens_per_s_*``, ``publish_ratio_*`` — pipelined — and
``publish_ratio_seq_*``, the absolute ``publish_<size>_<mode>_<side>_{events,mb}_per_s``, machine
info and date). MB = 10^6 bytes of event payload (headers and protocol not counted). Both sides
share one client connection and one server on the same machine, so absolute numbers include the
server's CPU competing with the client's; compare ratios across machines, absolutes only on the
same machine. Before each run the stream is purged and the page cache synced (untimed), so
one run's writeback does not slow the next. The store lives in the system temp dir unless
``--store-dir`` names another parent (``/dev/shm`` takes the disk out of the picture). On a
small machine run-to-run noise is large (tens of percent): the per-round ratios are printed
and kept in the JSON to show it.

Today's figures (2026-11-25, the 2-core VM shared with other work at load ~10; full run 572 s):
codec round trips 25 M / 456 M / 1,023 M tokens/s at 1k / 32k / 128k tokens (162 M with
text); publish ratios (ours / raw) pipelined 1.18 at 1 KB (2 of its runs kept with a retry),
1.52 at 512 KB; seq 1.61 and 1.12. ``--quick`` 3 minutes earlier: 15 M / 568 M / 601 M tokens/s;
2.08, 1.94; 1.84, 1.24 — the same work per measurement, so the differences are the load's.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from harness.reporting import arguments, banner, finish, machine_info, say
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from eventlog.config import LogSettings
from eventlog.connection import connect
from eventlog.provision import provision
from eventlog.publisher import JetStreamPublisher
from eventlog.server import NatsServer
from schemas.codec import Codec
from schemas.events import TurnCompleted
from schemas.ids import event_subject, turn_msg_id

KB = 1024
MB = 1_000_000  # throughput unit: 10^6 payload bytes
RUN = "bench"
STREAM = "EVENTS"
VOCAB = 151_000


@dataclass(frozen=True)
class Plan:
    """How much work each measurement does (``--quick`` shrinks it)."""

    codec_repeat_s: float
    codec_repeats: int
    rounds: int  # even: each side goes first in half of them
    counts: dict[tuple[str, str], int]  # (size label, mode) -> messages per run


FULL = Plan(
    codec_repeat_s=0.4,
    codec_repeats=7,
    rounds=6,
    counts={
        ("1kb", "seq"): 20_000,
        ("1kb", "pipelined"): 20_000,
        ("512kb", "seq"): 1_000,
        ("512kb", "pipelined"): 1_000,
    },
)
# --quick: the full run's per-measurement work (loop length, messages per run), fewer repeats
# and rounds, so its figures are the full run's, noisier. Smaller runs were not: 150-2,000
# messages per run and 0.1 s codec loops gave rates and ratios 20-60% off the full run's.
QUICK = Plan(codec_repeat_s=0.4, codec_repeats=3, rounds=2, counts=FULL.counts)
SIZES = {"1kb": 1 * KB, "512kb": 512 * KB}
UNCLEAN_TRIES = 3


# -- events -----------------------------------------------------------------------------------


def make_turn(
    n_tokens: int,
    rng: np.random.Generator,
    *,
    session: str = "s0",
    turn: int = 0,
    text_chars_per_token: int = 0,
) -> TurnCompleted:
    """A realistic TurnCompleted with ``n_tokens`` = prompt (3/4) + completion (1/4) tokens."""
    n_prompt = n_tokens * 3 // 4
    n_completion = n_tokens - n_prompt
    user_text = "Run the tests and fix the failing one, then report what changed."
    reply_text = "I ran the tests; one failed in parse(); fixed the off-by-one."
    if text_chars_per_token:
        user_text = ("lorem ipsum dolor sit amet " * (n_prompt * text_chars_per_token // 27 + 1))[
            : n_prompt * text_chars_per_token
        ]
        reply_text = (
            "consectetur adipiscing elit " * (n_completion * text_chars_per_token // 28 + 1)
        )[: n_completion * text_chars_per_token]
    return TurnCompleted(
        run=RUN,
        session=session,
        created_at=1_700_000_000.0,
        turn=turn,
        prefix_len=0,
        prompt_ids=rng.integers(0, VOCAB, n_prompt, dtype=np.int32),
        completion_ids=rng.integers(0, VOCAB, n_completion, dtype=np.int32),
        logprobs=-rng.exponential(0.5, n_completion).astype(np.float32),
        message_prefix_len=0,
        new_messages=[{"role": "user", "content": user_text}],
        sampling={"temperature": 1.0, "top_p": 1.0, "max_tokens": 4096, "logprobs": True},
        finish_reason="stop",
        text=reply_text,
        tool_calls=[],
        weight_version=7,
        template_hash="sha256:9f2c1e0b7a4d3c2b1a09f8e7d6c5b4a3",
        backend="vllm-0",
        timings={"queue_s": 0.0012, "ttft_s": 0.043, "total_s": 1.87},
        usage={"prompt_tokens": n_prompt, "completion_tokens": n_completion},
    )


def sized_payload(target_bytes: int, rng: np.random.Generator) -> tuple[bytes, int]:
    """Encoded TurnCompleted of about ``target_bytes``; returns (payload, tokens)."""
    codec = Codec()
    overhead = len(codec.encode(make_turn(0, rng)))
    # 3/4 prompt ids (4 B) + 1/4 completion ids (4 B) + 1/4 logprobs (4 B) = 5 B per token.
    n = max(4, round((target_bytes - overhead) / 5))
    for _ in range(8):  # msgpack headers grow with the sizes: settle in a few steps
        size = len(codec.encode(make_turn(n, rng)))
        if abs(size - target_bytes) <= 8:
            break
        n = max(4, n + round((target_bytes - size) / 5))
    return codec.encode(make_turn(n, rng)), n


# -- codec ------------------------------------------------------------------------------------


def _time_loop(fn: Callable[[], object], repeat_s: float, repeats: int) -> list[float]:
    """Seconds per call, one figure per repeat, with the loop length calibrated to repeat_s."""
    fn()
    t0 = time.perf_counter()
    calls = 0
    while time.perf_counter() - t0 < repeat_s / 5:
        fn()
        calls += 1
    per_call = (time.perf_counter() - t0) / calls
    iters = max(1, int(repeat_s / per_call))
    out = []
    for _ in range(repeats):
        gc.collect()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        out.append((time.perf_counter() - t0) / iters)
    return out


def bench_codec(plan: Plan, rng: np.random.Generator) -> dict[str, Any]:
    codec = Codec()
    results: dict[str, Any] = {}
    cases = [
        ("1k", 1_000, 0),
        ("32k", 32_000, 0),
        ("128k", 128_000, 0),
        ("32k_with_text", 32_000, 4),
    ]
    say("codec: TurnCompleted encode+decode (prompt 3/4, completion 1/4 + logprobs)")
    say(
        f"  {'case':<14}{'bytes':>10}{'encode µs':>12}{'decode µs':>12}"
        f"{'round trip µs':>15}{'tokens/s (median)':>20}{'tokens/s (best)':>18}"
    )
    for label, tokens, text in cases:
        event = make_turn(tokens, rng, text_chars_per_token=text)
        data = codec.encode(event)
        back = codec.decode(data)
        assert isinstance(back, TurnCompleted)
        assert np.array_equal(back.prompt_ids, event.prompt_ids)
        assert np.array_equal(back.logprobs, event.logprobs)
        enc = _time_loop(lambda e=event: codec.encode(e), plan.codec_repeat_s, plan.codec_repeats)
        dec = _time_loop(lambda d=data: codec.decode(d), plan.codec_repeat_s, plan.codec_repeats)
        rt = _time_loop(
            lambda e=event: codec.decode(codec.encode(e)), plan.codec_repeat_s, plan.codec_repeats
        )
        median, best = statistics.median(rt), min(rt)
        results[label] = {
            "tokens": tokens,
            "encoded_bytes": len(data),
            "encode_us": round(statistics.median(enc) * 1e6, 2),
            "decode_us": round(statistics.median(dec) * 1e6, 2),
            "roundtrip_us": round(median * 1e6, 2),
            "tokens_per_s": round(tokens / median),
            "tokens_per_s_best": round(tokens / best),
        }
        r = results[label]
        say(
            f"  {label:<14}{len(data):>10,}{r['encode_us']:>12,.1f}{r['decode_us']:>12,.1f}"
            f"{r['roundtrip_us']:>15,.1f}{r['tokens_per_s']:>20,}{r['tokens_per_s_best']:>18,}"
        )
    return results


# -- publish ----------------------------------------------------------------------------------

Items = list[tuple[str, bytes, str]]


def make_items(payload: bytes, n: int, session: str) -> Items:
    subject = event_subject(RUN, session, "turn")
    return [(subject, payload, turn_msg_id(RUN, session, i)) for i in range(n)]


async def ours_seq(pub: JetStreamPublisher, js: JetStreamContext, items: Items) -> int:
    dups = 0
    for subject, payload, msg_id in items:
        receipt = await pub.publish_raw(subject, payload, msg_id)
        dups += receipt.duplicate or receipt.spooled
    return dups


async def raw_seq(pub: JetStreamPublisher, js: JetStreamContext, items: Items) -> int:
    dups = 0
    for subject, payload, msg_id in items:
        ack = await js.publish(subject, payload, headers={"Nats-Msg-Id": msg_id})
        dups += bool(ack.duplicate)
    return dups


async def ours_pipelined(pub: JetStreamPublisher, js: JetStreamContext, items: Items) -> int:
    receipts = await pub.publish_many_raw(items)
    assert len(receipts) == len(items)
    return sum(r.duplicate or r.spooled for r in receipts)


async def raw_pipelined(pub: JetStreamPublisher, js: JetStreamContext, items: Items) -> int:
    futures = [
        await js.publish_async(subject, payload, headers={"Nats-Msg-Id": msg_id})
        for subject, payload, msg_id in items
    ]
    acks = await asyncio.gather(*futures)
    return sum(bool(ack.duplicate) for ack in acks)


Runner = Callable[[JetStreamPublisher, JetStreamContext, Items], Awaitable[int]]
RUNNERS: dict[tuple[str, str], Runner] = {
    ("seq", "ours"): ours_seq,
    ("seq", "raw"): raw_seq,
    ("pipelined", "ours"): ours_pipelined,
    ("pipelined", "raw"): raw_pipelined,
}


@dataclass
class Bench:
    nc: NATS
    js: JetStreamContext
    pub: JetStreamPublisher
    runs: int = 0
    discarded: int = 0  # runs done again: not clean (a retry under load), see ``timed``
    unclean_kept: int = 0  # runs not clean UNCLEAN_TRIES times in a row: the last one counts

    async def purge(self) -> None:
        await self.js.purge_stream(STREAM)

    async def timed(self, mode: str, side: str, payload: bytes, n: int, tag: str) -> float:
        """Seconds of a clean run of ``once``: one with a publisher retry (an ack later than
        its deadline on a loaded machine) or a duplicate measures the retry, so it is run again,
        up to UNCLEAN_TRIES times, and counted in ``discarded``; after that the last run counts,
        flagged in ``unclean_kept`` (the JSON's ``publish_runs_unclean_kept``)."""
        for attempt in range(UNCLEAN_TRIES):
            elapsed, unclean = await self.once(mode, side, payload, n, tag)
            if unclean is None:
                return elapsed
            if attempt == UNCLEAN_TRIES - 1:
                self.unclean_kept += 1
                say(f"  {unclean} {UNCLEAN_TRIES} times in a row: kept, flagged")
                return elapsed
            self.discarded += 1
            say(f"  {unclean}: run again")
        raise AssertionError("unreachable")

    async def once(
        self, mode: str, side: str, payload: bytes, n: int, tag: str
    ) -> tuple[float, str | None]:
        """Publish n copies of payload into fresh subjects: seconds, and what made the run
        not a clean measurement (None: nothing). Checks the stream."""
        self.runs += 1
        items = make_items(payload, n, f"{tag}-{mode}-{side}-{self.runs}")
        await self.purge()
        # Write back the previous run's dirty pages now, untimed: otherwise a fast run leaves a
        # writeback debt that the next run pays, and the alternating order turns that into bias.
        await asyncio.to_thread(os.sync)
        retried_before = self.pub.stats.retried
        gc.collect()
        t0 = time.perf_counter()
        dups = await RUNNERS[(mode, side)](self.pub, self.js, items)
        elapsed = time.perf_counter() - t0
        stored = (await self.js.stream_info(STREAM)).state.messages
        retried = self.pub.stats.retried - retried_before
        if stored != n or dups or retried:
            return elapsed, (
                f"{mode}/{side}: stream holds {stored} of {n} messages, {dups} duplicate or "
                f"spooled, {retried} publisher retries: the run is not a clean measurement"
            )
        return elapsed, None


async def bench_publish(
    plan: Plan, rng: np.random.Generator, store_parent: str | None
) -> dict[str, Any]:
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="ts-bench-", dir=store_parent) as tmp:
        results["publish_store_dir"] = tmp
        server = NatsServer(Path(tmp) / "nats").start()
        try:
            nc = await connect(server.url, name="bench")
            try:
                js = nc.jetstream()
                await provision(js, LogSettings())
                pub = await JetStreamPublisher(nc).start()
                bench = Bench(nc, js, pub)
                try:
                    await _publish_sizes(bench, plan, rng, results)
                    results["publish_runs_discarded"] = bench.discarded
                    results["publish_runs_unclean_kept"] = bench.unclean_kept
                finally:
                    await pub.close()
            finally:
                await nc.close()
        finally:
            server.stop()
    return results


async def _publish_sizes(
    bench: Bench, plan: Plan, rng: np.random.Generator, results: dict[str, Any]
) -> None:
    for size, target in SIZES.items():
        payload, tokens = sized_payload(target, rng)
        results[f"publish_payload_bytes_{size}"] = len(payload)
        results[f"publish_payload_tokens_{size}"] = tokens
        say(f"\npublish {size}: payload {len(payload):,} B ({tokens:,} tokens)")
        # Warm-up, untimed: first publish_async makes nats-py's reply subscription, etc.
        for mode in ("seq", "pipelined"):
            for side in ("raw", "ours"):
                await bench.timed(mode, side, payload, max(4, plan.counts[(size, mode)] // 4), "w")
        for mode in ("seq", "pipelined"):
            n = plan.counts[(size, mode)]
            secs: dict[str, list[float]] = {"raw": [], "ours": []}
            for r in range(plan.rounds):
                order = ("raw", "ours") if r % 2 == 0 else ("ours", "raw")
                for side in order:
                    secs[side].append(await bench.timed(mode, side, payload, n, size))
                say(
                    f"  {mode:<10} round {r + 1}/{plan.rounds} ({n:,} msgs): "
                    + "  ".join(f"{s} {n / secs[s][-1]:>9,.0f} ev/s" for s in order)
                )
            eps = {side: n / statistics.median(secs[side]) for side in secs}
            for side in ("ours", "raw"):
                results[f"publish_{size}_{mode}_{side}_events_per_s"] = round(eps[side], 1)
                results[f"publish_{size}_{mode}_{side}_mb_per_s"] = round(
                    eps[side] * len(payload) / MB, 2
                )
            results[f"publish_{size}_{mode}_messages"] = n
            results[f"publish_{size}_{mode}_round_ratios"] = [
                round(raw / ours, 3) for ours, raw in zip(secs["ours"], secs["raw"], strict=True)
            ]
            ratio = round(eps["ours"] / eps["raw"], 3)
            key = f"publish_ratio_{size}" if mode == "pipelined" else f"publish_ratio_seq_{size}"
            results[key] = ratio
            say(
                f"  {mode:<10} median: ours {eps['ours']:>9,.0f} ev/s "
                f"{eps['ours'] * len(payload) / MB:>8,.1f} MB/s | raw {eps['raw']:>9,.0f} ev/s "
                f"{eps['raw'] * len(payload) / MB:>8,.1f} MB/s | ratio {ratio:.3f}"
            )


# -- main -------------------------------------------------------------------------------------


async def main() -> None:
    parser = arguments(
        __doc__, "2 rounds, 3 codec repeats", seed="seed of the random token ids", store_dir=True
    )
    args = parser.parse_args()
    plan = QUICK if args.quick else FULL
    rng = np.random.default_rng(args.seed)
    started = time.perf_counter()
    info = machine_info("nats-py", "msgspec", "numpy")
    banner("codec/publish", args.quick, info)
    codec = bench_codec(plan, rng)
    publish = await bench_publish(plan, rng, args.store_dir)
    duration = time.perf_counter() - started
    figures: dict[str, Any] = {
        "codec_tokens_per_s_1k": codec["1k"]["tokens_per_s"],
        "codec_tokens_per_s_32k": codec["32k"]["tokens_per_s"],
        "codec_tokens_per_s_128k": codec["128k"]["tokens_per_s"],
        "codec_tokens_per_s_32k_with_text": codec["32k_with_text"]["tokens_per_s"],
        "publish_ratio_1kb": publish["publish_ratio_1kb"],
        "publish_ratio_512kb": publish["publish_ratio_512kb"],
        "publish_ratio_seq_1kb": publish["publish_ratio_seq_1kb"],
        "publish_ratio_seq_512kb": publish["publish_ratio_seq_512kb"],
        **{k: v for k, v in publish.items() if not k.startswith("publish_ratio_")},
        "codec": codec,
    }
    finish(figures, quick=args.quick, duration_s=duration, info=info)


if __name__ == "__main__":
    logging.basicConfig(level=logging.ERROR)
    asyncio.run(main())
