"""What the three APIs' image parts share (Chat ``image_url``, Anthropic ``image``, Responses
``input_image``): where the image comes from, and the checked image the edge keeps on the part.

A request is validated (pydantic), then its image parts are checked (``gateway.images.intake``,
by ``gateway.serving.image_input``: async, a listed remote URL is fetched), then translated into
the canonical conversation (sync). The check keeps its result on the part itself, so the
translation reads it there, with no lookup to keep in step with the walk that found the part.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, PrivateAttr

from gateway.images.intake import CheckedImage

__all__ = ["Base64Data", "ImageInput", "URLSource"]

JSON = dict[str, Any]


@dataclass(frozen=True)
class URLSource:
    """An image named by a URL: a data URL, or an http(s) one (fetched only from a listed host)."""

    url: object


@dataclass(frozen=True)
class Base64Data:
    """An image as base64 text and the media type its sender declares (Anthropic's source)."""

    data: object
    media_type: object


class ImageInput(BaseModel):
    """An image part of a request; ``source`` says where its bytes are."""

    _checked: CheckedImage | None = PrivateAttr(None)

    @property
    def image_source(self) -> URLSource | Base64Data:
        raise NotImplementedError

    @property
    def checked(self) -> CheckedImage:
        """The image as the edge checked it (``gateway.serving.image_input.check_images``)."""
        if self._checked is None:  # a translation before the check: a bug of ours, not input
            raise RuntimeError(f"{type(self).__name__} translated before it was checked")
        return self._checked

    def keep(self, image: CheckedImage) -> None:
        self._checked = image

    @property
    def part(self) -> JSON:
        """The canonical conversation's content part (``schemas.images.image_part``)."""
        return self.checked.part
