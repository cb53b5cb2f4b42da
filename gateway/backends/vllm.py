"""vLLM's OpenAI-compatible server as a Backend: token ids in, token ids and logprobs out.

Targets vLLM >= 0.10.2 (``--logprobs-mode``, below). ``/v1/completions`` takes the prompt as
token ids; ``logprobs`` (always asked for) with ``return_tokens_as_token_ids`` names each sampled
token ``"token_id:<id>"``, which is how the gateway reads the sampled ids:

    POST {base_url}/v1/completions
    {"model": ..., "prompt": [151644, 872, ...],      # token ids: vLLM does not tokenize them
     "max_tokens": 256, "temperature": 1.0, "top_p": 1.0, "seed": 7, "stop_token_ids": [151645],
     "logprobs": 5, "return_tokens_as_token_ids": true,
     "skip_special_tokens": false, "include_stop_str_in_output": true,
     "stream": true, "stream_options": {"include_usage": true}}

    data: {"choices": [{"index": 0, "text": "Hi",
           "logprobs": {"tokens": ["token_id:13048"], "token_logprobs": [-0.01],
                        "top_logprobs": [{"token_id:13048": -0.01, "token_id:9707": -4.6}],
                        "text_offset": [0]},
           "finish_reason": null}], "usage": null}
    ...
    data: {"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 9, ...}}
    data: [DONE]

Not ``return_token_ids``: it would add the ``token_ids`` the logprob keys already give, and
echo the whole prompt's ids in the first event (or the response), O(context) for the server to
write and the gateway to read on every turn. Ids are still read from ``token_ids`` when a server
sends them, and a prompt echo is still checked against the ids sent (as bytes, then as ids).
``logprobs: k`` returns the sampled token's logprob plus up to k alternatives (vLLM may add the
sampled token as a k+1-th entry; the k most likely are kept).

A caller that reads the completion whole (``SamplingParams.stream`` False: a client that does
not stream) gets it from one non-streamed request (``"stream": false``, the same choice with
every token, and ``usage``) as one chunk. ``gateway.backends.vllm_reader`` reads vLLM's JSON;
``gateway.backends.remote`` sends the request and reads the stream.

Server flags: ``--logprobs-mode processed_logprobs`` (vLLM >= 0.10.2) makes the logprobs those of
the distribution actually sampled from (after temperature, and top-p when < 1), as the Backend
protocol promises; vLLM's default (raw_logprobs) reports the model's raw distribution whatever
the sampling. The gateway cannot choose the mode per request, so it probes each replica
(``gateway.backends.probe``) and refuses a temperature other than 1 or a top_p below 1 on a
raw-mode replica (400), unless ``--allow-raw-logprobs`` marks such turns "raw".
``--max-logprobs`` must be at least the largest ``top_logprobs`` an agent asks for (and 1, for
the probe).

A prompt with images goes to vLLM's token-in/token-out endpoint instead, ``/inference/v1/generate``
(the server needs ``--enable-scale-out``): ``gateway.backends.vllm_generate`` says why and how.
Text prompts never do: their path, and its cost, are the ones above.

tests/unit/test_remote_backends.py checks this translation against payloads shaped as vLLM
documents them; tests/unit/test_vllm_images.py the image path against a stand-in of vLLM's;
tests/deploy/test_vllm.py runs it against a real vLLM 0.32 (its CPU build), two
replicas, streamed and not, with log-probs checked against the reference trainer's.
"""

from __future__ import annotations

from typing import Any, Unpack

import msgspec

from gateway.backends.interface import Prompt, SamplingParams
from gateway.backends.probe import LogprobsKind
from gateway.backends.remote import Endpoint, PayloadReader, RemoteBackend, RemoteOptions
from gateway.backends.transport import Target
from gateway.backends.vllm_generate import (
    GENERATE_PATH,
    GenerateReader,
    ImageParts,
    generate_request,
)
from gateway.backends.vllm_reader import CompletionReader

__all__ = ["VLLMBackend", "completion_request"]

_PROCESSED = "Start vLLM with --logprobs-mode processed_logprobs (vLLM >= 0.10.2)"
_ADVICE: dict[LogprobsKind, str] = {
    "raw": "Its --logprobs-mode is the default, raw_logprobs: start it with --logprobs-mode "
    "processed_logprobs (vLLM >= 0.10.2)",
    "tempered": _PROCESSED,
    "processed": _PROCESSED,
    "unknown": _PROCESSED,
}
# vLLM mounts /inference/v1/generate only with --enable-scale-out; else 403 (its
# entrypoints/scale_out/factories.py:84-111).
_SCALE_OUT = {
    403: "The gateway sends prompts with images to vLLM's token-in/token-out endpoint "
    f"({GENERATE_PATH}), which vLLM serves only when started with --enable-scale-out "
    "(vLLM >= 0.32): restart it with that flag. Text turns are not affected."
}


class VLLMBackend(RemoteBackend):
    def __init__(self, base_url: str, model: str, **options: Unpack[RemoteOptions]) -> None:
        # Accept the base URL with or without the /v1 an OpenAI client would be given.
        root = base_url.rstrip("/").removesuffix("/v1")
        super().__init__(f"{root}/v1/completions", "vLLM", _ADVICE, **options)
        self._model = model
        self._generate_url = f"{root}{GENERATE_PATH}"
        self._generate = Endpoint(Target(self._generate_url), _SCALE_OUT)
        self._image_parts = ImageParts()  # each image's data URL, encoded once

    def _endpoint(self, prompt: Prompt) -> Endpoint:
        return self._generate if prompt.images else super()._endpoint(prompt)

    def _request(self, prompt: Prompt, params: SamplingParams) -> dict[str, Any]:
        if prompt.images:
            return generate_request(self._model, prompt, params, self._image_parts)
        return completion_request(self._model, prompt, params)

    def _reader(self, prompt: Prompt, params: SamplingParams) -> PayloadReader:
        if prompt.images:
            return GenerateReader(prompt, top_logprobs=params.top_logprobs, url=self._generate_url)
        return CompletionReader(prompt, top_logprobs=params.top_logprobs, url=self._url)


def completion_request(model: str, prompt: Prompt, params: SamplingParams) -> dict[str, Any]:
    """The JSON body of one /v1/completions request (the prompt's ids as their JSON text,
    ``msgspec.Raw``: a turn that continues a kept turn encodes only its new ids); streamed
    unless ``params.stream`` is False."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": msgspec.Raw(prompt.json()),
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "stop_token_ids": list(params.stop_token_ids),
        # Always ask: logprobs are recorded for every sampled token (0 = the sampled one only),
        # and their "token_id:<id>" keys are the sampled ids. Not return_token_ids: its echo of
        # the prompt ids would cost the server and the gateway O(context) every turn.
        "logprobs": params.top_logprobs,
        "return_tokens_as_token_ids": True,
        "skip_special_tokens": False,
        "include_stop_str_in_output": True,
        "stream": params.stream,
    }
    if params.stream:
        body["stream_options"] = {"include_usage": True}
    if params.seed is not None:
        body["seed"] = params.seed
    return body
