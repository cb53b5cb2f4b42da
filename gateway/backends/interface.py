"""The one small interface every inference backend implements (DESIGN §4).

Token ids and sampling parameters in; token ids and their logprobs out, streamed. The gateway
owns tokenization and chat templates: a backend never sees text it must tokenize, and what it
streams back is exactly what the model sampled.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, Protocol, runtime_checkable

import msgspec
import numpy as np

from schemas.images import ImageRef
from schemas.sampling import is_greedy

__all__ = [
    "Backend",
    "GenerationChunk",
    "JsonHead",
    "Prompt",
    "PromptImage",
    "SamplingParams",
    "TopLogprob",
    "needs_processed_logprobs",
]

FinishReason = Literal["stop", "length", "abort"]
# The JSON text of a prompt's first ids without the closing bracket, in parts: a view of the
# kept turn's prompt JSON and the text of its completion ids (nothing copied until it is sent).
JsonHead = tuple[bytes | memoryview, ...]


_JSON = msgspec.json.Encoder()


class PromptImage(NamedTuple):
    """An image of a prompt as a backend takes it: where its placeholder tokens sit in the
    prompt's ids (already expanded, as the model's processor expands them) and its bytes as the
    client sent them (checked at the API edge: a decodable PNG, JPEG, GIF or WebP)."""

    ref: ImageRef
    data: bytes


class Prompt:
    """A prompt's token ids as the Backend port carries them: an int32 array, and (built on
    first use, once) the JSON array text the HTTP backends put in their request bodies.

    A turn that continues a kept turn passes that turn's context as ``head``: the JSON text of
    ``ids[:head_len]`` without its closing bracket, in parts, which the kept turn cached when
    its own prompt was sent (``extended_json_head``: a view of that prompt's JSON and its
    completion's text). Then ``json()`` encodes only the new ids and copies the head once, into
    the text sent, and a turn's cost does not grow with its context.

    >>> p = Prompt([1, 2, 3])
    >>> len(p), p.json(), b"".join(p.extended_json_head([4, 5]))
    (3, b'[1,2,3]', b'[1,2,3,4,5')
    >>> q = Prompt([1, 2, 3, 4, 5, 6], head=p.extended_json_head([4, 5]), head_len=5)
    >>> q.json(), q.same_ids([1, 2, 3, 4, 5, 6]), q.same_ids([1, 2, 3])
    (b'[1,2,3,4,5,6]', True, False)
    """

    __slots__ = ("_head", "_head_len", "_json", "_list", "ids", "images")

    def __init__(
        self,
        ids: Sequence[int] | np.ndarray,
        *,
        head: JsonHead = (),
        head_len: int = 0,
        images: tuple[PromptImage, ...] = (),
    ) -> None:
        self.ids: np.ndarray = np.asarray(ids, dtype=np.int32)
        # The images the ids' placeholder runs stand for, in order ((): a text prompt).
        self.images = images
        # A list given is kept: encoding it needs no conversion from the array.
        self._list: list[int] | None = ids if isinstance(ids, list) else None
        if head_len > len(self.ids) or (head_len > 0) != bool(head):
            raise ValueError(f"a JSON head of {head_len} ids for a prompt of {len(self.ids)}")
        self._head = head
        self._head_len = head_len
        self._json: bytes | None = None

    def __len__(self) -> int:
        return len(self.ids)

    def __repr__(self) -> str:
        return f"Prompt({len(self.ids)} ids)"

    @property
    def encoded(self) -> bool:
        """Whether ``json()`` was built (an HTTP backend sent this prompt)."""
        return self._json is not None

    def extended(self, more: Sequence[int]) -> Prompt:
        """These ids followed by ``more`` (a turn continued after its backend aborted it). The
        JSON head carried over: these ids' own JSON where it was built (sent once already), so
        the continuation encodes only ``more``.

        >>> p = Prompt([1, 2]); _ = p.json(); p.extended([3]).json()
        b'[1,2,3]'
        """
        ids = np.concatenate([self.ids, np.asarray(more, dtype=np.int32)])
        if self._json is not None and len(self.ids):
            head: JsonHead = (memoryview(self._json)[:-1],)
            return Prompt(ids, head=head, head_len=len(self.ids), images=self.images)
        return Prompt(ids, head=self._head, head_len=self._head_len, images=self.images)

    def tolist(self) -> list[int]:
        if self._list is None:
            self._list = self.ids.tolist()
        return self._list

    def json(self) -> bytes:
        """The ids as a JSON array: ``b"[1,2,3]"``."""
        if self._json is None:
            if not self._head_len:
                self._json = _JSON.encode(self.tolist())
            elif self._head_len == len(self.ids):
                self._json = b"".join((*self._head, b"]"))
            else:  # one copy of the head, however long
                tail = _JSON.encode(self.ids[self._head_len :].tolist())
                self._json = b"".join((*self._head, b",", memoryview(tail)[1:]))
        return self._json

    def extended_json_head(self, more: Sequence[int]) -> JsonHead:
        """The JSON head (no closing bracket) of these ids followed by ``more``: what the
        kept turn of this prompt and its completion caches for the turn that continues it. No
        copy of this prompt's JSON: a view of it (which it keeps alive)."""
        text = memoryview(self.json())[:-1]
        if not more:
            return (text,)
        tail = memoryview(_JSON.encode(more if isinstance(more, list) else list(more)))[1:-1]
        return (text, b"," if len(self.ids) else b"", tail)

    def same_ids(self, ids: Sequence[int]) -> bool:
        """Whether ``ids`` (e.g. a backend's echo of the prompt) are exactly these ids."""
        return len(ids) == len(self.ids) and _JSON.encode(ids) == self.json()


@dataclass(frozen=True)
class SamplingParams:
    """What the gateway asks of one generation.

    ``logprobs`` are always returned for every sampled token: they are the log-probabilities
    under the distribution the token was sampled from, ``log_softmax(logits / temperature)``
    restricted to the top-p nucleus and renormalized over it (the raw ``log_softmax(logits)``
    when greedy: a temperature below 1e-5, as vLLM has it, ``schemas.sampling``).
    ``top_logprobs`` > 0 also returns up to that many alternatives per position, from the same
    distribution: tokens outside the nucleus have probability 0 and may be left out.
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: Sequence[int] = ()  # generation ends after emitting one of these
    top_logprobs: int = 0
    # A backend that can only return the model's raw log-probs (vLLM's default logprobs mode)
    # refuses a sampling whose distribution differs from them, unless this is set (the
    # gateway's --allow-raw-logprobs): then it generates and marks its chunks "raw".
    allow_raw_logprobs: bool = False
    # False: the caller reads the completion whole (its client does not stream), so an HTTP
    # backend asks its server for one non-streamed response and yields it as one chunk, rather
    # than parse an event per token. Chunks stay the contract: a backend may ignore this.
    stream: bool = True


def needs_processed_logprobs(params: SamplingParams) -> bool:
    """Whether the distribution sampled from differs from the model's raw one: a temperature
    other than 1 or a top-p below 1, unless the turn is greedy (a temperature below 1e-5,
    ``schemas.sampling``: vLLM then ignores top_p, and greedy's log-probs are the raw ones).

    >>> needs_processed_logprobs(SamplingParams(max_tokens=1, temperature=0.5))
    True
    >>> needs_processed_logprobs(SamplingParams(max_tokens=1, temperature=0.0))
    False
    >>> needs_processed_logprobs(SamplingParams(max_tokens=1, temperature=1e-6, top_p=0.9))
    False
    """
    if is_greedy(params.temperature):
        return False
    return params.temperature != 1.0 or params.top_p < 1.0


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    logprob: float


@dataclass(frozen=True)
class GenerationChunk:
    """One or more newly sampled tokens, in order. The last chunk has ``finish_reason`` set
    ("stop": a stop token was sampled, and is included in ``token_ids``; "length": max_tokens;
    "abort": the server ended the generation unfinished, e.g. paused for a weight update, and the
    tokens so far are all it will send: the gateway continues the turn, ``Generating.tokens``)."""

    token_ids: list[int]
    logprobs: list[float]  # one per token
    top_logprobs: list[list[TopLogprob]] | None = None  # one list per token when asked
    finish_reason: FinishReason | None = None
    weight_version: int | None = None  # policy version that sampled these tokens, if known
    extra: dict[str, float] = field(default_factory=dict)  # backend timings etc.
    replica: str | None = None  # the replica that generated them, when a router chose one
    # Set (on every chunk) by a backend whose log-probs are not those of the distribution sampled
    # from: "raw" (the model's untempered distribution). None: the sampled one's, as promised.
    logprobs_kind: str | None = None
    # Set (on one chunk) by a backend whose server expands a prompt's images itself and
    # expanded them otherwise than the gateway did (vLLM's image path): the prompt the tokens
    # were sampled after, its images where the server placed them. The turn is recorded with
    # it, marked (gateway.serving.generating says how): never the ids the server did not read.
    served_prompt: Prompt | None = None


@runtime_checkable
class Backend(Protocol):
    """An inference server (or in-process model) behind the gateway."""

    @property
    def id(self) -> str:
        """Stable name of this backend replica, recorded in every TurnCompleted."""
        ...

    @property
    def max_context(self) -> int:
        """Longest prompt + completion the model accepts, in tokens."""
        ...

    def generate(
        self, prompt: Prompt, params: SamplingParams, *, session: str | None = None
    ) -> AsyncIterator[GenerationChunk]:
        """Stream the completion of ``prompt``. Raises BackendError (gateway.errors) when
        the backend fails; cancelling the iteration stops the generation. ``session`` is a
        routing hint (replicas keep a session's prefix cached); a single backend ignores it."""
        ...

    async def admit(self, params: SamplingParams) -> str | None:
        """Check, before a turn starts streaming, that this backend can record ``params``'
        sampling as promised: raises InvalidRequest (a 400) when its log-probs would not be
        those of the distribution sampled from (a vLLM replica in its default raw mode asked
        for temperature 0.5) and ``params.allow_raw_logprobs`` is off. Returns the log-prob kind
        its chunks will carry ("raw"), or None for the sampled distribution's."""
        ...

    async def close(self) -> None: ...
