"""Images at the gateway: checked at the edge, expanded in the prompt as the model expands them."""

from __future__ import annotations

from gateway.images.vision import VisionSpec

__all__ = ["VisionSpec"]
