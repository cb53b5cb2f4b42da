"""A sink batch as verl's ``DataProto`` (DESIGN §7). verl is imported only when called.

``to_dataproto(batch)`` puts the tensors in ``DataProto.batch`` and each non-tensor entry in
``non_tensor_batch`` as a numpy object array (one value per sample), as verl's own rollout
does (``uid``, and ``session_uid``, which ``trainer_sink.sessions`` reads for GRPO per session:
docs/verl.md); ``__num_turns__`` becomes ``np.int32``, as verl's agent loop writes it.
``multi_modal_inputs`` becomes an ``np.ndarray`` of dicts (``dtype=object``, one dict of
tensors per sample, ``{}`` without images), what verl's agent loop builds and its engine's
``extract_multi_modal_inputs`` joins. It builds the
``DataProto`` from its fields rather than with ``DataProto.from_tensordict``: that method exists
only from verl 0.5 and needs tensordict >= 0.10, and it turns a non-tensor entry whose values
tensordict 0.8 collapsed into one (a batch that was indexed) into ``meta_info``.

The padded layout only: verl's ``DataProto`` holds padded tensors. A jagged batch goes to verl's
no-padding engine as the TensorDict itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from trainer_sink.assembly import non_tensor_values
from trainer_sink.errors import BatchError

if TYPE_CHECKING:
    from trainer_sink.sink import Batch

__all__ = ["to_dataproto"]

_DTYPES: dict[str, type[np.generic]] = {"__num_turns__": np.int32}


def to_dataproto(batch: Batch | TensorDict, meta_info: dict[str, Any] | None = None) -> Any:
    """verl's ``DataProto`` of ``batch`` (a sink ``Batch`` or its ``tensors``)."""
    try:
        from verl import DataProto
    except ImportError as exc:
        raise ImportError(
            f"to_dataproto needs verl, which is not importable here ({exc}); install it beside "
            f"turnstream: pip install 'turnstream[verl]'"
        ) from exc
    tensors = batch if isinstance(batch, TensorDict) else batch.tensors
    dense: dict[str, torch.Tensor] = {}
    non_tensor: dict[str, np.ndarray[Any, Any]] = {}
    for key in tensors.keys():  # noqa: SIM118  # TensorDict iteration is over keys, typed as such
        assert isinstance(key, str)  # a flat batch: no nested keys
        entry = tensors.get(key)
        if isinstance(entry, NonTensorStack | NonTensorData):
            values = non_tensor_values(tensors, key)
            array = np.empty(len(values), dtype=object)
            array[:] = values  # element-wise: a list of dicts or lists stays one object each
            dtype = _DTYPES.get(key)
            non_tensor[key] = array if dtype is None else array.astype(dtype)
        elif isinstance(entry, torch.Tensor):
            if entry.is_nested:
                raise BatchError(
                    f"to_dataproto needs the padded layout, but {key!r} is jagged; assemble "
                    f"with AssemblySettings(layout='padded'), or give verl's no-padding engine "
                    f"the TensorDict itself"
                )
            dense[key] = entry
        else:
            raise BatchError(f"to_dataproto: entry {key!r} is a {type(entry).__name__}")
    return DataProto(
        batch=TensorDict(dense, batch_size=tensors.batch_size),
        non_tensor_batch=non_tensor,
        meta_info=dict(meta_info or {}),
    )
