"""Models the gateway can serve without downloading anything."""

from __future__ import annotations

from gateway.model.tiny import (
    CHATML_TOOLS_TEMPLATE,
    TINY_MODEL_NAME,
    TINY_MODEL_VERSION,
    ensure_tiny_model,
    tiny_model_dir,
)
from gateway.model.tiny_vl import (
    TINY_VL_MODEL_NAME,
    TINY_VL_MODEL_VERSION,
    ensure_tiny_vl_model,
    tiny_vl_model_dir,
)

__all__ = [
    "CHATML_TOOLS_TEMPLATE",
    "TINY_MODEL_NAME",
    "TINY_MODEL_VERSION",
    "TINY_VL_MODEL_NAME",
    "TINY_VL_MODEL_VERSION",
    "ensure_tiny_model",
    "ensure_tiny_vl_model",
    "tiny_model_dir",
    "tiny_vl_model_dir",
]
