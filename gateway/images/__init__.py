"""Images at the gateway: the edge that turns a client's image into checked bytes
(``intake``), its limits (``limits``), and remote URLs (``fetching``: refused unless listed);
their placeholders in the prompt, expanded as the model expands them (``vision``)."""

from __future__ import annotations

from gateway.images.intake import (
    CheckedImage,
    check_image,
    check_image_count,
    image_from_base64,
    image_from_data_url,
    image_from_url,
)
from gateway.images.limits import (
    ACCEPTED_MEDIA_TYPES,
    DEFAULT_FETCH_TIMEOUT_S,
    DEFAULT_MAX_IMAGE_BYTES,
    DEFAULT_MAX_IMAGE_PIXELS,
    DEFAULT_MAX_IMAGES,
    ImageLimits,
    parse_host_rule,
)
from gateway.images.vision import VisionSpec

__all__ = [
    "ACCEPTED_MEDIA_TYPES",
    "DEFAULT_FETCH_TIMEOUT_S",
    "DEFAULT_MAX_IMAGES",
    "DEFAULT_MAX_IMAGE_BYTES",
    "DEFAULT_MAX_IMAGE_PIXELS",
    "CheckedImage",
    "ImageLimits",
    "VisionSpec",
    "check_image",
    "check_image_count",
    "image_from_base64",
    "image_from_data_url",
    "image_from_url",
    "parse_host_rule",
]
