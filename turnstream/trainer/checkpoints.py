"""The reference trainer's checkpoints: ``from_pretrained`` directories a gateway loads."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import PreTrainedModel

__all__ = ["save_checkpoint"]


def save_checkpoint(model: PreTrainedModel, checkpoint_dir: Path, version: int) -> Path:
    """Write ``model``'s config and weights to ``<checkpoint_dir>/v<version>/`` (``config.json``,
    ``model.safetensors``: a ``from_pretrained`` directory) and return it (absolute). The
    weights appear whole or not at all (temp file, then rename), so a gateway that reads them
    early never loads half a policy."""
    target = (checkpoint_dir / f"v{version}").absolute()
    target.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(target)  # before the weights: they complete the directory
    staging = target / ".model.safetensors.tmp"
    save_file(_one_name_per_tensor(model.state_dict()), str(staging), metadata={"format": "pt"})
    os.replace(staging, target / "model.safetensors")
    return target


def _one_name_per_tensor(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share memory: tied embeddings appear twice in a state
    dict (``model.embed_tokens.weight``, ``lm_head.weight``). Keep the first name, like
    ``save_pretrained``; loaders put it back in both places."""
    seen: set[tuple[int, int]] = set()
    kept: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        key = (tensor.data_ptr(), tensor.numel())
        if key in seen:
            continue
        seen.add(key)
        kept[name] = tensor.detach().contiguous()
    return kept
