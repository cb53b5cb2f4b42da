"""vLLM's token-in/token-out endpoint for prompts with images: the request and its reading.

vLLM (0.32) has one way to take a prompt the gateway tokenized *and* its images:
``POST /inference/v1/generate`` (``GenerateRequest``, vllm/entrypoints/scale_out/
token_in_token_out/protocol.py:162-343). ``/v1/completions`` has no field for images (its
``prompt`` is ids or text only, openai/completion/protocol.py:52-58), and
``/v1/chat/completions`` takes messages, not ids (vLLM issue #54937 asks for token input there).
The endpoint is mounted only on a server started with ``--enable-scale-out``; without it vLLM
answers 403 (scale_out/factories.py:71-111), which the gateway answers with that advice.

vLLM runs every image through the model's processor and expands each image placeholder in the
ids it is given, *always* (``_apply_prompt_updates``, multimodal/processing/processor.py:
1699-1736, called unconditionally since 0.32): an id list already expanded would be expanded
again. So each image's run of placeholder tokens is sent collapsed to one (``collapsed_ids``,
as verl 0.9.1 does before its own processor call, experimental/agent_loop/agent_loop.py:
878-895), and the images ride along as data URLs, in order, each named by its SHA-256 (``uuid``:
vLLM's multimodal cache keys on it)::

    POST {base_url}/inference/v1/generate
    {"model": ..., "token_ids": [151644, 872, 151652, 151655, 151653, ...],  # one pad an image
     "content_parts": [{"type": "image_url", "url": "data:image/png;base64,...",
                        "uuid": "<sha256>"}],
     "sampling_params": {"max_tokens": 256, "temperature": 1.0, "top_p": 1.0, "seed": 7,
                         "stop_token_ids": [151645], "logprobs": 5, "detokenize": false,
                         "skip_special_tokens": false},
     "return_token_ids": true, "stream": true, "stream_options": {"include_usage": true}}

    data: {"request_id": ..., "prompt_token_ids": [...], "mm_placeholders":
           {"image": [{"offset": 3, "length": 8}]},              # first event only
           "choices": [{"index": 0, "token_ids": [13048], "finish_reason": null,
                        "logprobs": {"content": [{"token_id": 13048, "logprob": -0.01,
                                     "top_logprobs": [{"token_id": 13048, "logprob": -0.01}]}]}}]}
    ...
    data: {"request_id": ..., "choices": [], "usage": {"prompt_tokens": 19, ...}}
    data: [DONE]

(response models: protocol.py:364-533; the stream's first event carries the prompt as vLLM
expanded it, serving.py:565-569,649-651; not streamed, one ``GenerateTokensResponse``.)
``return_token_ids`` asks for the prompt vLLM actually read: ``GenerateReader`` compares it with
the gateway's expanded ids. Equal, the turn is what the gateway kept. Different (vLLM's
processor expands an image otherwise: another ``preprocessor_config.json``, another version),
the chunk carries vLLM's prompt (``GenerationChunk.served_prompt``: its ids, its images where
``mm_placeholders`` puts them) and the turn is recorded with it, marked
(``gateway.serving.generating``). Text prompts never come here: ``/v1/completions`` as before.
"""

from __future__ import annotations

import base64
from collections import OrderedDict
from typing import Any

import msgspec
import numpy as np

from gateway.backends.interface import (
    FinishReason,
    GenerationChunk,
    Prompt,
    PromptImage,
    SamplingParams,
    TopLogprob,
)
from gateway.backends.remote import decode_event
from gateway.backends.vllm_reader import read_finish_reason
from gateway.errors import BackendError
from gateway.frozen import evolved
from schemas.images import ImageRef, sniff_mime

__all__ = ["GENERATE_PATH", "GenerateReader", "ImageParts", "collapsed_ids", "generate_request"]

GENERATE_PATH = "/inference/v1/generate"
_JSON = msgspec.json.Encoder()


def collapsed_ids(prompt: Prompt) -> list[int]:
    """The prompt's ids with each image's run of placeholder tokens collapsed to its first
    token: what vLLM expands again, image by image (see the module's docstring).

    >>> from schemas.images import ImageRef
    >>> ref = ImageRef("ab" * 32, offset=1, length=3, width=28, height=28)
    >>> collapsed_ids(Prompt([5, 9, 9, 9, 6], images=(PromptImage(ref, b""),)))
    [5, 9, 6]
    """
    ids = prompt.ids
    parts: list[np.ndarray] = []
    start = 0
    for image in prompt.images:
        ref = image.ref
        run = ids[ref.offset : ref.end]
        if ref.offset < start or len(run) != ref.length or (run != run[0]).any():
            raise BackendError(
                f"image {ref.sha256[:12]} at ids[{ref.offset}:{ref.end}] is not one run of "
                f"placeholder tokens in a prompt of {len(ids)} ids (images out of order?)"
            )
        parts += [ids[start : ref.offset + 1]]
        start = ref.end
    parts.append(ids[start:])
    collapsed: list[int] = np.concatenate(parts).tolist()
    return collapsed


def generate_request(
    model: str, prompt: Prompt, params: SamplingParams, parts: ImageParts | None = None
) -> dict[str, Any]:
    """The JSON body of one ``/inference/v1/generate`` request for an image prompt (the
    sampling as ``gateway.backends.vllm.completion_request`` asks for it, in vLLM's
    ``SamplingParams`` fields, vllm/sampling_params.py:268-443). ``parts``: the backend's
    memory of its images' encoded content parts (None: each encoded here)."""
    parts = parts or ImageParts(0)
    sampling: dict[str, Any] = {
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "stop_token_ids": list(params.stop_token_ids),
        # Always: every sampled token's logprob (and its id) comes back; 0 = the sampled one.
        "logprobs": params.top_logprobs,
        # The gateway detokenizes; vLLM need not (and stop strings are the gateway's too).
        "detokenize": False,
        "skip_special_tokens": False,
    }
    if params.seed is not None:
        sampling["seed"] = params.seed
    body: dict[str, Any] = {
        "model": model,
        "token_ids": collapsed_ids(prompt),
        "content_parts": [parts.part(image) for image in prompt.images],
        "sampling_params": sampling,
        "return_token_ids": True,  # the prompt as vLLM expanded it, checked against the ids
        "stream": params.stream,
    }
    if params.stream:
        body["stream_options"] = {"include_usage": True}
    return body


class ImageParts:
    """The JSON of each image's content part (its data URL), encoded once and kept while it is
    among the last ``max_bytes`` of them: an agent's conversation shows its screenshots again on
    every turn, and vLLM is sent every image of the prompt each time. Base64-encoding a 1 MB
    screenshot and copying it through the JSON encoder cost ~2 ms a turn per image shown
    (benchmarks/images.py): kept, the part is copied into the body as it is (``msgspec.Raw``).

    >>> ref = ImageRef("ab" * 32, offset=0, length=1, width=1, height=1, mime="image/png")
    >>> bytes(ImageParts().part(PromptImage(ref, b"hi")))[:40]
    b'{"type":"image_url","url":"data:image/pn'
    """

    def __init__(self, max_bytes: int = 256 << 20) -> None:
        self._parts: OrderedDict[str, msgspec.Raw] = OrderedDict()
        self._bytes = 0
        self._max_bytes = max_bytes

    def part(self, image: PromptImage) -> msgspec.Raw:
        digest = image.ref.sha256
        kept = self._parts.get(digest)
        if kept is not None:
            self._parts.move_to_end(digest)
            return kept
        mime = image.ref.mime or sniff_mime(image.data) or "application/octet-stream"
        url = f"data:{mime};base64,{base64.b64encode(image.data).decode('ascii')}"
        part = msgspec.Raw(_JSON.encode({"type": "image_url", "url": url, "uuid": digest}))
        if len(part) <= self._max_bytes:
            self._parts[digest] = part
            self._bytes += len(part)
            while self._bytes > self._max_bytes:
                self._bytes -= len(self._parts.popitem(last=False)[1])
        return part


# What the gateway reads of vLLM's generate JSON (GenerateTokensStreamResponse,
# GenerateTokensResponse: protocol.py:444-533), typed so that msgspec checks every type.
class _Candidate(msgspec.Struct, gc=False):
    token_id: int
    logprob: float


class _Position(msgspec.Struct, gc=False):
    token_id: int
    logprob: float
    top_logprobs: list[_Candidate] = []


class _Logprobs(msgspec.Struct, gc=False):
    content: list[_Position] | None = None


class _Choice(msgspec.Struct, gc=False):
    token_ids: list[int] | None = None
    logprobs: _Logprobs | None = None
    finish_reason: str | None = None


class _Placeholder(msgspec.Struct, gc=False):
    offset: int
    length: int


class _Usage(msgspec.Struct, gc=False):
    prompt_tokens: int
    completion_tokens: int


class _Event(msgspec.Struct, gc=False):
    choices: list[_Choice] | None = None
    usage: _Usage | None = None
    prompt_token_ids: list[int] | None = None
    mm_placeholders: dict[str, list[_Placeholder]] | None = None
    error: Any = None


_DECODER = msgspec.json.Decoder(_Event)


class GenerateReader:
    """Reads one generation from ``/inference/v1/generate`` (streamed events, or the one
    response) into GenerationChunks; checks the prompt vLLM read against the one sent."""

    def __init__(self, prompt: Prompt, *, top_logprobs: int, url: str) -> None:
        self._prompt = prompt
        self._top_logprobs = top_logprobs
        self._url = url
        self._where = f"vLLM at {url}"
        self._served: Prompt | None = None  # vLLM's prompt, where it differs
        self._echoed = False
        self.usage: dict[str, float] = {}
        self.finished = False
        self._held: GenerationChunk | None = None

    def read_whole(self, payload: bytes) -> None:
        self._held = self._chunk([self._decode(payload)])

    def read_batch(self, payloads: list[bytes]) -> GenerationChunk | None:
        chunk = self._chunk([self._decode(payload) for payload in payloads])
        if chunk is not None and chunk.finish_reason is not None:
            self._held = chunk  # the usage event follows it
            return None
        return chunk

    def last(self) -> GenerationChunk | None:
        finished = self._held
        if finished is None:
            return None
        if not self._echoed:
            raise BackendError(
                f"{self._where} did not return the prompt it read (return_token_ids): the "
                "gateway cannot check that its images were expanded as the gateway expanded them"
            )
        prompt_tokens = self.usage.get("prompt_tokens")
        served = self._served or self._prompt
        if prompt_tokens is not None and prompt_tokens != len(served):
            raise BackendError(
                f"{self._where} counted {prompt_tokens:.0f} prompt tokens, {len(served)} read"
            )
        return evolved(finished, extra={**finished.extra, **self.usage})

    def _decode(self, payload: bytes) -> _Event:
        try:
            event = _DECODER.decode(payload)
        except msgspec.DecodeError as exc:
            decode_event(payload, self._url, "vLLM")  # names an error event, or not JSON
            raise BackendError(f"{self._where} sent an unexpected event: {exc}") from None
        if event.error is not None:
            decode_event(payload, self._url, "vLLM")  # raises, naming the error
        return event

    def _chunk(self, events: list[_Event]) -> GenerationChunk | None:
        where = self._where
        ids: list[int] = []
        logprobs: list[float] = []
        tops: list[list[TopLogprob]] | None = [] if self._top_logprobs > 0 else None
        finish: FinishReason | None = None
        served: Prompt | None = None
        for event in events:
            if event.usage is not None:
                self.usage = {
                    "prompt_tokens": float(event.usage.prompt_tokens),
                    "completion_tokens": float(event.usage.completion_tokens),
                }
            if event.prompt_token_ids is not None:
                served = self._echo(event.prompt_token_ids, event.mm_placeholders)
            if not event.choices:
                continue
            if len(event.choices) != 1:
                raise BackendError(
                    f"{where} sent {len(event.choices)} choices; the gateway asks for one"
                )
            choice = event.choices[0]
            reason = read_finish_reason(choice.finish_reason, where)
            tokens = choice.token_ids or []
            if (tokens or reason is not None) and self.finished:
                raise BackendError(f"{where} sent tokens after finish_reason")
            if reason is not None:
                self.finished, finish = True, reason
            if not tokens:
                continue
            content = None if choice.logprobs is None else choice.logprobs.content
            if content is None or len(content) != len(tokens):
                raise BackendError(f"{where} returned tokens without the logprobs asked for")
            for token, position in zip(tokens, content, strict=True):
                if position.token_id != token:
                    raise BackendError(
                        f"{where} sent the logprob of token {position.token_id} for token {token}"
                    )
                logprobs.append(position.logprob)
                if tops is not None:
                    # The sampled token first, then the candidates (protocol.py:380-383);
                    # the k most likely are kept, as on /v1/completions.
                    ranked = sorted(position.top_logprobs, key=lambda c: -c.logprob)
                    tops.append(
                        [TopLogprob(c.token_id, c.logprob) for c in ranked[: self._top_logprobs]]
                    )
            ids += tokens
        if not ids and finish is None and served is None:
            return None
        return GenerationChunk(ids, logprobs, tops, finish, served_prompt=served)

    def _echo(
        self, echoed: list[int], placeholders: dict[str, list[_Placeholder]] | None
    ) -> Prompt | None:
        """vLLM's prompt where it differs from the one sent (None: the same ids)."""
        self._echoed = True
        sent = self._prompt
        if sent.same_ids(echoed):
            return None
        ranges = (placeholders or {}).get("image", [])
        if len(ranges) != len(sent.images):
            raise BackendError(
                f"{self._where} placed {len(ranges)} images in the prompt; "
                f"{len(sent.images)} were sent"
            )
        size, where = len(echoed), self._where
        images = tuple(
            PromptImage(_placed(image.ref, r.offset, r.length, size, where), image.data)
            for image, r in zip(sent.images, ranges, strict=True)
        )
        self._served = Prompt(echoed, images=images)
        return self._served


def _placed(ref: ImageRef, offset: int, length: int, size: int, where: str) -> ImageRef:
    """``ref`` where vLLM placed its image; its grid is vLLM's processor's, unknown here."""
    if offset < 0 or length < 1 or offset + length > size:
        raise BackendError(f"{where} placed image {ref.sha256[:12]} at {offset}+{length}")
    return ImageRef(ref.sha256, offset, length, ref.width, ref.height, ref.mime)
