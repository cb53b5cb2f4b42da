"""vLLM and SGLang backends: request and response translation.

Neither server can run here (no GPU), so these tests stand in for them with ``httpx.MockTransport``
handlers (behind the backends' transport interface: tests/helpers/backend_transport.py) that
answer with SSE bodies shaped as the projects document and emit them, one event per network read
unless a test says otherwise (vLLM >= 0.10.2 ``/v1/completions`` with
``return_tokens_as_token_ids``, and servers that send ``token_ids`` too; SGLang's native
``/generate`` with ``return_logprob``, cumulative and ``--incremental-streaming-output`` modes),
or with one JSON response to a request not streamed.
They pin the exact request JSON (token ids in, no text), the chunks produced (new tokens only,
logprobs, top logprobs, finish reason) and the error translation. They do not prove that a live
server of a given version still speaks this dialect: that needs a GPU run against the real server.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from gateway.backends.interface import Backend, GenerationChunk, Prompt, SamplingParams, TopLogprob
from gateway.backends.sglang import SGLangBackend
from gateway.backends.vllm import VLLMBackend
from gateway.errors import BackendError, BackendUnavailable
from tests.helpers.backend_transport import HandlerTransport

PROMPT = [151644, 872, 198, 9707, 151645, 198, 151644, 77091, 198]
IM_END = 151645
PARAMS = SamplingParams(
    max_tokens=16, temperature=0.7, top_p=0.9, seed=7, stop_token_ids=(IM_END,), top_logprobs=2
)

Handler = Callable[[httpx.Request], httpx.Response]


def sse(*events: dict[str, Any] | str) -> bytes:
    lines = [f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events]
    return "".join(lines).encode()


def answer(body: bytes, status: int = 200, *, at_once: bool = False) -> Handler:
    """Each SSE event in its own part of the body (as a server writes them, one network read
    each), or ``at_once``: the whole body in one part (events that arrived together)."""

    def handle(request: httpx.Request) -> httpx.Response:
        headers = {"content-type": "text/event-stream"}
        if at_once:
            return httpx.Response(status, content=body, headers=headers)
        return httpx.Response(status, stream=EventParts(body), headers=headers)

    return handle


class EventParts(httpx.AsyncByteStream):
    def __init__(self, body: bytes) -> None:
        self.parts = [part + b"\n\n" for part in body.split(b"\n\n") if part]

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for part in self.parts:
            yield part


class Recorder:
    """A MockTransport handler that keeps every request's JSON body."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        return self.handler(request)

    @property
    def bodies(self) -> list[dict[str, Any]]:
        return [json.loads(request.content) for request in self.requests]


def vllm(handler: Handler, base_url: str = "http://gpu-1:8000") -> VLLMBackend:
    # Known to be in processed mode: these tests pin the translation, not the log-prob probe
    # (tests/unit/test_logprobs_probe.py), which would send requests of its own first.
    transport = HandlerTransport(handler)
    return VLLMBackend(
        base_url,
        "Qwen/Qwen2.5-7B-Instruct",
        backend_id="vllm-1",
        max_context=32768,
        transport=transport,
        logprobs_kind="processed",
    )


def sglang(handler: Handler, *, incremental: bool = False) -> SGLangBackend:
    transport = HandlerTransport(handler)
    return SGLangBackend(
        "http://gpu-2:30000/",
        backend_id="sglang-1",
        max_context=32768,
        transport=transport,
        incremental_streaming=incremental,
        logprobs_kind="processed",
    )


async def collect(backend: Backend, params: SamplingParams = PARAMS) -> list[GenerationChunk]:
    return [chunk async for chunk in backend.generate(Prompt(PROMPT), params)]


# ---- vLLM payloads ------------------------------------------------------------------------------


def vllm_event(
    text: str,
    token_ids: list[int],
    logprobs: list[float] | None,
    top: list[dict[str, float]] | None = None,
    finish_reason: str | None = None,
    *,
    with_token_ids: bool = True,  # False: a server that predates return_token_ids
    **extra: Any,
) -> dict[str, Any]:
    """One streamed choice, as vLLM's OpenAIServingCompletion emits it."""
    choice: dict[str, Any] = {
        "index": 0,
        "text": text,
        "logprobs": None,
        "finish_reason": finish_reason,
        "stop_reason": None,
    }
    if logprobs is not None:
        choice["logprobs"] = {
            "text_offset": list(range(len(token_ids))),
            "token_logprobs": logprobs,
            "tokens": [f"token_id:{i}" for i in token_ids],
            "top_logprobs": top,
        }
    if with_token_ids:
        choice["token_ids"] = token_ids
    choice.update(extra)
    return {
        "id": "cmpl-3f9c",
        "object": "text_completion",
        "created": 1735689600,
        "model": "Qwen/Qwen2.5-7B-Instruct",
        "choices": [choice],
        "usage": None,
    }


VLLM_USAGE_ABORTED = {
    "id": "cmpl-3f9c",
    "object": "text_completion",
    "created": 1735689600,
    "model": "Qwen/Qwen2.5-7B-Instruct",
    "choices": [],
    "usage": {
        "prompt_tokens": len(PROMPT),
        "total_tokens": len(PROMPT) + 2,
        "completion_tokens": 2,
    },
}
VLLM_USAGE = {
    "id": "cmpl-3f9c",
    "object": "text_completion",
    "created": 1735689600,
    "model": "Qwen/Qwen2.5-7B-Instruct",
    "choices": [],
    "usage": {
        "prompt_tokens": len(PROMPT),
        "completion_tokens": 3,
        "total_tokens": len(PROMPT) + 3,
        "prompt_tokens_details": {"cached_tokens": 8},
    },
}

VLLM_STREAM = sse(
    vllm_event(
        "Hi",
        [13048],
        [-0.01],
        # vLLM adds the sampled token to the top-k dict: k + 1 entries, not ordered by logprob.
        [{"token_id:13048": -0.01, "token_id:9707": -4.6}],
        prompt_token_ids=PROMPT,
    ),
    vllm_event(
        "!",
        [0],
        [-2.5],
        [{"token_id:0": -2.5, "token_id:11": -0.2, "token_id:13": -1.9}],
    ),
    vllm_event(
        "<|im_end|>",
        [IM_END],
        [-0.05],
        [{f"token_id:{IM_END}": -0.05, "token_id:198": -3.1}],
        "stop",
    ),
    VLLM_USAGE,
    "[DONE]",
)


async def test_vllm_sends_token_ids_and_the_documented_fields() -> None:
    recorder = Recorder(answer(VLLM_STREAM))
    await collect(vllm(recorder, base_url="http://gpu-1:8000/v1/"))
    [request] = recorder.requests
    assert request.method == "POST"
    assert str(request.url) == "http://gpu-1:8000/v1/completions"
    assert recorder.bodies == [
        {
            "model": "Qwen/Qwen2.5-7B-Instruct",
            "prompt": PROMPT,
            "max_tokens": 16,
            "temperature": 0.7,
            "top_p": 0.9,
            "seed": 7,
            "stop_token_ids": [IM_END],
            "logprobs": 2,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
            "include_stop_str_in_output": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ]


async def test_vllm_without_seed_or_top_logprobs_asks_for_sampled_logprobs_only() -> None:
    recorder = Recorder(answer(VLLM_STREAM))
    chunks = await collect(vllm(recorder), SamplingParams(max_tokens=16))
    body = recorder.bodies[0]
    assert "seed" not in body
    assert body["logprobs"] == 0
    assert [chunk.top_logprobs for chunk in chunks] == [None, None, None]


async def test_vllm_stream_becomes_chunks_of_tokens_and_logprobs() -> None:
    chunks = await collect(vllm(answer(VLLM_STREAM)))
    assert [(c.token_ids, c.logprobs, c.finish_reason) for c in chunks] == [
        ([13048], [-0.01], None),
        ([0], [-2.5], None),
        ([IM_END], [-0.05], "stop"),
    ]
    # The k most likely, best first; the sampled token only when it is among them.
    assert [c.top_logprobs for c in chunks] == [
        [[TopLogprob(13048, -0.01), TopLogprob(9707, -4.6)]],
        [[TopLogprob(11, -0.2), TopLogprob(13, -1.9)]],
        [[TopLogprob(IM_END, -0.05), TopLogprob(198, -3.1)]],
    ]
    # The usage event that follows the finish is folded into the last chunk.
    assert chunks[-1].extra == {
        "prompt_tokens": 9.0,
        "completion_tokens": 3.0,
        "cached_prompt_tokens": 8.0,
    }
    assert chunks[0].extra == {}


async def test_vllm_length_finish_and_an_empty_final_choice() -> None:
    body = sse(
        vllm_event("Hi", [13048], [-0.01], [{"token_id:13048": -0.01}]),
        vllm_event("", [], [], [], "length"),
        "[DONE]",
    )
    chunks = await collect(vllm(answer(body)), SamplingParams(max_tokens=1, top_logprobs=1))
    assert [(c.token_ids, c.finish_reason) for c in chunks] == [([13048], None), ([], "length")]


async def test_vllm_before_return_token_ids_reads_ids_from_logprob_tokens() -> None:
    body = sse(
        vllm_event("Hi", [13048], [-0.01], [{"token_id:13048": -0.01}], with_token_ids=False),
        vllm_event(
            "", [IM_END], [-0.3], [{f"token_id:{IM_END}": -0.3}], "stop", with_token_ids=False
        ),
        "[DONE]",
    )
    chunks = await collect(vllm(answer(body)), SamplingParams(max_tokens=4, top_logprobs=1))
    assert [c.token_ids for c in chunks] == [[13048], [IM_END]]


async def test_vllm_events_read_together_become_one_chunk() -> None:
    """What one network read brought is passed on as one chunk: the same tokens, logprobs and
    usage as event by event (the finish held for the usage, as then)."""
    chunks = await collect(vllm(answer(VLLM_STREAM, at_once=True)))
    [chunk] = chunks
    one_by_one = await collect(vllm(answer(VLLM_STREAM)))
    assert chunk.token_ids == [t for c in one_by_one for t in c.token_ids] == [13048, 0, IM_END]
    assert chunk.logprobs == [-0.01, -2.5, -0.05]
    assert chunk.top_logprobs == [t for c in one_by_one for t in c.top_logprobs or []]
    assert chunk.finish_reason == "stop"
    assert chunk.extra == one_by_one[-1].extra


def plain_stream(count: int, *tail: dict[str, Any]) -> list[dict[str, Any]]:
    """``count`` events in the middle of a generation as the gateway asks vLLM for them (ids
    only in the logprob keys), one to three tokens each, then ``tail``."""
    events = []
    for n in range(count):
        ids = [100 + n * 3 + i for i in range(1 + n % 3)]
        logprobs = [-0.01 * (id_ - 99) for id_ in ids]
        top = [
            {f"token_id:{i}": lp, f"token_id:{i + 1}": lp - 1.5}
            for i, lp in zip(ids, logprobs, strict=True)
        ]
        events.append(vllm_event("ab", ids, logprobs, top, with_token_ids=False))
    return [*events, *tail]


def sse_json(events: list[dict[str, Any]], *, compact: bool = True) -> bytes:
    """Events as vLLM writes them (compact JSON) or spaced, then [DONE]."""
    separators = (",", ":") if compact else (", ", ": ")
    return sse(*[json.dumps(event, separators=separators) for event in events], "[DONE]")


FINISH = vllm_event("", [IM_END], [-0.05], [{f"token_id:{IM_END}": -0.05}], "stop")
USAGE_80 = {**VLLM_USAGE, "usage": {"prompt_tokens": len(PROMPT), "completion_tokens": 80}}


@pytest.mark.parametrize("top_logprobs", [0, 1])
@pytest.mark.parametrize("compact", [True, False], ids=["compact", "spaced"])
async def test_vllm_plain_events_read_together_are_read_in_bulk_as_one_by_one(
    top_logprobs: int, compact: bool
) -> None:
    """The plain events of a read (tokens, no finish) are decoded and read in bulk: the same
    tokens, logprobs, alternatives, finish and usage as read event by event."""
    body = sse_json(plain_stream(40, FINISH, USAGE_80), compact=compact)
    params = SamplingParams(max_tokens=200, top_logprobs=top_logprobs)
    [together] = await collect(vllm(answer(body, at_once=True)), params)
    one_by_one = await collect(vllm(answer(body)), params)
    assert len(one_by_one) == 41
    assert together == merged(one_by_one)
    assert together.token_ids[:4] == [100, 103, 104, 106] and together.token_ids[-1] == IM_END
    assert together.finish_reason == "stop"
    assert together.extra == {"prompt_tokens": 9.0, "completion_tokens": 80.0}
    if top_logprobs:
        assert together.top_logprobs is not None
        assert together.top_logprobs[0] == [TopLogprob(100, -0.01)]


class Parts(httpx.AsyncByteStream):
    """The body in the given parts: what each network read brought."""

    def __init__(self, *parts: bytes) -> None:
        self.parts = parts

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for part in self.parts:
            yield part


async def test_vllm_plain_events_after_the_finish_are_refused_in_bulk() -> None:
    first = sse_json(plain_stream(2, FINISH))[: -len(b"data: [DONE]\n\n")]
    body = Parts(first, sse_json(plain_stream(5)))
    backend = vllm(lambda request: httpx.Response(200, stream=body))
    with pytest.raises(BackendError, match="tokens after finish_reason"):
        await collect(backend, SamplingParams(max_tokens=20))


# The sampled token named by its text, not "token_id:<id>" (return_tokens_as_token_ids ignored).
SAMPLED_AS_TEXT = {
    **vllm_event("Hi", [1], [-0.1], with_token_ids=False),
    "choices": [
        {
            "index": 0,
            "text": "Hi",
            "finish_reason": None,
            "logprobs": {"tokens": ["Hi"], "token_logprobs": [-0.1]},
        }
    ],
}


def bad_in_the_middle(bad: dict[str, Any]) -> bytes:
    return sse_json([*plain_stream(6), bad, *plain_stream(6, FINISH, USAGE_80)])


@pytest.mark.parametrize(
    ("body", "match"),
    [
        pytest.param(
            bad_in_the_middle(vllm_event("Hi", [], [], [], with_token_ids=False)),
            "vLLM >= 0.10.2",
            id="text without ids",
        ),
        pytest.param(
            bad_in_the_middle(vllm_event("Hi", [1, 2], [-0.1], [{}, {}], with_token_ids=False)),
            "logprobs for",
            id="misaligned",
        ),
        pytest.param(
            bad_in_the_middle(
                vllm_event("Hi", [1], [-0.1], [{}], with_token_ids=False, prompt_token_ids=[7])
            ),
            "different prompt",
            id="prompt echoed differently",
        ),
        pytest.param(
            bad_in_the_middle({"error": {"message": "CUDA out of memory", "code": 500}}),
            "CUDA out of memory",
            id="error event",
        ),
        pytest.param(
            bad_in_the_middle(SAMPLED_AS_TEXT),
            "not 'token_id:<id>'",
            id="sampled token as text",
        ),
        pytest.param(
            bad_in_the_middle(vllm_event("Hi", [1], [-0.1], None, with_token_ids=False)),
            "no top_logprobs",
            id="alternatives missing",
        ),
    ],
)
async def test_vllm_a_bad_event_among_plain_ones_read_together_is_named(
    body: bytes, match: str
) -> None:
    backend = vllm(answer(body, at_once=True))
    with pytest.raises(BackendError, match=match) as caught:
        await collect(backend, SamplingParams(max_tokens=200, top_logprobs=1))
    assert not isinstance(caught.value, BackendUnavailable)


def vllm_whole(**extra: Any) -> dict[str, Any]:
    """The non-streamed response to VLLM_STREAM's request: one choice, all tokens, the usage."""
    choice = vllm_event(
        "Hi!<|im_end|>",
        [13048, 0, IM_END],
        [-0.01, -2.5, -0.05],
        [
            {"token_id:13048": -0.01, "token_id:9707": -4.6},
            {"token_id:0": -2.5, "token_id:11": -0.2, "token_id:13": -1.9},
            {f"token_id:{IM_END}": -0.05, "token_id:198": -3.1},
        ],
        "stop",
        with_token_ids=False,
        **extra,
    )
    return {**choice, "usage": VLLM_USAGE["usage"]}


async def test_vllm_not_streamed_asks_for_one_response_and_gives_one_chunk() -> None:
    """A caller that reads the completion whole (SamplingParams.stream False): one request
    without stream_options, one JSON response, one chunk with every token and the usage."""
    recorder = Recorder(
        lambda request: httpx.Response(200, json=vllm_whole(prompt_token_ids=PROMPT))
    )
    whole = SamplingParams(**{**vars(PARAMS), "stream": False})
    [chunk] = await collect(vllm(recorder), whole)
    body = recorder.bodies[0]
    assert body["stream"] is False and "stream_options" not in body
    assert chunk == merged(await collect(vllm(answer(VLLM_STREAM))))


def merged(chunks: list[GenerationChunk]) -> GenerationChunk:
    return GenerationChunk(
        [t for c in chunks for t in c.token_ids],
        [lp for c in chunks for lp in c.logprobs],
        None
        if all(c.top_logprobs is None for c in chunks)
        else [t for c in chunks for t in c.top_logprobs or []],
        chunks[-1].finish_reason,
        extra=chunks[-1].extra,
    )


@pytest.mark.parametrize(
    ("echo", "match"),
    [
        pytest.param(json.dumps(PROMPT), None, id="spaced JSON, same ids"),
        pytest.param(json.dumps(PROMPT, separators=(",", ":")), None, id="compact, same ids"),
        pytest.param(json.dumps(PROMPT[:-1]), "different prompt", id="shorter"),
        pytest.param('["a"]', "list of ids", id="not ids"),
        # vLLM 0.32 without return_token_ids writes the field as null (found by the deploy test)
        pytest.param("null", None, id="null: no echo"),
        pytest.param("[]", "different prompt", id="empty"),
    ],
)
async def test_vllm_checks_a_prompt_echo(echo: str, match: str | None) -> None:
    """A server that echoes the prompt (return_token_ids, which the gateway no longer asks
    for) must have generated from the ids sent."""
    body = json.dumps(vllm_whole(prompt_token_ids=0)).replace(
        '"prompt_token_ids": 0', f'"prompt_token_ids": {echo}'
    )
    backend = vllm(lambda request: httpx.Response(200, content=body.encode()))
    whole = SamplingParams(**{**vars(PARAMS), "stream": False})
    if match is None:
        [chunk] = await collect(backend, whole)
        assert chunk.token_ids == [13048, 0, IM_END]
    else:
        with pytest.raises(BackendError, match=match):
            await collect(backend, whole)


async def test_vllm_closing_the_iteration_closes_the_connection() -> None:
    """Cancelling the generation must reach the server: vLLM aborts on disconnect."""
    stream = TrackedStream(VLLM_STREAM)
    backend = vllm(lambda request: httpx.Response(200, stream=stream))
    generation = aiter(backend.generate(Prompt(PROMPT), PARAMS))
    first = await anext(generation)
    assert first.token_ids == [13048]
    assert not stream.closed
    await generation.aclose()  # type: ignore[attr-defined]
    assert stream.closed


class TrackedStream(httpx.AsyncByteStream):
    def __init__(self, body: bytes) -> None:
        self.lines = body.splitlines(keepends=True)
        self.closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for line in self.lines:
            yield line

    async def aclose(self) -> None:
        self.closed = True


@pytest.mark.parametrize(
    ("body", "match"),
    [
        pytest.param(
            sse(vllm_event("Hi", [1], [-0.1], [{"token_id:1": -0.1}])),
            "without a finish_reason",
            id="cut off",
        ),
        pytest.param(b"data: {not json\n\n", "not JSON", id="malformed JSON"),
        pytest.param(sse([1, 2]), "non-object event", id="not an object"),  # type: ignore[arg-type]
        pytest.param(
            sse(
                {
                    "error": {
                        "message": "CUDA out of memory",
                        "type": "InternalServerError",
                        "code": 500,
                    }
                }
            ),
            "CUDA out of memory",
            id="error event",
        ),
        pytest.param(
            sse(vllm_event("Hi", [1, 2], [-0.1], [{}])), "1 logprobs for 2 tokens", id="misaligned"
        ),
        pytest.param(
            sse(vllm_event("Hi", [1], None, with_token_ids=False)),
            "vLLM >= 0.10.2",
            id="text without ids",
        ),
        pytest.param(sse(vllm_event("Hi", [1], None)), "without the logprobs", id="no logprobs"),
        pytest.param(
            sse(vllm_event("Hi", [1], [-0.1], [{"Hi": -0.1}])),
            "return_tokens_as_token_ids",
            id="text keys",
        ),
        pytest.param(
            sse(
                vllm_event("Hi", [1], [-0.1], [{"token_id:1": -0.1}], "stop"),
                vllm_event("!", [2], [-0.1], [{"token_id:2": -0.1}]),
            ),
            "tokens after finish_reason",
            id="tokens after the finish",
        ),
        pytest.param(
            sse(SAMPLED_AS_TEXT),
            "not 'token_id:<id>'",
            id="sampled token as text",
        ),
        pytest.param(
            sse(vllm_event("Hi", [1], [-0.1], [{"token_id:1": -0.1}], prompt_token_ids=[1, 2])),
            "different prompt",
            id="prompt echoed differently",
        ),
        pytest.param(
            sse(
                vllm_event("Hi", [1], [-0.1], [{"token_id:1": -0.1}], "stop"),
                {**VLLM_USAGE, "usage": {"prompt_tokens": 3, "completion_tokens": 1}},
            ),
            "counted 3 prompt tokens, 9 sent",
            id="usage disagrees",
        ),
    ],
)
@pytest.mark.parametrize("at_once", [False, True], ids=["event by event", "read together"])
async def test_vllm_unexpected_payloads_are_backend_errors_naming_the_url(
    body: bytes, match: str, at_once: bool
) -> None:
    backend = vllm(answer(body, at_once=at_once))
    with pytest.raises(BackendError, match=match) as caught:
        await collect(backend, SamplingParams(max_tokens=4, top_logprobs=1))
    assert not isinstance(caught.value, BackendUnavailable)
    assert "http://gpu-1:8000/v1/completions" in str(caught.value)


# ---- SGLang payloads ----------------------------------------------------------------------------

SGLANG_TOKENS = [(13048, -0.01), (0, -2.5), (IM_END, -0.05)]
SGLANG_TOP = [
    [[-0.01, 13048, None], [-4.6, 9707, None]],
    [[-0.2, 11, None], [-1.9, 13, None]],
    [[-0.05, IM_END, None], [-3.1, 198, None]],
]


def sglang_event(
    start: int, end: int, finish: dict[str, Any] | None, *, ids_key: str | None = "output_ids"
) -> dict[str, Any]:
    """Tokens [start:end) of SGLANG_TOKENS as SGLang's tokenizer manager sends them."""
    event: dict[str, Any] = {
        "text": None if finish is None else "Hi!<|im_end|>",
        "meta_info": {
            "id": "9b1e2c",
            "finish_reason": finish,
            "prompt_tokens": len(PROMPT),
            "weight_version": "3",
            "completion_tokens": end,
            "cached_tokens": 8,
            "output_token_logprobs": [[lp, tid, None] for tid, lp in SGLANG_TOKENS[start:end]],
            "output_top_logprobs": SGLANG_TOP[start:end],
            "e2e_latency": 0.12,
        },
    }
    if ids_key is not None:
        event[ids_key] = [tid for tid, _ in SGLANG_TOKENS[start:end]]
    return event


STOP = {"type": "stop", "matched": IM_END}
CUMULATIVE = sse(
    sglang_event(0, 1, None), sglang_event(0, 2, None), sglang_event(0, 3, STOP), "[DONE]"
)
INCREMENTAL = sse(
    sglang_event(0, 1, None), sglang_event(1, 2, None), sglang_event(2, 3, STOP), "[DONE]"
)
EXPECTED_SGLANG = [
    GenerationChunk(
        [13048], [-0.01], [[TopLogprob(13048, -0.01), TopLogprob(9707, -4.6)]], None, 3
    ),
    GenerationChunk([0], [-2.5], [[TopLogprob(11, -0.2), TopLogprob(13, -1.9)]], None, 3),
    GenerationChunk(
        [IM_END],
        [-0.05],
        [[TopLogprob(IM_END, -0.05), TopLogprob(198, -3.1)]],
        "stop",
        3,
        {"prompt_tokens": 9.0, "completion_tokens": 3.0, "cached_prompt_tokens": 8.0},
    ),
]


async def test_sglang_sends_input_ids_and_sampling_params() -> None:
    recorder = Recorder(answer(CUMULATIVE))
    await collect(sglang(recorder))
    assert str(recorder.requests[0].url) == "http://gpu-2:30000/generate"
    assert recorder.bodies == [
        {
            "input_ids": PROMPT,
            "sampling_params": {
                "max_new_tokens": 16,
                "temperature": 0.7,
                "top_p": 0.9,
                "stop_token_ids": [IM_END],
                "sampling_seed": 7,
            },
            "return_logprob": True,
            "top_logprobs_num": 2,
            "logprob_start_len": -1,
            "stream": True,
        }
    ]


@pytest.mark.parametrize("temperature", [0.0, 1e-6, 9e-6])
async def test_sglang_is_sent_greedy_as_zero(temperature: float) -> None:
    """Issue 38: below 1e-5 a turn is greedy (vLLM's rule, the record's, the trainer's), but
    SGLang tempers down to 1e-6: sent as temperature 0 (and top_p 1), it takes the argmax and
    returns the raw log-probs the record claims."""
    recorder = Recorder(answer(CUMULATIVE))
    await collect(
        sglang(recorder), SamplingParams(max_tokens=16, temperature=temperature, top_p=0.5)
    )
    sent = recorder.bodies[0]["sampling_params"]
    assert (sent["temperature"], sent["top_p"]) == (0.0, 1.0)


async def test_sglang_without_seed_leaves_it_to_the_server() -> None:
    recorder = Recorder(answer(CUMULATIVE))
    chunks = await collect(sglang(recorder), SamplingParams(max_tokens=16))
    assert "sampling_seed" not in recorder.bodies[0]["sampling_params"]
    assert recorder.bodies[0]["top_logprobs_num"] == 0
    assert [c.top_logprobs for c in chunks] == [None, None, None]


@pytest.mark.parametrize(
    ("body", "incremental"),
    [
        pytest.param(CUMULATIVE, False, id="cumulative"),
        pytest.param(INCREMENTAL, True, id="incremental"),
    ],
)
async def test_sglang_stream_emits_only_the_new_tokens(body: bytes, incremental: bool) -> None:
    assert await collect(sglang(answer(body), incremental=incremental)) == EXPECTED_SGLANG


async def test_sglang_events_read_together_and_not_streamed_give_one_chunk() -> None:
    together = await collect(sglang(answer(CUMULATIVE, at_once=True)))
    recorder = Recorder(lambda request: httpx.Response(200, json=sglang_event(0, 3, STOP)))
    whole = await collect(sglang(recorder), SamplingParams(**{**vars(PARAMS), "stream": False}))
    assert recorder.bodies[0]["stream"] is False
    expected = GenerationChunk(
        [13048, 0, IM_END],
        [-0.01, -2.5, -0.05],
        [t for c in EXPECTED_SGLANG for t in c.top_logprobs or []],
        "stop",
        3,
        EXPECTED_SGLANG[-1].extra,
    )
    assert together == whole == [expected]


async def test_sglang_without_output_ids_reads_them_from_the_logprobs() -> None:
    body = sse(
        *(sglang_event(0, end, STOP if end == 3 else None, ids_key=None) for end in (1, 2, 3)),
        "[DONE]",
    )
    chunks = await collect(sglang(answer(body)))
    assert [c.token_ids for c in chunks] == [[13048], [0], [IM_END]]


async def test_sglang_length_finish() -> None:
    body = sse(
        sglang_event(0, 1, None), sglang_event(0, 2, {"type": "length", "length": 2}), "[DONE]"
    )
    chunks = await collect(sglang(answer(body)), SamplingParams(max_tokens=2, top_logprobs=2))
    assert [(c.token_ids, c.finish_reason) for c in chunks] == [([13048], None), ([0], "length")]


@pytest.mark.parametrize(
    ("body", "incremental", "match"),
    [
        pytest.param(
            sse(sglang_event(0, 1, None), "[DONE]"), False, "without a finish_reason", id="cut off"
        ),
        pytest.param(
            sse({"error": {"message": "input_ids too long"}}),
            False,
            "input_ids too long",
            id="error event",
        ),
        pytest.param(
            INCREMENTAL,
            False,
            "does --incremental-streaming-output match",
            id="incremental read as cumulative",
        ),
        pytest.param(
            CUMULATIVE,
            True,
            "does --incremental-streaming-output match",
            id="cumulative read as incremental",
        ),
        pytest.param(
            sse({**sglang_event(0, 1, None), "output_ids": [42]}),
            False,
            "do not match output_ids",
            id="ids disagree with logprobs",
        ),
        pytest.param(
            sse(
                {
                    **sglang_event(0, 1, STOP),
                    "meta_info": {**sglang_event(0, 1, STOP)["meta_info"], "prompt_tokens": 4},
                }
            ),
            False,
            "counted 4 prompt tokens, 9 sent",
            id="prompt length disagrees",
        ),
        pytest.param(
            sse({"text": "Hi"}),
            False,
            "expected an object holding 'output_token_logprobs'",
            id="no meta_info",
        ),
        pytest.param(
            sse(sglang_event(0, 1, STOP), sglang_event(0, 2, None)),
            False,
            "after finish_reason",
            id="after finish",
        ),
    ],
)
async def test_sglang_unexpected_payloads_are_backend_errors_naming_the_url(
    body: bytes, incremental: bool, match: str
) -> None:
    with pytest.raises(BackendError, match=match) as caught:
        await collect(sglang(answer(body), incremental=incremental))
    assert "http://gpu-2:30000/generate" in str(caught.value)


# ---- aborted generations (issue 37) ------------------------------------------------------------


@pytest.mark.parametrize("at_once", [False, True], ids=["event by event", "read together"])
async def test_a_vllm_generation_aborted_for_a_weight_update_ends_with_its_tokens(
    at_once: bool,
) -> None:
    """vLLM paused with /pause?mode=abort ends the request with finish_reason "abort": the
    tokens before it are read, and the last chunk says "abort" (the gateway continues the turn),
    where it used to be a BackendError that threw them away."""
    body = sse(
        vllm_event("Hi", [13048], [-0.01], [{"token_id:13048": -0.01}]),
        vllm_event(",", [11], [-0.2], [{"token_id:11": -0.2}]),
        vllm_event("", [], [], [], "abort"),
        VLLM_USAGE_ABORTED,
        "[DONE]",
    )
    chunks = await collect(vllm(answer(body, at_once=at_once)))
    assert [t for c in chunks for t in c.token_ids] == [13048, 11]
    assert chunks[-1].finish_reason == "abort"
    assert all(c.finish_reason is None for c in chunks[:-1])


async def test_an_sglang_generation_aborted_ends_with_its_tokens() -> None:
    abort = {"type": "abort", "message": "Abort in waiting queue"}
    body = sse(sglang_event(0, 1, None), sglang_event(1, 2, abort), "[DONE]")
    chunks = await collect(sglang(answer(body), incremental=True))
    assert [t for c in chunks for t in c.token_ids] == [13048, 0]
    assert chunks[-1].finish_reason == "abort"


# ---- transport errors, both backends ------------------------------------------------------------

BACKENDS = [pytest.param(vllm, id="vllm"), pytest.param(sglang, id="sglang")]


def refuse(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("[Errno 111] Connection refused", request=request)


def time_out(request: httpx.Request) -> httpx.Response:
    raise httpx.ReadTimeout("timed out", request=request)


def drop(request: httpx.Request) -> httpx.Response:
    raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")


@pytest.mark.parametrize("make", BACKENDS)
@pytest.mark.parametrize(
    ("handler", "error", "match"),
    [
        pytest.param(
            refuse, BackendUnavailable, "cannot connect.*Connection refused", id="refused"
        ),
        pytest.param(
            answer(b'{"detail": "loading"}', 503), BackendUnavailable, "HTTP 503", id="503"
        ),
        pytest.param(
            answer(b"Internal Server Error", 500),
            BackendError,
            "HTTP 500: Internal Server Error",
            id="500",
        ),
        pytest.param(
            answer(b'{"object": "error", "message": "bad"}', 400),
            BackendError,
            "HTTP 400.*bad",
            id="400",
        ),
        pytest.param(time_out, BackendError, "timed out", id="timeout"),
        pytest.param(drop, BackendError, "failed mid-request", id="dropped"),
    ],
)
async def test_transport_errors_are_translated(
    make: Callable[[Handler], Backend], handler: Handler, error: type[BackendError], match: str
) -> None:
    backend = make(handler)
    with pytest.raises(error, match=match) as caught:
        await collect(backend)
    assert (
        type(caught.value) is error
    )  # a timeout is not "unavailable": the router keeps the replica
    assert "http://gpu-" in str(caught.value)
    assert isinstance(caught.value.__cause__, httpx.HTTPError | type(None))


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
async def test_protocol_and_transport_ownership(kind: str) -> None:
    transport = HandlerTransport(answer(b""))
    backend: Backend = (
        VLLMBackend(
            "http://gpu-1:8000", "m", backend_id="v", max_context=32768, transport=transport
        )
        if kind == "vllm"
        else SGLangBackend(
            "http://gpu-2:30000", backend_id="s", max_context=32768, transport=transport
        )
    )
    assert isinstance(backend, Backend)
    assert backend.max_context == 32768
    await backend.close()
    # An injected transport belongs to the caller: close() leaves it open.
    assert not transport.closed


async def test_own_transport_is_closed() -> None:
    backend = SGLangBackend("http://gpu-3:30000", backend_id="sglang-3", max_context=4096)
    await backend.close()
    with pytest.raises(RuntimeError, match="the transport is closed"):
        await collect(backend)
