"""Loading a checkpoint into a copy of a running model (the local backend's ``load_weights``):
the state dict of a ``.safetensors`` file or a ``save_pretrained`` directory, its keys named as
the model's modules are, checked against the model before anything is swapped."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import PreTrainedModel

__all__ = ["model_with_weights", "read_checkpoint"]


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


def model_with_weights(current: PreTrainedModel, checkpoint: Path) -> PreTrainedModel:
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
