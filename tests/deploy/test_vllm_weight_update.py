"""Weight updates in the middle of a turn against a real vLLM 0.32 CPU server (issue 37).

One vLLM server in dev mode (``VLLM_SERVER_DEV_MODE=1``: ``/pause``, ``/resume``,
``/collective_rpc``) on the tiny model made to babble bytes until ``max_tokens``
(tests/deploy/weight_update.py), a real gateway (``--backend vllm``) on a real nats-server, agents
on the ``openai`` SDK at temperature 1. A trainer (``VLLMTrainer``) updates the weights while the
turns generate, in the contract's order: ``/pause?mode=``, new weights in, the new version
published to the policy bucket, ``/resume``. The weights change by vLLM's in-place
``reload_weights`` from a checkpoint directory (``POST /collective_rpc``): vLLM's
weight-transfer engines need CUDA, NCCL or Ray (weight_update.py says which and where).

The two turns of a test are sent while vLLM is paused, and start together once both are in
(``/load``); the update comes once vLLM runs both and has generated ``LEAD`` tokens for each
(its ``/metrics``), so it lands mid-generation, and each test checks that it did from what was
recorded (0 < k < n), not from timing. On a busy 2-core machine vLLM's API server could not keep
up with its engine and answered ``/metrics`` and ``/pause`` only once the generations ended: the
engine's threads are reniced (``VLLMServer.renice_engine``) and the server streams 16 tokens at
a time. Measured (2026-11-29, a busy 2-core machine): the file in 1:45-2:20, vLLM's start included.

* ``mode=abort``: a streamed and a non-streamed turn. Each client gets one complete answer (the
  stream one stream, one finish, no error); the ids recorded (TurnCompleted, read back from the
  log; one per request) are those the client was told (each token's text and log-prob, the whole
  text); the versions flip exactly where the gateway continued: ``version_spans == [(v0, k), (v1,
  n - k)]`` with k = ``sampling["continued"][0]["at"]``; the first k log-probs equal an fp32
  transformers recomputation under the old weights and the rest one under the new (within
  1e-4), and the rest do not under the old (the weights did change).
* ``mode=keep``: the frozen generations go on after ``/resume`` without an abort (nothing
  continued); vLLM says nothing per token on ``/v1/completions`` (docs/ARCHITECTURE.md, "Weight
  updates mid-turn: what vLLM reports"), so the streamed turn's tokens that arrived once the new
  version was published are recorded unknown, ``[(v0, a), (None, n - a)]``, and the whole
  non-streamed one (it arrives after the swap). The recomputation finds the swap vLLM did not
  report: every token up to some s is the old weights' and every one from s on the new ones'
  (within 1e-4: with ``clear_cache`` true, vLLM's default, the pause preempts the frozen
  requests, so they are prefilled again under the new weights); 0 < s < n, and the a tokens
  recorded old are all before it (a <= s).
* ``mode=wait``: the pause returns once vLLM finished the turns (no request running, both
  counted), on the old weights: one version, every log-prob the old weights'.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from eventlog.server import NatsServer
from schemas import TurnCompleted
from schemas.policy import UpdateMode
from tests.deploy.test_vllm_logprobs import only_turn
from tests.deploy.vllm_server import SERVED_NAME, VLLMServer, vllm_python, vllm_tiny_model
from tests.deploy.weight_update import CONTEXT, VLLMTrainer, babbling_model
from tests.helpers.gateway_process import GatewayProcess
from tests.helpers.recompute import recompute, turn_prompts
from tests.helpers.waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

RUN = "weight-updates"
BOUND = 1e-4
# The babbling model never stops: every turn has this many, 10-30 s of vLLM's time. Shorter
# turns ended before a pause could land while the machine's other load held up vLLM's API
# server (its /metrics and /pause wait behind its output loop).
MAX_TOKENS = 7000
LEAD = 16  # tokens vLLM has generated for each turn before the trainer pauses it
PROMPT = [{"role": "user", "content": "Tell me a long story about a lighthouse."}]


@dataclass
class Stack:
    server: VLLMServer
    gateway: GatewayProcess
    trainer: VLLMTrainer
    tokenizer: PreTrainedTokenizerBase


@pytest.fixture(scope="module")
def stack(nats_server: NatsServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("weight-update")
    first = babbling_model(vllm_tiny_model(), tmp / "v0")
    # On a busy machine vLLM's API server falls behind its engine, and its output loop does not
    # wait while outputs are queued (AsyncLLM.output_handler): /metrics and /pause would only
    # be served once the generations ended. With chunks of one output it yields between the
    # two turns' outputs of each step; --stream-interval sends a turn's tokens 16 at a time.
    server = VLLMServer(
        vllm_python(),
        first,
        tmp / "logs",
        dev_mode=True,
        env={"VLLM_V1_OUTPUT_PROC_CHUNK_SIZE": "1"},
        # Room for two whole contexts in one step: vLLM 0.32's CPU worker crashes on a seeded
        # request (the gateway seeds every turn) whose prefill is split over steps
        # (``gpu_model_runner._bookkeeping_sync``: "CPU Generator does not use offset"), as a
        # continuation's prompt or a frozen turn prefilled again after the swap would be.
        extra=(
            *("--stream-interval", "16", "--enable-server-load-tracking"),
            *("--max-num-batched-tokens", str(2 * CONTEXT)),
        ),
    ).start()
    gateway: GatewayProcess | None = None
    try:
        server.wait_ready()
        assert server.renice_engine() > 0, "no engine process to renice"
        print(f"vLLM ready in {server.ready_s or 0:.0f} s")
        gateway = GatewayProcess(
            nats_server.url,
            first,
            tmp / "gateway",
            *("--backend", "vllm", "--backend-urls", server.url, "--run", RUN),
        )
        trainer = VLLMTrainer(server, nats_server.url, RUN, tmp, weights={0: first})
        yield Stack(server, gateway, trainer, AutoTokenizer.from_pretrained(first))
    finally:
        if gateway is not None:
            gateway.stop()
        server.stop()


_models: dict[Path, PreTrainedModel] = {}


def model(checkpoint: Path) -> PreTrainedModel:
    """A version's weights in transformers, float32 (loaded once)."""
    if checkpoint not in _models:
        loaded = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
        loaded.train(False)
        _models[checkpoint] = loaded
    return _models[checkpoint]


@dataclass
class Answer:
    """What one client was told, as it arrived."""

    session: str
    streamed: bool
    text: str = ""
    tokens: list[str] = field(default_factory=list)  # each token's text (logprobs.content)
    logprobs: list[float] = field(default_factory=list)
    finishes: list[str] = field(default_factory=list)  # each finish_reason the client saw


def ask(base_url: str, answer: Answer) -> Answer:
    """One turn on the openai SDK (no retries: an error is the test's), filling ``answer``."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300)
    params: dict[str, Any] = {
        "model": SERVED_NAME,
        "messages": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 1.0,
        "logprobs": True,
    }
    if not answer.streamed:
        choice = client.chat.completions.create(**params).choices[0]
        _take(answer, choice.message.content, choice.logprobs, choice.finish_reason)
        return answer
    for chunk in client.chat.completions.create(**params, stream=True):
        for choice in chunk.choices:
            _take(answer, choice.delta.content, choice.logprobs, choice.finish_reason)
    return answer


def _take(answer: Answer, text: str | None, logprobs: Any, finish: str | None) -> None:
    answer.text += text or ""
    if logprobs is not None and logprobs.content:
        answer.logprobs += [c.logprob for c in logprobs.content]
        answer.tokens += [c.token for c in logprobs.content]  # last: what the test watches
    if finish is not None:
        answer.finishes.append(finish)


Turn = tuple[Answer, Future[Answer]]  # what its client is told, and when it is whole


def start(pool: ThreadPoolExecutor, stack: Stack, *, streamed: bool) -> Turn:
    opened = stack.gateway.session(run=RUN)
    answer = Answer(str(opened["session_id"]), streamed)
    return answer, pool.submit(ask, str(opened["base_url"]), answer)


def running(server: VLLMServer) -> tuple[float, float]:
    """What vLLM reports now: requests in its batches, tokens generated so far."""
    counted = server.metrics()
    return (
        counted.get("vllm:num_requests_running", 0.0),
        counted.get("vllm:generation_tokens_total", 0.0),
    )


def both_generating(pool: ThreadPoolExecutor, stack: Stack) -> list[Turn]:
    """A streamed and a non-streamed turn, both generating when this returns. Both are sent
    while vLLM is paused, so they start together once both are in (``/load``: the requests it
    serves); then vLLM runs both and has generated LEAD tokens for each (its ``/metrics``: what
    the clients saw lags behind on a busy machine)."""
    stack.trainer.pause("keep")
    turns = [start(pool, stack, streamed=True), start(pool, stack, streamed=False)]
    wait_for(lambda: in_flight(stack.server) == 2, 60, "both turns to reach vLLM")
    _, before = running(stack.server)  # while paused: what the probes generated
    stack.trainer.resume()

    def generating() -> bool:
        requests, generated = running(stack.server)
        assert requests > 0 or generated == before, "vLLM finished the turns before the update"
        return requests == 2 and generated >= before + 2 * LEAD

    wait_for(generating, 60, f"vLLM to generate {LEAD} tokens for each turn, running both")
    return turns


def in_flight(server: VLLMServer) -> int:
    """The generation requests vLLM serves, queued ones too (--enable-server-load-tracking)."""
    return int(httpx.get(f"{server.url}/load", timeout=30).json()["server_load"])


def caught_up(turns: list[Turn]) -> None:
    """Wait until the streamed client's tokens stop coming (the server is frozen): the gateway
    has what vLLM sent before the freeze, and it arrived well before what follows."""
    (answer,) = [answer for answer, _ in turns if answer.streamed]
    seen = [-1]

    def still() -> bool:
        if len(answer.tokens) == seen[0]:
            return True
        seen[0] = len(answer.tokens)
        time.sleep(1.0)
        return False

    wait_for(still, 60, "the streamed client to have what vLLM generated before the freeze")


def recorded(nats_server: NatsServer, stack: Stack, answer: Answer) -> TurnCompleted:
    """The turn's one TurnCompleted (``only_turn`` fails on two), checked against what its
    client was told: one complete answer, the same tokens and log-probs."""
    where = f"session {answer.session} (streamed: {answer.streamed})"
    assert answer.finishes == ["length"], f"{where}: finish reasons {answer.finishes}"
    turn = only_turn(nats_server, RUN, answer.session)
    ids = turn.completion_ids.tolist()
    assert len(ids) == MAX_TOKENS, where
    decode = stack.tokenizer.decode
    assert [decode([i], skip_special_tokens=False) for i in ids] == answer.tokens, where
    assert answer.text == decode(ids, skip_special_tokens=True), where
    assert turn.logprobs.tolist() == pytest.approx(answer.logprobs, abs=1e-6), where
    return turn


def deltas(stack: Stack, version: int, turn: TurnCompleted) -> torch.Tensor:
    """|recorded - recomputed| per token, the recomputation under ``version``'s weights."""
    (prompt,) = turn_prompts([turn])
    scored = recompute(model(stack.trainer.weights[version]), prompt, turn)
    return (scored.recorded - scored.processed).abs()


def update_mid_generation(
    stack: Stack,
    mode: UpdateMode,
    paused: Callable[[list[Turn]], None] = lambda turns: None,
) -> tuple[int, int, list[Answer]]:
    """Two turns generating, then the trainer's update in ``mode`` (``paused``, given the turns,
    runs once the pause returned). The versions before and after, and what the clients got."""
    old = stack.trainer.version
    with ThreadPoolExecutor(2) as pool:
        turns = both_generating(pool, stack)
        new = stack.trainer.update(mode, paused=lambda: paused(turns))
        answers = [future.result(timeout=300) for _, future in turns]
    return old, new, answers


def test_abort_continues_each_turn_on_the_new_weights_from_the_abort_point(
    nats_server: NatsServer, stack: Stack
) -> None:
    old, new, answers = update_mid_generation(stack, "abort")
    for answer in answers:
        where = f"session {answer.session} (streamed: {answer.streamed})"
        turn = recorded(nats_server, stack, answer)
        continued = turn.sampling.get("continued")
        assert isinstance(continued, list) and len(continued) == 1, f"{where}: {continued}"
        k, n = int(continued[0]["at"]), len(turn.completion_ids)
        print(f"{where}: aborted after {k} of {n} tokens; spans {turn.version_spans}")
        assert 0 < k < n, f"{where}: the abort did not land mid-generation (k={k}, n={n})"
        assert turn.version_spans == [(old, k), (new, n - k)], where
        assert turn.weight_version == old
        before, after = deltas(stack, old, turn), deltas(stack, new, turn)
        print(
            f"{where}: max |delta| {before[:k].max():.2g} (old weights, first part), "
            f"{after[k:].max():.2g} (new, continuation); old on the continuation "
            f"{before[k:].max():.2g}"
        )
        assert before[:k].max() <= BOUND, where
        assert after[k:].max() <= BOUND, where
        assert before[k:].max() > 10 * BOUND, f"{where}: the new weights sample like the old"


def test_keep_freezes_the_turns_and_marks_the_tokens_after_the_publication_unknown(
    nats_server: NatsServer, stack: Stack
) -> None:
    old, new, answers = update_mid_generation(stack, "keep", caught_up)
    for answer in answers:
        where = f"session {answer.session} (streamed: {answer.streamed})"
        turn = recorded(nats_server, stack, answer)
        assert "continued" not in turn.sampling, f"{where}: aborted and continued"
        spans, n = turn.version_spans, len(turn.completion_ids)
        before, after = deltas(stack, old, turn), deltas(stack, new, turn)
        # vLLM does not say where the swap came; the weights do: each token is one the old or
        # the new weights sampled, the old up to a point and the new from there on.
        off = (before > BOUND).nonzero()
        swapped = int(off[0]) if len(off) else n
        print(f"{where}: spans {spans}; the new weights sampled from token {swapped} on")
        assert 0 < swapped < n, f"{where}: the freeze did not land mid-generation"
        assert after[swapped:].max() <= BOUND, f"{where}: after the swap, not the new weights"
        if not answer.streamed:
            # One response, after the swap: which of its tokens came before it is not known.
            assert spans == [(None, n)], where
        else:
            assert spans is not None and len(spans) == 2, f"{where}: {spans}"
            (known, a), (unknown, rest) = spans
            assert (known, unknown, a + rest) == (old, None, n), f"{where}: {spans}"
            # Known: only tokens the old weights sampled, never one after the swap.
            assert 0 < a <= swapped, f"{where}: {a} tokens recorded old, swap at {swapped}"
            assert turn.weight_version == old


def test_wait_finishes_the_turns_on_the_old_weights_before_the_pause_returns(
    nats_server: NatsServer, stack: Stack
) -> None:
    finished = stack.server.metrics().get("vllm:request_success_total", 0.0)

    def drained(turns: list[Turn]) -> None:
        """Right after ``/pause?mode=wait`` returned, before the new weights load."""
        assert running(stack.server)[0] == 0
        counted = stack.server.metrics().get("vllm:request_success_total", 0.0)
        assert counted == finished + 2, f"vLLM finished {counted - finished} turns, not 2"
        for _, future in turns:  # recorded before the new version is published
            future.result(timeout=300)

    old, _, answers = update_mid_generation(stack, "wait", drained)
    for answer in answers:
        where = f"session {answer.session} (streamed: {answer.streamed})"
        turn = recorded(nats_server, stack, answer)
        assert "continued" not in turn.sampling, where
        assert (turn.weight_version, turn.version_spans) == (old, None), where
        assert deltas(stack, old, turn).max() <= BOUND, where
