"""The ``local`` backend: a Hugging Face causal LM run in this process with torch (DESIGN §4).

Each generation is a decode loop on a worker thread (never on the event loop): one prefill of
the prompt, then one token per forward pass against its own KV cache, under
``torch.inference_mode``. Tokens come back to the event loop one chunk each through an
``asyncio.Queue`` fed with ``call_soon_threadsafe``. Several sessions decode concurrently, one
thread each, up to ``max_concurrency``; the rest wait their turn.

``load_weights`` builds a new model beside the old one and swaps the reference (the price is a
second copy of the weights while a load is in progress). What becomes of the generations in flight
is the update's ``mode`` (``schemas.policy``), as vLLM's ``/pause?mode=`` decides it for its own:
"wait" (the default), they finish on the weights they started with; "abort", each ends at its next
token with ``finish_reason`` "abort" (the gateway continues it, DESIGN §4) and new generations
wait until the new weights are in; "keep", each goes on with the new weights from its next token
(its prompt and tokens so far read again by them). Every chunk reports the version of the
weights that sampled it.

A vision-language model (a config with a ``vision_config``: Qwen2-VL) also takes prompts with
images (``local_vision``): the prefill reads the images' pixels, and every forward pass of such a
generation gets its M-RoPE positions explicitly. Text prompts run the text path, as on a
causal LM.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import json
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    DynamicCache,
    PreTrainedModel,
)

from gateway.backends.interface import FinishReason, GenerationChunk, Prompt, SamplingParams
from gateway.backends.local_vision import ImagePrompt, VisionReader, is_vision_config
from gateway.backends.sampler import sample_token
from gateway.errors import BackendError, BackendUnavailable, ContextLengthExceeded, InvalidRequest
from schemas.policy import UpdateMode

__all__ = ["LocalBackend", "kv_cache", "read_checkpoint"]


def kv_cache(model: PreTrainedModel) -> dict[str, object]:
    """The keyword arguments that give ``model``'s forward a fresh key/value cache, which each
    call then extends in place: ``cache=`` where the forward takes it (transformers 5.2x renamed
    ``past_key_values``, warns on its first use and drops it in 5.40), else ``past_key_values=``."""
    parameters = inspect.signature(model.forward).parameters
    name = "cache" if "cache" in parameters else "past_key_values"
    return {name: DynamicCache(config=model.config), "use_cache": True}


@dataclass(frozen=True)
class _Policy:
    """A model and the weight version it holds; replaced whole, never mutated."""

    model: PreTrainedModel
    version: int


def read_checkpoint(checkpoint: Path, device: torch.device) -> dict[str, torch.Tensor]:
    """The state dict in a ``.safetensors`` file, or in a directory holding ``model.safetensors``
    or a sharded ``model.safetensors.index.json`` (what ``save_pretrained`` writes)."""
    if checkpoint.is_file():
        return load_file(checkpoint, device=str(device))
    single = checkpoint / "model.safetensors"
    if single.is_file():
        return load_file(single, device=str(device))
    index = checkpoint / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        state: dict[str, torch.Tensor] = {}
        for shard in shards:
            state.update(load_file(checkpoint / shard, device=str(device)))
        return state
    raise FileNotFoundError(
        f"{checkpoint} is neither a .safetensors file nor a directory with model.safetensors "
        "or model.safetensors.index.json"
    )


class _WorkerEnded:
    """Marks the end of a worker, in the chunk queue."""


_WORKER_ENDED = _WorkerEnded()


@dataclass(eq=False)  # hashed by identity: the backend keeps a set of the running ones
class _Job:
    """One generation's link between its worker thread and its async consumer."""

    policy: _Policy
    prompt_ids: list[int]
    params: SamplingParams
    emit: Callable[[GenerationChunk | BaseException | _WorkerEnded], None]
    cancelled: threading.Event
    submitted_at: float
    images: ImagePrompt | None = None  # the prompt's images (None: a text prompt)
    aborted: threading.Event = field(default_factory=threading.Event)  # a load in mode "abort"
    switch_to: _Policy | None = None  # a load in mode "keep": the weights from the next token


class LocalBackend:
    """A causal LM in this process, behind the ``Backend`` protocol. Sees only token ids."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        backend_id: str = "local-0",
        max_context: int | None = None,
        eos_token_ids: Sequence[int] | None = None,
        max_concurrency: int = 4,
        weight_version: int = 0,
        vision: VisionReader | None = None,
    ) -> None:
        """``vision``: the image reader of a vision-language ``model`` (None: it takes no
        images)."""
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be at least 1, not {max_concurrency}")
        model.train(False)
        self._id = backend_id
        self._policy = _Policy(model, weight_version)
        self._vision = vision
        text_config = model.config.get_text_config()  # a vision model's language half
        self._max_context = max_context or int(text_config.max_position_embeddings)
        self._vocab_size = int(text_config.vocab_size)
        self._eos_token_ids = frozenset(
            _model_eos_ids(model) if eos_token_ids is None else eos_token_ids
        )
        self._executor = ThreadPoolExecutor(
            max_workers=max_concurrency, thread_name_prefix=f"{backend_id}-decode"
        )
        # Loads are serialized so versions land in the order they were asked for.
        self._load_lock = asyncio.Lock()
        self._counter_lock = threading.Lock()
        self._decode_steps = 0
        self._running: set[_Job] = set()  # the generations started and not yet finished
        # Cleared while a load in mode "abort" is in progress: new generations wait for it.
        self._accepting = asyncio.Event()
        self._accepting.set()
        self._closed = False

    @classmethod
    def load(
        cls,
        path: Path,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        max_concurrency: int = 4,
        backend_id: str = "local-0",
        max_context: int | None = None,
        weight_version: int = 0,
    ) -> LocalBackend:
        """Load a Hugging Face model directory with ``from_pretrained``: a causal LM, or a
        vision-language model with its image processor. Blocks: call it at startup, or through
        ``asyncio.to_thread``."""
        vision = is_vision_config(AutoConfig.from_pretrained(path))
        auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
        model: PreTrainedModel = auto.from_pretrained(path, dtype=dtype)
        # nn.Module.to moves in place; PreTrainedModel.to's decorated signature confuses mypy,
        # and device_map= would need accelerate.
        torch.nn.Module.to(model, torch.device(device))
        return cls(
            model,
            backend_id=backend_id,
            max_context=max_context,
            max_concurrency=max_concurrency,
            weight_version=weight_version,
            vision=VisionReader.load(path, model, backend_id) if vision else None,
        )

    @property
    def id(self) -> str:
        return self._id

    @property
    def max_context(self) -> int:
        return self._max_context

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self._policy.model.parameters())

    @property
    def weight_version(self) -> int:
        """The version new generations start on (in-flight ones may still be on an older one)."""
        return self._policy.version

    @property
    def in_flight(self) -> int:
        """Generations started and not yet finished, queued ones included (a load measure)."""
        return len(self._running)

    @property
    def accepting(self) -> bool:
        """False while a load in mode "abort" holds new generations back."""
        return self._accepting.is_set()

    @property
    def decode_steps(self) -> int:
        """Forward passes run so far, all generations together."""
        return self._decode_steps

    async def generate(
        self, prompt: Prompt, params: SamplingParams, *, session: str | None = None
    ) -> AsyncIterator[GenerationChunk]:
        prompt_ids = prompt.tolist()
        self._check_request(prompt_ids, params)
        images = await self._read_images(prompt) if prompt.images else None
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue[GenerationChunk | BaseException | _WorkerEnded] = asyncio.Queue()
        cancelled = threading.Event()

        def emit(item: GenerationChunk | BaseException | _WorkerEnded) -> None:
            try:
                loop.call_soon_threadsafe(chunks.put_nowait, item)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                cancelled.set()

        submitted = time.perf_counter()
        await self._accepting.wait()  # a load aborting generations: its weights come first
        job = _Job(self._policy, prompt_ids, params, emit, cancelled, submitted, images)
        self._running.add(job)
        try:
            try:
                worker = loop.run_in_executor(self._executor, self._decode, job)
            except RuntimeError as exc:  # the executor was shut down by close()
                raise BackendUnavailable(f"backend {self._id} is closed") from exc
            # Queued after the worker's last chunk (both travel through the loop's FIFO), so it
            # is only read when the worker stopped without finishing: close() cancelled it.
            worker.add_done_callback(lambda _: chunks.put_nowait(_WORKER_ENDED))
            while True:
                item = await chunks.get()
                if isinstance(item, _WorkerEnded):
                    raise BackendUnavailable(
                        f"backend {self._id} was closed before the generation finished"
                    )
                if isinstance(item, BaseException):
                    raise BackendError(
                        f"backend {self._id} failed while generating "
                        f"(prompt of {len(job.prompt_ids)} tokens): {item!r}"
                    ) from item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            # Reached on completion, on error, and when the consumer stops iterating (client
            # gone, task cancelled): the worker sees the flag before its next forward pass.
            cancelled.set()
            self._running.discard(job)

    async def load_weights(
        self, checkpoint: Path | None, version: int, mode: UpdateMode = "wait"
    ) -> None:
        """Make the weights in ``checkpoint`` (see ``read_checkpoint``) the policy of every
        generation that starts from now on, as ``version``; ``mode`` decides for the ones
        running (the module's docstring). Raises BackendError if the checkpoint does not fit
        the model, or if there is none (the trainer updated inference servers of its own); the
        current weights then stay (aborted generations were aborted all the same, as a vLLM
        paused with mode=abort whose update then fails)."""
        if checkpoint is None:
            # Taking the version without the weights would record turns of these weights as
            # that version's: a trainer checking its log-probs against them would be misled.
            raise BackendError(
                f"backend {self._id} got weight_version {version} without a checkpoint: that "
                f"entry comes from a trainer that updates inference servers of its own (e.g. "
                f"verl through publish_weight_version), and this local model is not one of "
                f"them; still serving weight_version {self._policy.version}. Put such a "
                f"gateway in front of that trainer's servers (--backend vllm or sglang), or "
                f"publish checkpoints for the local backend to load"
            )
        async with self._load_lock:
            current = self._policy
            if mode == "abort":
                self._accepting.clear()
                for job in list(self._running):
                    job.aborted.set()
            try:
                model = await asyncio.to_thread(_model_with_weights, current.model, checkpoint)
            except Exception as exc:
                self._accepting.set()  # the old weights serve on
                raise BackendError(
                    f"backend {self._id} could not load checkpoint {checkpoint} as "
                    f"weight_version {version}; still serving weight_version "
                    f"{current.version}: {exc}"
                ) from exc
            self._policy = policy = _Policy(model, version)
            self._accepting.set()
            if mode == "keep":
                for job in list(self._running):
                    job.switch_to = policy

    async def admit(self, params: SamplingParams) -> str | None:
        return None  # it samples and records the same distribution, whatever the sampling

    async def close(self) -> None:
        self._closed = True
        for job in list(self._running):
            job.cancelled.set()
        # Workers stop within one forward pass; waiting for them must not block the loop.
        await asyncio.to_thread(self._executor.shutdown, wait=True, cancel_futures=True)

    async def _read_images(self, prompt: Prompt) -> ImagePrompt:
        if self._vision is None:
            raise InvalidRequest(
                f"the model of backend {self._id} takes no images: it is a text model (its "
                f"config has no vision_config); send text only, or serve a vision-language model"
            )
        return await asyncio.to_thread(self._vision.read, prompt, self._policy.model)

    def _check_request(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        if self._closed:
            raise BackendUnavailable(f"backend {self._id} is closed")
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty: a generation needs at least one token")
        if params.max_tokens < 1:
            raise InvalidRequest(
                f"max_tokens must be at least 1, not {params.max_tokens}", param="max_tokens"
            )
        if params.temperature < 0:
            raise InvalidRequest(
                f"temperature must not be negative, not {params.temperature}", param="temperature"
            )
        if not 0 < params.top_p <= 1:
            raise InvalidRequest(f"top_p must be in (0, 1], not {params.top_p}", param="top_p")
        if params.top_logprobs < 0:
            raise InvalidRequest(
                f"top_logprobs must not be negative, not {params.top_logprobs}",
                param="top_logprobs",
            )
        total = len(prompt_ids) + params.max_tokens
        if total > self._max_context:
            raise ContextLengthExceeded(
                f"the prompt ({len(prompt_ids)} tokens) plus max_tokens ({params.max_tokens}) "
                f"is {total} tokens, over the context length of {self._max_context} of backend "
                f"{self._id}; shorten the conversation or lower max_tokens"
            )
        bad = next((t for t in prompt_ids if not 0 <= t < self._vocab_size), None)
        if bad is not None:
            raise InvalidRequest(
                f"token id {bad} is outside the vocabulary of backend {self._id} "
                f"(0..{self._vocab_size - 1})"
            )

    def _decode(self, job: _Job) -> None:
        """The worker thread's loop. Every outcome, errors included, goes through ``emit``."""
        try:
            with torch.inference_mode():
                self._decode_loop(job)
        except Exception as exc:
            job.emit(exc)

    def _decode_loop(self, job: _Job) -> None:
        started = time.perf_counter()
        policy, params = job.policy, job.params
        model = policy.model
        device = model.device
        generator = torch.Generator(device=device)
        # A request without a seed still gets its own generator: sharing the global one across
        # threads would make seeded requests depend on what else is running.
        generator.manual_seed(params.seed if params.seed is not None else secrets.randbits(63))
        stops = self._eos_token_ids | frozenset(params.stop_token_ids)
        input_ids = torch.tensor([job.prompt_ids], dtype=torch.long, device=device)
        cache = kv_cache(model)
        images = job.images
        inputs: dict[str, object] = {} if images is None else images.prefill()
        prefill_s = 0.0
        generated: list[int] = []
        for step in range(params.max_tokens):
            if job.cancelled.is_set():
                return
            if job.aborted.is_set():  # a load in mode "abort": the gateway continues the turn
                job.emit(self._aborted_chunk(policy, params))
                return
            switch = job.switch_to
            if switch is not None and switch is not policy:  # a load in mode "keep"
                policy, model = switch, switch.model
                cache = kv_cache(model)  # the new weights read the prompt and tokens so far
                if images is None:
                    input_ids = torch.tensor(
                        [job.prompt_ids + generated], dtype=torch.long, device=device
                    )
                elif generated:
                    # The prompt with its pixels, then the tokens so far: read in one pass, a
                    # sampled image token would take an image's place.
                    prompt = torch.tensor([job.prompt_ids], dtype=torch.long, device=device)
                    model(input_ids=prompt, **cache, **images.prefill(), logits_to_keep=1)
                    input_ids = torch.tensor([generated], dtype=torch.long, device=device)
                    inputs = images.after(len(job.prompt_ids), len(generated))
                else:
                    inputs = images.prefill()
            output = model(input_ids=input_ids, **cache, **inputs, logits_to_keep=1)
            with self._counter_lock:
                self._decode_steps += 1
            sampled = sample_token(output.logits[0, -1].float(), params, generator)
            finish: FinishReason | None = None
            if sampled.token_id in stops:
                finish = "stop"
            elif step == params.max_tokens - 1:
                finish = "length"
            if step == 0:
                prefill_s = time.perf_counter() - started
            extra: dict[str, float] = {}
            if finish is not None:
                extra = {
                    "queue_s": started - job.submitted_at,
                    "prefill_s": prefill_s,
                    "decode_s": time.perf_counter() - started - prefill_s,
                }
            job.emit(
                GenerationChunk(
                    token_ids=[sampled.token_id],
                    logprobs=[sampled.logprob],
                    top_logprobs=None if sampled.top_logprobs is None else [sampled.top_logprobs],
                    finish_reason=finish,
                    weight_version=policy.version,
                    extra=extra,
                )
            )
            if finish is not None:
                return
            generated.append(sampled.token_id)
            input_ids = torch.tensor([[sampled.token_id]], dtype=torch.long, device=device)
            if images is not None:
                inputs = images.after(len(job.prompt_ids) + step)

    @staticmethod
    def _aborted_chunk(policy: _Policy, params: SamplingParams) -> GenerationChunk:
        return GenerationChunk(
            token_ids=[],
            logprobs=[],
            top_logprobs=[] if params.top_logprobs > 0 else None,
            finish_reason="abort",
            weight_version=policy.version,
        )


def _model_eos_ids(model: PreTrainedModel) -> list[int]:
    """End-of-turn ids: the generation config's (a chat model's ``<|im_end|>`` lives there),
    else the model config's."""
    eos = model.generation_config.eos_token_id if model.generation_config is not None else None
    if eos is None:
        eos = model.config.eos_token_id
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]


def _model_with_weights(current: PreTrainedModel, checkpoint: Path) -> PreTrainedModel:
    """A copy of ``current`` holding the weights in ``checkpoint``; ``current`` is untouched,
    so generations running on it are not disturbed. Runs on a worker thread."""
    state = read_checkpoint(Path(checkpoint), current.device)
    expected = current.state_dict()
    if state.keys() - expected.keys():
        state = _checkpoint_names_to_module_names(current, state)
    unexpected = sorted(state.keys() - expected.keys())
    aliases = _aliases(expected)
    missing = sorted(k for k in expected.keys() - state.keys() if not aliases[k] & state.keys())
    wrong_shape = sorted(
        f"{k} {tuple(state[k].shape)} != {tuple(expected[k].shape)}"
        for k in state.keys() & expected.keys()
        if state[k].shape != expected[k].shape
    )
    if unexpected or missing or wrong_shape:
        raise ValueError(
            "checkpoint does not match the model: "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}, wrong shape {wrong_shape[:5]}"
        )
    model = copy.deepcopy(current)
    # copy_ into the existing parameters keeps tied weights tied and casts to the model's dtype.
    model.load_state_dict(state, strict=False)
    model.train(False)
    return model


def _checkpoint_names_to_module_names(
    model: PreTrainedModel, state: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``state`` with its keys renamed as ``from_pretrained`` renames a checkpoint's: transformers
    5 lays some models out differently from their checkpoints (Qwen2-VL's language model moved
    under ``model.language_model``) and ``save_pretrained`` writes the checkpoint's names back.
    Renamings only (no tensor is split or merged)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
    return {rename_source_key(key, renamings, [])[0]: value for key, value in state.items()}


def _aliases(state: dict[str, torch.Tensor]) -> dict[str, frozenset[str]]:
    """For each key, every key naming the same storage: tied weights (``lm_head.weight`` and
    ``model.embed_tokens.weight`` of tied embeddings) appear twice in a module's state dict,
    while a checkpoint holds them once."""
    by_storage: dict[tuple[int, int], set[str]] = {}
    for key, tensor in state.items():
        by_storage.setdefault((tensor.data_ptr(), tensor.numel()), set()).add(key)
    return {key: frozenset(keys) for keys in by_storage.values() for key in keys}
