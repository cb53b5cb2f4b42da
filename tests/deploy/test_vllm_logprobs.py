"""Rollout log-probs and per-request seeds against real vLLM servers (issue 19).

Three vLLM 0.32 CPU servers on the head_dim-64 tiny model (``tests/deploy/vllm_server.py``),
started concurrently: two alike (``--seed 0``, vLLM's default, and ``--logprobs-mode
processed_logprobs``) and one in vLLM's default (raw) logprobs mode. Three real gateway
processes on a real nats-server: one in front of the processed pair, two in front of the raw one
(without and with ``--allow-raw-logprobs``). Agents on the ``openai`` SDK.

* **each replica's kind is probed** at the gateway's start: the processed pair "processed", the
  default one "raw"; the gateway logs each probe's time. Measured (2026-11-25, 2 busy cores,
  two runs): 2.8-5.4 s for the pair probed concurrently and 2.1-2.4 s for the raw one, each the
  first requests a freshly started server serves (its warm-up); 79 ms for the raw one probed
  again by the third gateway once it had served requests.
* **processed mode**: at temperature 0.5, at top_p 0.9 and at both (0.7 and 0.9), streamed and
  not (more turns while they total 24 tokens or fewer: each session's derived seed is new, and
  the tiny model sometimes draws its end token within a few tokens), every recorded log-prob
  equals the fp32 transformers recomputation of the distribution sampled from (``logits / T``
  masked to vLLM's top-p nucleus and renormalized:
  ``gateway.backends.sampler.processed_log_probs``) on the recorded prefix within 1e-4. Measured
  max |Δ| (two runs, 64-96 tokens each): 7.2e-07 and 9.5e-07 at temperature 0.5, 4.8e-07 and
  9.5e-07 at top_p 0.9, 4.8e-07 for both; the raw log-probs are off by up to 1.6, 0.105 and
  0.6-0.8 nats there, which the test also checks (the bound tells the two apart).
* **raw mode**: temperature 0.5 or top_p 0.9 is a 400 naming ``--logprobs-mode
  processed_logprobs`` and ``--allow-raw-logprobs``, streamed or not, and the turn never
  reaches vLLM (its counters grow by probe requests at most); temperature 1 is served and
  recorded "sampled". With ``--allow-raw-logprobs`` temperature 0.5 is served and recorded
  ``logprobs_kind: "raw"`` (its log-probs the untempered distribution's, within 1e-4), the
  batch assembled from the folded sessions flags that row (``raw_logprobs``) and not the
  temperature-1 one, and the reference trainer's ``check_sampled_logprobs`` refuses it.
* **seeds**: the two replicas started alike, sent the same unseeded request directly, sample
  the same tokens: the issue's premise, and why the gateway derives a seed per turn. A GRPO
  group of four sessions of one prompt, no client seed, sent concurrently through the gateway
  and spread over both replicas, records four distinct derived seeds and is not four copies of
  one rollout; regenerating each session (``turnstream.data.regenerate.regenerate``) on the replica
  that did NOT serve it reproduces all four token for token (7 to 48 tokens; log-probs
  bit-identical, max |Δ| 0, in both runs).

Three servers start in about 2 minutes (concurrently); the module takes about 3 minutes.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from consumers import fold
from eventlog import connect, read_session
from eventlog.server import NatsServer
from gateway.backends.probe import PROBE_PROMPT
from gateway.backends.vllm import VLLMBackend
from schemas import TurnCompleted
from schemas.events import SessionEvent
from tests.deploy.vllm_server import SERVED_NAME, VLLMServer, vllm_python, vllm_tiny_model
from tests.helpers.gateway_process import GatewayProcess
from tests.helpers.recompute import recompute, turn_prompts
from trainer_sink.assembly import assemble
from trainer_sink.errors import BatchError
from turnstream.data.regenerate import RegenerationReport, regenerate
from turnstream.trainer.objective import check_sampled_logprobs

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]

BOUND = 1e-4
MAX_TOKENS = 48
MAX_TURNS = 8  # per sampling in the processed-mode test, while its samples are short
GROUP_SIZE = 4
PROMPT = [{"role": "user", "content": "Tell me a story about a lighthouse."}]
PROCESSED_FLAG = "--logprobs-mode processed_logprobs"
# gateway.backends.probe.probe_replicas' line for each replica (its kind, the probe's time).
PROBE_LINE = re.compile(r"replica (\S+): log-probs (\w+) \(.*?\); probed in ([\d.]+) ms")


@dataclass
class Replicas:
    processed: list[VLLMServer]  # alike: --seed 0, --logprobs-mode processed_logprobs
    raw: VLLMServer  # vLLM's default logprobs mode
    model_dir: Path


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replicas]:
    python, model_dir = vllm_python(), vllm_tiny_model()
    logs = tmp_path_factory.mktemp("vllm-logs")
    servers = [
        VLLMServer(python, model_dir, logs, name="processed-0"),
        VLLMServer(python, model_dir, logs, name="processed-1"),
        VLLMServer(python, model_dir, logs, name="raw", logprobs_mode=None),
    ]
    try:
        for server in servers:  # concurrently: each takes 1-3 min on 2 cores
            server.start()
        for server in servers:
            server.wait_ready()
        print(f"vLLM servers ready in {[round(s.ready_s or 0) for s in servers]} s")
        yield Replicas(servers[:2], servers[2], model_dir)
    finally:
        for server in servers:
            server.stop()


def _gateway(
    nats: NatsServer, replicas: Replicas, servers: list[VLLMServer], data: Path, *extra: str
) -> GatewayProcess:
    urls = ",".join(server.url for server in servers)
    return GatewayProcess(
        nats.url, replicas.model_dir, data, "--backend", "vllm", "--backend-urls", urls, *extra
    )


@pytest.fixture(scope="module")
def processed_gateway(
    nats_server: NatsServer, replicas: Replicas, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    gateway = _gateway(nats_server, replicas, replicas.processed, tmp_path_factory.mktemp("gw"))
    yield gateway
    gateway.stop()


@pytest.fixture(scope="module")
def raw_gateway(
    nats_server: NatsServer, replicas: Replicas, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    gateway = _gateway(nats_server, replicas, [replicas.raw], tmp_path_factory.mktemp("gw-raw"))
    yield gateway
    gateway.stop()


@pytest.fixture(scope="module")
def raw_allowed_gateway(
    nats_server: NatsServer, replicas: Replicas, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    data = tmp_path_factory.mktemp("gw-raw-allowed")
    gateway = _gateway(nats_server, replicas, [replicas.raw], data, "--allow-raw-logprobs")
    yield gateway
    gateway.stop()


@pytest.fixture(scope="module")
def model(replicas: Replicas) -> PreTrainedModel:
    loaded = AutoModelForCausalLM.from_pretrained(replicas.model_dir, dtype=torch.float32)
    loaded.train(False)
    return loaded


# -- helpers -------------------------------------------------------------------------------


def ask(
    gateway: GatewayProcess,
    run: str,
    *,
    group: str | None = None,
    stream: bool = False,
    **sampling: Any,
) -> tuple[str, list[float]]:
    """One turn of a new session of ``run``: its id and the log-probs the SDK received."""
    opened = gateway.session(run=run, **({} if group is None else {"group": group}))
    client = openai.OpenAI(base_url=str(opened["base_url"]), api_key="unused", max_retries=0)
    params: dict[str, Any] = {
        "model": SERVED_NAME,
        "messages": PROMPT,
        "max_tokens": MAX_TOKENS,
        "logprobs": True,
        **sampling,
    }
    logprobs: list[float] = []
    if stream:
        for chunk in client.chat.completions.create(**params, stream=True):
            for choice in chunk.choices:
                if choice.logprobs is not None and choice.logprobs.content:
                    logprobs += [c.logprob for c in choice.logprobs.content]
    else:
        choice = client.chat.completions.create(**params).choices[0]
        assert choice.logprobs is not None and choice.logprobs.content is not None
        logprobs = [c.logprob for c in choice.logprobs.content]
    return str(opened["session_id"]), logprobs


async def _read(nats: NatsServer, run: str, session: str) -> list[SessionEvent]:
    nc = await connect(nats.url, name="vllm-logprobs-test")
    try:
        return await read_session(nc.jetstream(), run, session)
    finally:
        await nc.close()


def events_of(nats: NatsServer, run: str, session: str) -> list[SessionEvent]:
    return asyncio.run(_read(nats, run, session))


def only_turn(nats: NatsServer, run: str, session: str) -> TurnCompleted:
    turns = [e for e in events_of(nats, run, session) if isinstance(e, TurnCompleted)]
    assert len(turns) == 1, f"session {run}/{session}: {len(turns)} turns recorded, 1 sent"
    return turns[0]


def close(gateway: GatewayProcess, run: str, session: str, reward: float) -> None:
    closed = httpx.post(
        f"{gateway.url}/v1/sessions/{session}/close",
        json={"reward": reward},
        headers={"X-Run-Id": run},
        timeout=10,
    )
    assert closed.status_code == 200, closed.text


def served(server: VLLMServer) -> tuple[float, float, float]:
    """What ``server`` counted so far: requests, prompt tokens, generated tokens."""
    counted = server.metrics()
    return (
        counted.get("vllm:request_success_total", 0.0),
        counted.get("vllm:prompt_tokens_total", 0.0),
        counted.get("vllm:generation_tokens_total", 0.0),
    )


def unseeded_sample(server: VLLMServer) -> list[int]:
    """A temperature-1 sample straight from vLLM, no seed: drawn from its engine's generator."""
    body = {
        "model": SERVED_NAME,
        "prompt": [1, 2, 3, 4, 5, 6, 7, 8],
        "max_tokens": 16,
        "temperature": 1.0,
        "return_token_ids": True,
    }
    reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    reply.raise_for_status()
    return list(reply.json()["choices"][0]["token_ids"])


# -- tests ---------------------------------------------------------------------------------
# The group test runs first: until then both processed replicas have served exactly the same
# requests (the gateway's probes), so their engines' generators are in one state.


def test_replicas_alike_sample_alike_but_a_group_does_not_and_regenerates(
    nats_server: NatsServer, replicas: Replicas, processed_gateway: GatewayProcess
) -> None:
    run, group = "grpo-seeds", "lighthouse"
    # Why seeds are derived: the same unseeded request to each replica draws the same sample.
    direct = [unseeded_sample(server) for server in replicas.processed]
    assert direct[0] == direct[1], f"replicas started alike sampled differently: {direct}"

    with ThreadPoolExecutor(GROUP_SIZE) as pool:  # a GRPO group: one prompt, concurrently
        sent = list(pool.map(lambda _: ask(processed_gateway, run, group=group), range(GROUP_SIZE)))
    turns = {session: only_turn(nats_server, run, session) for session, _ in sent}
    served = {s: t.backend for s, t in turns.items()}
    seeds = {s: t.sampling.get("seed") for s, t in turns.items()}
    print(f"group served by {served}; seeds {seeds}")
    assert set(served.values()) == {"vllm-0", "vllm-1"}, f"the group's replicas: {served}"
    assert all(isinstance(seed, int) for seed in seeds.values()), seeds
    assert len(set(seeds.values())) == GROUP_SIZE, f"group members share a seed: {seeds}"
    assert all(t.sampling.get("seed_derived") is True for t in turns.values()), turns
    rollouts = {s: tuple(t.completion_ids.tolist()) for s, t in turns.items()}
    assert len(set(rollouts.values())) > 1, f"four identical rollouts: {rollouts}"

    # Regenerated on the replica that did NOT serve each: the seed, not a replica's state,
    # makes the sample.
    for session, turn in turns.items():
        other = replicas.processed[1 - int(turn.backend.removeprefix("vllm-"))]
        report = asyncio.run(_regenerate(events_of(nats_server, run, session), other))
        lines = [t.line() for t in report.turns]
        print("\n".join(lines))
        assert report.ok and report.count("same") == 1, f"on {other.url}: {lines}"


async def _regenerate(events: list[SessionEvent], server: VLLMServer) -> RegenerationReport:
    backend = VLLMBackend(server.url, SERVED_NAME, backend_id="regenerate", max_context=4096)
    try:
        return await regenerate(events, backend)
    finally:
        await backend.close()


@pytest.mark.parametrize(
    "sampling",
    [{"temperature": 0.5}, {"top_p": 0.9}, {"temperature": 0.7, "top_p": 0.9}],
    ids=["temperature-0.5", "top_p-0.9", "both"],
)
def test_processed_replicas_record_the_sampled_distribution(
    nats_server: NatsServer,
    processed_gateway: GatewayProcess,
    model: PreTrainedModel,
    sampling: dict[str, Any],
) -> None:
    run = "logprobs-processed"
    deltas, lengths, moved = [], [], 0.0
    # Streamed and not, then more turns while the samples were short: the tiny model draws its
    # end token early now and then (16 tokens over two turns once in CI), and the comparison
    # wants more than MAX_TOKENS // 2 of them.
    for turn_index in range(MAX_TURNS):
        if turn_index >= 2 and sum(lengths) > MAX_TOKENS // 2:
            break
        stream = turn_index % 2 == 1
        session, received = ask(processed_gateway, run, stream=stream, **sampling)
        turn = only_turn(nats_server, run, session)
        where = f"session {run}/{session} ({sampling}, streamed: {stream})"
        assert turn.logprobs_kind == "sampled", where
        assert turn.logprobs.tolist() == pytest.approx(received, abs=1e-6), where
        (prompt,) = turn_prompts([turn])
        scored = recompute(model, prompt, turn)
        assert torch.isfinite(scored.processed).all(), f"{where}: a token outside the nucleus"
        deltas.append(scored.max_delta("processed"))
        moved = max(moved, scored.max_delta("raw"))
        lengths.append(len(turn.completion_ids))
    tokens = sum(lengths)
    print(
        f"{sampling}: max |delta| {max(deltas):.3g} over {tokens} tokens {lengths}; "
        f"raw off by {moved:.3g}"
    )
    assert tokens > MAX_TOKENS // 2, f"{sampling}: {MAX_TURNS} turns of {lengths} tokens"
    assert max(deltas) < BOUND, f"{sampling}: recorded vs recomputed differ by {deltas}"
    # The check has teeth: these samplings' distributions are not the raw one.
    assert moved > 10 * BOUND, f"{sampling}: the raw log-probs match too ({moved:.3g})"


@pytest.mark.parametrize(
    "sampling", [{"temperature": 0.5}, {"top_p": 0.9}], ids=["temperature-0.5", "top_p-0.9"]
)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_raw_replica_refuses_a_sampling_it_cannot_report(
    nats_server: NatsServer,
    replicas: Replicas,
    raw_gateway: GatewayProcess,
    sampling: dict[str, Any],
    stream: bool,
) -> None:
    before = served(replicas.raw)
    with pytest.raises(openai.BadRequestError) as refused:
        ask(raw_gateway, "logprobs-raw", stream=stream, **sampling)
    assert refused.value.status_code == 400
    message = str(refused.value)
    assert PROCESSED_FLAG in message and "--allow-raw-logprobs" in message, message
    time.sleep(1.0)  # vLLM's counters of anything it did serve are in by now
    requests, prompt_tokens, generated = (
        a - b for a, b in zip(served(replicas.raw), before, strict=True)
    )
    # Only probes reached vLLM (the gateway probes a replica again before refusing once its
    # last probe is 30 s old): one-token completions of the probe prompt, never the turn.
    assert prompt_tokens == len(PROBE_PROMPT) * requests and generated == requests, (
        f"a refused turn reached vLLM: {requests} requests, {prompt_tokens} prompt tokens"
    )


def test_a_raw_replica_serves_temperature_1_as_sampled(
    nats_server: NatsServer, raw_gateway: GatewayProcess, model: PreTrainedModel
) -> None:
    run = "logprobs-raw"
    session, _ = ask(raw_gateway, run, temperature=1.0)
    turn = only_turn(nats_server, run, session)
    assert turn.logprobs_kind == "sampled"
    (prompt,) = turn_prompts([turn])
    assert recompute(model, prompt, turn).max_delta("processed") < BOUND


def test_allowed_raw_turns_are_recorded_raw_and_flagged_in_the_batch(
    nats_server: NatsServer, raw_allowed_gateway: GatewayProcess, model: PreTrainedModel
) -> None:
    run = "logprobs-raw-allowed"
    raw_session, _ = ask(raw_allowed_gateway, run, temperature=0.5)
    sampled_session, _ = ask(raw_allowed_gateway, run, temperature=1.0)
    raw_turn = only_turn(nats_server, run, raw_session)
    assert raw_turn.logprobs_kind == "raw"
    assert only_turn(nats_server, run, sampled_session).logprobs_kind == "sampled"
    # What "raw" means: the untempered distribution's log-probs, not the one sampled from.
    (prompt,) = turn_prompts([raw_turn])
    scored = recompute(model, prompt, raw_turn)
    assert scored.max_delta("raw") < BOUND
    assert scored.max_delta("processed") > 10 * BOUND

    for session in (raw_session, sampled_session):
        close(raw_allowed_gateway, run, session, reward=1.0)
    trajectories = [
        trajectory
        for session in (raw_session, sampled_session)
        for trajectory in fold(events_of(nats_server, run, session)).trajectories
    ]
    batch = assemble(trajectories)
    assert batch["raw_logprobs"].tolist() == [True, False]
    with pytest.raises(BatchError, match=re.escape(PROCESSED_FLAG)) as refused:
        check_sampled_logprobs(batch)
    assert trajectories[0].trajectory_id in str(refused.value)
    assert trajectories[1].trajectory_id not in str(refused.value)


def test_each_replica_was_probed_and_its_time_logged(
    processed_gateway: GatewayProcess, raw_gateway: GatewayProcess
) -> None:
    for gateway, names, expected in (
        (processed_gateway, ("vllm-0", "vllm-1"), "processed"),
        (raw_gateway, ("vllm-0",), "raw"),
    ):
        log = " ".join(gateway.log_path.read_text().split())  # rich wraps long lines
        probes = PROBE_LINE.findall(log)
        print(f"probes ({gateway.log_path}): {probes}")
        kinds = {replica: kind for replica, kind, _ in probes}
        assert kinds == dict.fromkeys(names, expected), log[-3000:]
