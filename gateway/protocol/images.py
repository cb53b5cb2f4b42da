"""The three APIs' image parts (Chat ``image_url``: ``ImagePart``, Anthropic ``image``:
``ImageBlock``, Responses ``input_image``: ``InputImagePart``), and what they share: where the
image comes from, and the checked image the edge keeps on the part.

A request is validated (pydantic), then its image parts are checked (``gateway.images.intake``,
by ``gateway.serving.image_input``: async, a listed remote URL is fetched), then translated into
the canonical conversation (sync). The check keeps its result on the part itself, so the
translation reads it there, with no lookup to keep in step with the walk that found the part.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr

from gateway.images.intake import CheckedImage
from gateway.protocol.wire import free_form_extras

__all__ = [
    "Base64Data",
    "ImageBlock",
    "ImageInput",
    "ImagePart",
    "InputImagePart",
    "URLSource",
    "refused_file_id",
]

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
    """An image part of a request; ``image_source`` says where its bytes are."""

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


# -- Chat Completions ----------------------------------------------------------------------


class ImageURL(BaseModel):
    model_config = ConfigDict(extra="allow", json_schema_extra=free_form_extras)

    url: str = Field(
        description="a data URL (data:image/png;base64,...); http(s) only from a "
        "host the gateway lists"
    )
    detail: Literal["auto", "low", "high"] | None = Field(
        None, description="ignored: the model's image processor decides the resolution"
    )


class ImagePart(ImageInput):
    """An image in a user's or a tool's message (``gateway.images.intake`` checks it)."""

    model_config = ConfigDict(extra="allow", json_schema_extra=free_form_extras)

    type: Literal["image_url"]
    image_url: ImageURL

    @property
    def image_source(self) -> URLSource:
        return URLSource(self.image_url.url)


# -- Anthropic Messages --------------------------------------------------------------------


class Base64Source(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["base64"]
    media_type: str = Field(description="image/png, image/jpeg, image/gif or image/webp")
    data: str = Field(description="the image's bytes, base64")


class URLImageSource(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["url"]
    url: str = Field(description="fetched only from a host the gateway lists; else a 400")


def _known_source(value: Any) -> Any:
    """A ``file`` source (the Files API's) is refused by name: this gateway stores no files."""
    if isinstance(value, dict) and value.get("type") == "file":
        raise ValueError(
            "an image source of type 'file' names an upload of Anthropic's Files API, which "
            "this gateway does not have: send the image as a base64 source"
        )
    return value


class ImageBlock(ImageInput):
    """An image (``cache_control`` and other decorations ignored)."""

    model_config = ConfigDict(extra="allow", json_schema_extra=free_form_extras)

    type: Literal["image"]
    source: Annotated[
        Base64Source | URLImageSource,
        Field(discriminator="type"),
        BeforeValidator(_known_source),
    ]

    @property
    def image_source(self) -> URLSource | Base64Data:
        if isinstance(self.source, Base64Source):
            return Base64Data(self.source.data, self.source.media_type)
        return URLSource(self.source.url)


# -- Responses -----------------------------------------------------------------------------


def refused_file_id(value: Any) -> Any:
    if isinstance(value, dict) and value.get("file_id") is not None:
        raise ValueError(
            "input_image.file_id names an uploaded file: this gateway has no file uploads; send "
            "the image inline as image_url, a data URL (data:image/png;base64,...)"
        )
    return value


class InputImagePart(ImageInput):
    """``input_image``: an image by ``image_url`` (``detail`` is accepted and ignored: the
    model's image processor decides the resolution)."""

    model_config = ConfigDict(extra="allow", json_schema_extra=free_form_extras)

    type: Literal["input_image"]
    image_url: str = Field(
        description="a data URL (data:image/png;base64,...); http(s) only from a host the "
        "gateway lists"
    )
    detail: Literal["auto", "low", "high"] | None = Field(None, description="ignored")
    file_id: None = Field(None, description="not supported: the gateway has no file uploads")

    @property
    def image_source(self) -> URLSource:
        return URLSource(self.image_url)
