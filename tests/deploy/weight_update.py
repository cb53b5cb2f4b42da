"""A trainer's weight update of a running vLLM 0.32 CPU server, for the deploy tests (issue 37).

What changes the weights of a running CPU server. vLLM's weight-transfer engines
(``vllm/distributed/weight_transfer/factory.py``: ``nccl``, ``ipc``, ``sparse_nccl``,
``nccl_m2n``, ``sharded_rdt``, ``modelexpress``) do not run on CPU: ``ipc`` rebuilds tensors from
CUDA IPC handles (``rebuild_cuda_tensor``), the NCCL ones broadcast over ``PyNcclCommunicator``
on CUDA streams, ``sharded_rdt`` needs Ray and NIXL, ``modelexpress`` an external service. What
does run is the worker's ``reload_weights`` (``vllm/v1/worker/gpu_worker.py``, inherited by
``CPUWorker``; ``model_loader/reload/inplace.py``): new weights read in place from a checkpoint
directory, reached with ``VLLM_SERVER_DEV_MODE=1`` as ``POST /collective_rpc {"method":
"reload_weights", "kwargs": {"weights_path": DIR}}`` (``entrypoints/serve/dev/rpc``). A trainer
on GPUs would send the same tensors over NCCL between the same ``/pause`` and ``/resume``.

One thing it does not do (measured, vLLM 0.32): with tied word embeddings (the tiny model's),
a reload updates ``embed_tokens`` but the LM head keeps the old tensor, so the logits come from
the old head. The versions made here (``next_weights``) change every weight but the
embeddings, and the server starts on ``babbling_model``'s embeddings, so what it serves is
exactly the checkpoint.

``babbling_model``: the tiny model never ends its turn. It is random, so nearly uniform over
320 ids, and would draw ``<|im_end|>`` or ``<|endoftext|>`` within ~160 tokens, and its padding
and tool-call ids too. The gateway does not pass vLLM's ``ignore_eos``; instead embedding
dimension 0 is set to +2 for the 256 byte ids and to -2 for every other id: the residual stream
after a byte then leans far along that dimension, and (the embeddings are tied) every non-byte
id's logit falls ~45 nats below the bytes', so a generation runs to ``max_tokens``, one byte a
token.

``VLLMTrainer`` follows the contract between trainer and gateway (gateway/core/versions.py):
pause the server, load the new weights, publish the new version to the policy bucket
(``turnstream.integrations.policy.publish_weight_version_async``), and only then resume.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch
from safetensors.torch import load_file, save_file

from schemas.policy import UpdateMode
from tests.deploy.vllm_server import VLLMServer
from turnstream.integrations.policy import publish_weight_version_async

__all__ = ["CONTEXT", "VLLMTrainer", "babbling_model", "next_weights"]

WEIGHTS = "model.safetensors"
EMBEDDINGS = "model.embed_tokens.weight"
BYTE_IDS = 256  # the tiny tokenizer's ids 0-255 are the bytes; the rest special or padding
LEAN = 2.0  # the byte ids' embedding along dimension 0 (the others' is -LEAN)
NOISE = 0.02  # what each version adds to each weight matrix: the init's own scale
CONTEXT = 8192  # twice the tiny model's: turns long enough to outlast a busy machine's stalls


def babbling_model(base: Path, target: Path) -> Path:
    """``base`` (the tiny model) in ``target``, drawing only byte ids (module docstring), with
    a context of CONTEXT tokens (rotary positions: nothing to learn)."""
    shutil.copytree(base, target)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "max_position_embeddings": CONTEXT}))
    weights = load_file(str(target / WEIGHTS))
    weights[EMBEDDINGS][:BYTE_IDS, 0] = LEAN
    weights[EMBEDDINGS][BYTE_IDS:, 0] = -LEAN
    save_file(weights, str(target / WEIGHTS), metadata={"format": "pt"})
    return target


def next_weights(previous: Path, target: Path, seed: int) -> Path:
    """``previous`` with seeded noise on every weight matrix but the (tied) embeddings, which a
    vLLM reload would only half take (module docstring)."""
    shutil.copytree(previous, target)
    weights = load_file(str(target / WEIGHTS))
    generator = torch.Generator().manual_seed(seed)
    for name, tensor in weights.items():
        if tensor.dim() == 2 and name != EMBEDDINGS:
            tensor += torch.randn(tensor.shape, generator=generator) * NOISE
    save_file(weights, str(target / WEIGHTS), metadata={"format": "pt"})
    return target


@dataclass
class VLLMTrainer:
    """Updates one dev-mode vLLM server's weights and tells the gateways through the log.

    ``weights[v]``: the checkpoint of version ``v`` (0: what the server started on)."""

    server: VLLMServer
    nats_url: str
    run: str
    workdir: Path
    weights: dict[int, Path] = field(default_factory=dict)

    @property
    def version(self) -> int:
        return max(self.weights)

    def update(self, mode: UpdateMode, *, paused: Callable[[], None] = lambda: None) -> int:
        """One weight update in the contract's order: ``/pause?mode=``, load the next version,
        publish it, ``/resume``. ``paused`` runs once the pause returned (a test looks at what
        it left). The new version."""
        version = self.version + 1
        checkpoint = next_weights(
            self.weights[version - 1], self.workdir / f"v{version}", seed=version
        )
        self.pause(mode)
        paused()
        self.load(checkpoint, version)
        asyncio.run(publish_weight_version_async(self.nats_url, self.run, version))
        self.weights[version] = checkpoint
        self.resume()
        return version

    def pause(self, mode: UpdateMode) -> None:
        """``/pause?mode=``: returns once vLLM did it (for "wait": once its requests finished);
        requests sent meanwhile wait in its queue."""
        self._post("/pause", params={"mode": mode}, timeout=300)

    def resume(self) -> None:
        self._post("/resume")

    def load(self, checkpoint: Path, version: int) -> None:
        """The checkpoint's weights into the running server, and vLLM's own version label
        (``GET /weight_info``) to match."""
        loaded = self._post(
            "/collective_rpc",
            json={"method": "reload_weights", "kwargs": {"weights_path": str(checkpoint)}},
        )
        assert loaded == {"results": [None]}, loaded
        self._post("/update_weight_version", json={"new_version": str(version)})

    def _post(
        self,
        path: str,
        *,
        params: dict[str, str] | None = None,
        json: object = None,
        timeout: float = 60,
    ) -> object:
        reply = httpx.post(f"{self.server.url}{path}", params=params, json=json, timeout=timeout)
        assert reply.status_code == 200, f"POST {path}: {reply.status_code} {reply.text}"
        return reply.json() if reply.content else None
