"""The log-prob probe: what a vLLM or SGLang replica's log-probs are, and the turns refused for it.

No vLLM or SGLang server runs in unit tests (tests/deploy runs the real vLLM), so each stands in
as an ``httpx.MockTransport`` handler (tests/helpers/backend_transport.py) that answers as that
server does, in its wire format, computing its log-probs the way its sampler does from one fixed
set of logits:

- vLLM's ``--logprobs-mode raw_logprobs`` (its default): ``log_softmax(logits)``, whatever the
  sampling; ``processed_logprobs``: after temperature and top-p (vllm/v1/sample/sampler.py);
- SGLang's ``Sampler.forward`` (python/sglang/srt/layers/sampler.py): after temperature, before
  top-p (since sgl-project/sglang#5961); after top-p too (#2664 until #5961); raw with
  SGLANG_RETURN_ORIGINAL_LOGPROB (#8375).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from gateway.backends.interface import Prompt, SamplingParams, TopLogprob
from gateway.backends.probe import (
    PROBE_PROMPT,
    LogprobsGuard,
    LogprobsKind,
    classify,
    probe_replicas,
    records_sampled,
)
from gateway.backends.router import ReplicaRouter
from gateway.backends.sglang import SGLangBackend
from gateway.backends.vllm import VLLMBackend
from gateway.errors import BackendUnavailable, InvalidRequest
from tests.helpers.backend_transport import HandlerTransport

LOGITS = {72: 3.0, 73: 2.2, 74: 1.5, 75: 0.3, 76: -1.0, 77: -2.5}  # the model, next token
ANSWER = [72, 73, 74]  # what the stand-ins sample, whatever the distribution
STOP = 151645
PROMPT = [151644, 872, 198]


def logprobs(
    temperature: float,
    top_p: float,
    *,
    tempered: bool,
    truncated: bool,
    logits: dict[int, float] = LOGITS,
) -> dict[int, float]:
    """A sampler's log-probs of ``logits``: ``tempered`` divides by the temperature,
    ``truncated`` keeps the most likely tokens up to top_p of the mass, renormalised."""
    scale = temperature if tempered and temperature > 0 else 1.0
    z = {t: v / scale for t, v in logits.items()}
    norm = math.log(sum(math.exp(v) for v in z.values()))
    lp = {t: v - norm for t, v in z.items()}
    if truncated and top_p < 1.0:
        kept, mass = {}, 0.0
        for token, value in sorted(lp.items(), key=lambda item: -item[1]):
            if mass >= top_p:
                break
            kept[token] = value
            mass += math.exp(value)
        lp = {t: v - math.log(mass) for t, v in kept.items()}
    return lp


MODES: dict[str, tuple[bool, bool]] = {  # (tempered, truncated)
    "raw_logprobs": (False, False),  # vLLM's default; SGLang with SGLANG_RETURN_ORIGINAL_LOGPROB
    "processed_logprobs": (True, True),  # vLLM processed mode; SGLang from #2664 until #5961
    "sglang_default": (True, False),  # SGLang since #5961
}


@dataclass
class StandIn:
    """A server's answers and what it was asked. ``up`` False: connection refused."""

    mode: str
    up: bool = True
    logits: dict[int, float] = field(default_factory=lambda: dict(LOGITS))
    bodies: list[dict[str, Any]] = field(default_factory=list)

    def distribution(self, sampling: dict[str, Any]) -> dict[int, float]:
        tempered, truncated = MODES[self.mode]
        return logprobs(
            sampling["temperature"],
            sampling["top_p"],
            tempered=tempered,
            truncated=truncated,
            logits=self.logits,
        )

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if not self.up:
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
        body = json.loads(request.content)
        self.bodies.append(body)
        events = self.events(body)
        if body.get("stream") is False:  # a caller reading the completion whole
            return httpx.Response(200, json=self.whole(events))
        content = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, content=content.encode())

    def whole(self, events: list[Any]) -> Any:
        """The non-streamed answer: the stream's last event (SGLang's are cumulative)."""
        return events[-1]

    def events(self, body: dict[str, Any]) -> list[Any]:
        raise NotImplementedError

    @property
    def generations(self) -> list[dict[str, Any]]:
        """The requests that were not the probe's."""
        return [b for b in self.bodies if b.get("prompt", b.get("input_ids")) != list(PROBE_PROMPT)]


class StandInVLLM(StandIn):
    """vLLM's /v1/completions stream with return_token_ids and token-id logprob keys."""

    def events(self, body: dict[str, Any]) -> list[Any]:
        lp = self.distribution(body)
        top = sorted(lp.items(), key=lambda item: -item[1])[: body["logprobs"]]
        tokens = ANSWER[: body["max_tokens"]]
        events = []
        for i, token in enumerate(tokens):
            alternatives = {f"token_id:{t}": v for t, v in top}
            alternatives[f"token_id:{token}"] = lp.get(token, -9999.0)
            choice = {
                "index": 0,
                "text": "x",
                "token_ids": [token],
                "logprobs": {
                    "tokens": [f"token_id:{token}"],
                    "token_logprobs": [lp.get(token, -9999.0)],
                    "top_logprobs": [alternatives],
                },
                "finish_reason": "length" if i == len(tokens) - 1 else None,
            }
            if i == 0:
                choice["prompt_token_ids"] = body["prompt"]
            events.append({"choices": [choice], "usage": None})
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": len(tokens)}
        return [*events, {"choices": [], "usage": usage}]

    def whole(self, events: list[Any]) -> Any:
        """One choice holding every streamed choice's tokens, and the usage."""
        choices = [e["choices"][0] for e in events if e["choices"]]
        lps = [c["logprobs"] for c in choices]
        choice = {
            "index": 0,
            "text": "".join(c["text"] for c in choices),
            "token_ids": [t for c in choices for t in c["token_ids"]],
            "prompt_token_ids": choices[0]["prompt_token_ids"],
            "logprobs": {key: [v for lp in lps for v in lp[key]] for key in lps[0]},
            "finish_reason": choices[-1]["finish_reason"],
        }
        return {"choices": [choice], "usage": events[-1]["usage"]}


class StandInSGLang(StandIn):
    """SGLang's native /generate stream (cumulative output_ids and logprob lists)."""

    def events(self, body: dict[str, Any]) -> list[Any]:
        sampling = body["sampling_params"]
        lp = self.distribution(sampling)
        top = sorted(lp.items(), key=lambda item: -item[1])[: body["top_logprobs_num"]]
        tokens = ANSWER[: sampling["max_new_tokens"]]
        events = []
        for end in range(1, len(tokens) + 1):
            meta = {
                "prompt_tokens": len(body["input_ids"]),
                "completion_tokens": end,
                "finish_reason": {"type": "length"} if end == len(tokens) else None,
                "output_token_logprobs": [[lp.get(t, -9999.0), t, None] for t in tokens[:end]],
                "output_top_logprobs": [[[v, t, None] for t, v in top]] * end,
            }
            events.append({"output_ids": tokens[:end], "meta_info": meta})
        return events


def vllm(server: StandIn, replica: str = "vllm-0") -> VLLMBackend:
    transport = HandlerTransport(server)
    return VLLMBackend(
        f"http://{replica}:8000", "m", backend_id=replica, max_context=4096, transport=transport
    )


def sglang(server: StandIn) -> SGLangBackend:
    transport = HandlerTransport(server)
    return SGLangBackend(
        "http://sgl:30000", backend_id="sglang-0", max_context=4096, transport=transport
    )


def sampling(temperature: float = 1.0, top_p: float = 1.0, **more: Any) -> SamplingParams:
    return SamplingParams(max_tokens=3, temperature=temperature, top_p=top_p, seed=1, **more)


def kind_of(backend: VLLMBackend | SGLangBackend) -> str | None:
    return backend.logprobs_kind  # read afresh: a request may have changed it


async def collect(backend: Any, params: SamplingParams) -> list[Any]:
    return [chunk async for chunk in backend.generate(Prompt(PROMPT), params)]


# ---- the pure decision ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("answers", "kind"),
    [
        pytest.param((-1.2, -1.2, -1.2), "raw", id="raw"),
        pytest.param((-1.2, -1.20005, -1.19995), "raw", id="raw within 1e-4"),
        pytest.param((-1.2, -0.4, -0.3), "processed", id="processed"),
        pytest.param((-1.2, -0.4, -1.2), "tempered", id="tempered"),
        pytest.param((-1.2, -1.2, -0.3), "unknown", id="top-p without temperature"),
        pytest.param((-1.2, -1.9, -0.3), "unknown", id="sharpened the wrong way"),
        pytest.param((-0.00001, -0.00001, 0.0), "unknown", id="probability 1"),
        pytest.param((3.0, 6.0, 3.0), "unknown", id="logits, not log-probs"),
    ],
)
def test_classify(answers: tuple[float, float, float], kind: LogprobsKind) -> None:
    assert classify(*(TopLogprob(72, a) for a in answers))[0] == kind


def test_classify_unknown_when_the_top_token_changes() -> None:
    kind, reason = classify(TopLogprob(72, -1.0), TopLogprob(73, -0.5), TopLogprob(72, -0.4))
    assert kind == "unknown" and "top token changed" in reason


@pytest.mark.parametrize(
    ("kind", "temperature", "top_p", "recorded"),
    [
        ("raw", 1.0, 1.0, True),
        ("raw", 0.0, 1.0, True),  # greedy's log-probs are the raw ones by definition
        ("raw", 1e-6, 1.0, True),  # greedy as vLLM has it: a temperature below 1e-5 (issue 38)
        ("raw", 0.0, 0.9, True),  # ... where vLLM sets top_p to 1
        ("raw", 1e-5, 1.0, False),
        ("raw", 0.5, 1.0, False),
        ("raw", 1.0, 0.9, False),
        ("unknown", 0.7, 1.0, False),
        ("tempered", 0.5, 1.0, True),
        ("tempered", 0.5, 0.9, False),
        ("processed", 0.5, 0.9, True),
    ],
)
def test_records_sampled(
    kind: LogprobsKind, temperature: float, top_p: float, recorded: bool
) -> None:
    assert records_sampled(kind, sampling(temperature, top_p)) is recorded


# ---- the probe against stand-in servers -----------------------------------------------------


@pytest.mark.parametrize(
    ("make", "mode", "kind"),
    [
        pytest.param(StandInVLLM, "raw_logprobs", "raw", id="vllm default"),
        pytest.param(StandInVLLM, "processed_logprobs", "processed", id="vllm processed"),
        pytest.param(StandInSGLang, "sglang_default", "tempered", id="sglang since #5961"),
        pytest.param(StandInSGLang, "raw_logprobs", "raw", id="sglang original logprob"),
        pytest.param(StandInSGLang, "processed_logprobs", "processed", id="sglang #2664-#5961"),
    ],
)
async def test_the_probe_finds_the_servers_kind(make: type[StandIn], mode: str, kind: str) -> None:
    server = make(mode)
    backend = vllm(server) if make is StandInVLLM else sglang(server)
    assert kind_of(backend) is None
    result = (await probe_replicas([backend]))[backend.id]
    assert result is not None and result.kind == kind == kind_of(backend)
    assert result.seconds >= 0
    # Three one-token requests of the fixed prompt and seed, asking for the top alternative.
    assert len(server.bodies) == 3 and server.generations == []
    if make is StandInVLLM:
        asked = [(b["temperature"], b["top_p"], b["seed"], b["logprobs"]) for b in server.bodies]
        assert asked == [(1.0, 1.0, 0, 1), (0.5, 1.0, 0, 1), (1.0, 0.5, 0, 1)]
        assert all(b["max_tokens"] == 1 for b in server.bodies)


async def test_a_raw_replica_refuses_a_tempered_turn_before_sending_it() -> None:
    server = StandInVLLM("raw_logprobs")
    backend = vllm(server)
    with pytest.raises(InvalidRequest) as refused:
        await collect(backend, sampling(temperature=0.5))
    message = str(refused.value)
    assert "replica vllm-0" in message and "temperature 0.5, top_p 1" in message
    assert "--logprobs-mode processed_logprobs" in message
    assert "--allow-raw-logprobs" in message
    assert refused.value.param == "temperature"
    assert server.generations == []  # only the probe reached the server
    with pytest.raises(InvalidRequest, match=r"top_p 0\.9") as refused:
        await collect(backend, sampling(top_p=0.9))
    assert refused.value.param == "top_p"
    assert server.generations == [] and len(server.bodies) == 3  # probed once


async def test_the_flag_generates_and_marks_every_chunk_raw() -> None:
    server = StandInVLLM("raw_logprobs")
    chunks = await collect(vllm(server), sampling(temperature=0.5, allow_raw_logprobs=True))
    # (the stand-in's events arrive in one read: the backend passes them on as one chunk)
    assert [t for c in chunks for t in c.token_ids] == [72, 73, 74]
    assert {c.logprobs_kind for c in chunks} == {"raw"}
    # What was recorded is the raw distribution's, as the mark says.
    raw = logprobs(1.0, 1.0, tempered=False, truncated=False)
    assert [lp for c in chunks for lp in c.logprobs] == [raw[t] for t in ANSWER]
    assert len(server.generations) == 1


async def test_temperature_one_is_served_by_any_replica_without_a_probe() -> None:
    server = StandInVLLM("raw_logprobs")
    for params in (sampling(), sampling(temperature=0.0)):
        chunks = await collect(vllm(server), params)
        assert {c.logprobs_kind for c in chunks} == {None}
    assert len(server.bodies) == 2  # no probe: raw and sampled are the same distribution


async def test_a_processed_replica_serves_and_does_not_mark() -> None:
    server = StandInVLLM("processed_logprobs")
    chunks = await collect(vllm(server), sampling(temperature=0.5, top_p=0.9))
    assert {c.logprobs_kind for c in chunks} == {None}
    sampled = logprobs(0.5, 0.9, tempered=True, truncated=True)
    assert chunks[0].logprobs[0] == sampled[72]


async def test_sglang_serves_temperature_and_refuses_top_p() -> None:
    server = StandInSGLang("sglang_default")
    backend = sglang(server)
    chunks = await collect(backend, sampling(temperature=0.5))
    assert {c.logprobs_kind for c in chunks} == {None}
    with pytest.raises(InvalidRequest, match="before top-p truncation") as refused:
        await collect(backend, sampling(temperature=0.5, top_p=0.9))
    assert "replica sglang-0" in str(refused.value) and refused.value.param == "top_p"
    chunks = await collect(backend, sampling(top_p=0.9, allow_raw_logprobs=True))
    assert {c.logprobs_kind for c in chunks} == {"raw"}


async def test_a_replica_down_at_the_probe_is_probed_when_it_comes_back() -> None:
    server = StandInVLLM("processed_logprobs", up=False)
    backend = vllm(server)
    assert await probe_replicas([backend]) == {"vllm-0": None}
    with pytest.raises(BackendUnavailable):
        await collect(backend, sampling(temperature=0.5))
    assert kind_of(backend) is None
    server.up = True
    chunks = await collect(backend, sampling(temperature=0.5))
    assert kind_of(backend) == "processed" and sum(len(c.token_ids) for c in chunks) == 3


async def test_a_failed_request_makes_the_replica_probed_again() -> None:
    """A replica that failed may have been restarted with another --logprobs-mode."""
    server = StandInVLLM("processed_logprobs")
    backend = vllm(server)
    await collect(backend, sampling(temperature=0.5))
    server.up, server.mode = False, "raw_logprobs"
    with pytest.raises(BackendUnavailable):
        await collect(backend, sampling())
    server.up = True
    with pytest.raises(InvalidRequest, match="raw_logprobs"):
        await collect(backend, sampling(temperature=0.5))


async def test_a_refusal_probes_again_once_the_last_probe_is_old() -> None:
    """A server restarted in processed mode without a failed request in between is served
    without restarting the gateway."""
    now = [0.0]
    server = StandInVLLM("raw_logprobs")
    backend = vllm(server)
    guard = LogprobsGuard(
        replica="vllm-0",
        where="vLLM stand-in",
        sample=lambda prompt, params: backend._stream(Prompt(prompt), params, checked=False),
        advice={"raw": "start it in processed mode"},
        recheck_s=30.0,
        clock=lambda: now[0],
    )
    with pytest.raises(InvalidRequest, match="start it in processed mode"):
        await guard.admit(sampling(temperature=0.5))
    server.mode = "processed_logprobs"
    now[0] = 10.0
    with pytest.raises(InvalidRequest):
        await guard.admit(sampling(temperature=0.5))
    assert len(server.bodies) == 3  # too soon to ask again
    now[0] = 31.0
    assert await guard.admit(sampling(temperature=0.5)) is None
    assert guard.kind == "processed" and len(server.bodies) == 6


async def test_a_probe_that_cannot_tell_is_treated_as_raw() -> None:
    # The probe prompt's next token is certain: no temperature or top-p moves its log-prob.
    server = StandInVLLM("processed_logprobs", logits={72: 60.0, 73: 0.0})
    with pytest.raises(InvalidRequest, match=r"could not tell .*probability 1"):
        await collect(vllm(server), sampling(temperature=0.5))
    chunks = await collect(vllm(server), sampling(temperature=0.5, allow_raw_logprobs=True))
    assert {c.logprobs_kind for c in chunks} == {"raw"}


# ---- behind the router ----------------------------------------------------------------------


async def test_the_router_passes_a_refusal_through_without_failover() -> None:
    raw, processed = StandInVLLM("raw_logprobs"), StandInVLLM("processed_logprobs")
    router = ReplicaRouter(
        [vllm(raw, "vllm-0"), vllm(processed, "vllm-1")], max_inflight_per_replica=4
    )
    # A new session goes to vllm-0 first (the rotation starts there).
    with pytest.raises(InvalidRequest, match="replica vllm-0"):
        await collect(router, sampling(temperature=0.5))
    assert processed.bodies == []  # not tried on the other replica
    assert [(s.id, s.up, s.inflight) for s in router.status()] == [
        ("vllm-0", True, 0),
        ("vllm-1", True, 0),
    ]


async def test_router_admit_refuses_when_any_replica_up_would_record_wrongly() -> None:
    raw, processed = StandInVLLM("raw_logprobs"), StandInVLLM("processed_logprobs")
    router = ReplicaRouter(
        [vllm(processed, "vllm-0"), vllm(raw, "vllm-1")], max_inflight_per_replica=4
    )
    assert await router.admit(sampling()) is None  # temperature 1: nothing to ask
    assert raw.bodies == processed.bodies == []
    with pytest.raises(InvalidRequest, match="replica vllm-1"):
        await router.admit(sampling(temperature=0.5))
    assert await router.admit(sampling(temperature=0.5, allow_raw_logprobs=True)) is None


async def test_router_admit_marks_a_replica_it_cannot_probe_down() -> None:
    down, processed = StandInVLLM("raw_logprobs", up=False), StandInVLLM("processed_logprobs")
    router = ReplicaRouter(
        [vllm(down, "vllm-0"), vllm(processed, "vllm-1")], max_inflight_per_replica=4
    )
    assert await router.admit(sampling(temperature=0.5)) is None
    assert [s.up for s in router.status()] == [False, True]
    chunks = await collect(router, sampling(temperature=0.5))
    assert chunks[0].replica == "vllm-1"  # the first chunk names the replica
