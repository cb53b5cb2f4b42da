"""Models the gateway can serve without downloading anything."""

from __future__ import annotations

from gateway.model.tiny import (
    CHATML_TOOLS_TEMPLATE,
    TINY_MODEL_NAME,
    TINY_MODEL_VERSION,
    ensure_tiny_model,
    tiny_model_dir,
)

__all__ = [
    "CHATML_TOOLS_TEMPLATE",
    "TINY_MODEL_NAME",
    "TINY_MODEL_VERSION",
    "ensure_tiny_model",
    "tiny_model_dir",
]
