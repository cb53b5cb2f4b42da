"""The image edge: a client's image (a data URL, a base64 string and its media type, or a remote
URL) becomes checked bytes, or a 400 naming the part and what to do.

Nothing a client sends as an image reaches the conversation, the log or a backend unchecked:

- **decoded strictly**: a data URL must read ``data:<image type>[;name=value]...;base64,<data>``;
  base64 may be split by whitespace (clients wrap it at 76 columns), may use the URL-safe
  alphabet or leave its padding off, never mix alphabets or hold anything else;
- **sized before it is decoded**: the byte limit is checked on the encoded length first, so a
  1 GB string is refused without a pass over it;
- **an image, whole, of an accepted format** (PNG, JPEG, GIF, WebP), read by Pillow with only
  those formats' parsers: its size is read from its header and checked against the pixel limit
  *before* a pixel is decoded (what stops a decompression bomb: a 20000x20000 one-colour PNG is
  a few KB on disk and 1.2 GB in memory), then its chunks are verified (a PNG cut before its
  end chunk decodes without complaint) and its pixels fully decoded (a cut JPEG fails there);
- **declared truthfully**: a declared media type must be the format the bytes are, else a 400
  that says which type to declare (Anthropic's API refuses it too: a mislabelled image is a
  client's bug, and the media type recorded must be true). ``image/jpg`` is taken for
  ``image/jpeg``. A remote server's Content-Type is no client's declaration: ignored.
- **remote URLs refused** unless the operator lists the host (``fetching``); other schemes
  (file:, ftp:, ...) always.

An animated GIF, WebP or PNG is taken as its first frame (what an image processor reads of it),
and only that frame is decoded here. Pillow's process-wide settings (``Image.MAX_IMAGE_PIXELS``,
``ImageFile.LOAD_TRUNCATED_IMAGES``) are never changed: the limits travel in ``ImageLimits``.
Pillow's own bomb check (an error past twice ``MAX_IMAGE_PIXELS``, a warning past it: an
error where warnings are errors) is a refusal like ours.

Checking is CPU work (~15 ms for a 1.3 MB 1280x720 PNG): an async caller with large images may
run the synchronous functions in a thread; they touch no shared state.

>>> import base64, io
>>> from PIL import Image, UnidentifiedImageError
>>> png = io.BytesIO()
>>> Image.new("RGB", (3, 2), "red").save(png, "PNG")
>>> url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
>>> image = image_from_data_url(url, where="messages[0].content[1]", limits=ImageLimits())
>>> image.mime, image.width, image.height, image.part["image"] == "sha256:" + image.digest
('image/png', 3, 2, True)
"""

from __future__ import annotations

import binascii
import io
from dataclasses import dataclass, field
from typing import Any

import httpx
from PIL import Image, UnidentifiedImageError

from gateway.errors import InvalidRequest
from gateway.images.fetching import fetch_image, fetchable_url
from gateway.images.limits import (
    ACCEPTED_MEDIA_TYPES,
    DATA_URL,
    SETTING,
    ImageLimits,
    over_bytes,
    refusal,
    shown,
)
from schemas.images import content_digest, image_part, sniff_mime

__all__ = [
    "CheckedImage",
    "check_image",
    "check_image_count",
    "image_from_base64",
    "image_from_data_url",
    "image_from_url",
]

# Pillow's format name -> the media type recorded. MPO (a phone camera's JPEG with more
# pictures appended) is what Pillow's JPEG reader names such a file: its first picture a JPEG.
_MEDIA_TYPES = {
    "PNG": "image/png",
    "JPEG": "image/jpeg",
    "MPO": "image/jpeg",
    "GIF": "image/gif",
    "WEBP": "image/webp",
}
_DECLARED = {**{t: t for t in ACCEPTED_MEDIA_TYPES}, "image/jpg": "image/jpeg"}
_FORMATS = ("PNG", "JPEG", "GIF", "WEBP")  # the only parsers Pillow runs on a client's bytes
_ACCEPTED = ", ".join(ACCEPTED_MEDIA_TYPES)
_MAX_HEAD = 256  # characters between "data:" and the comma: a media type, a few parameters
_URLSAFE = str.maketrans("-_", "+/")


@dataclass(frozen=True)
class CheckedImage:
    """An image that passed the edge: its bytes exactly as the client sent them, named by their
    SHA-256 (``schemas.images``), their real media type and their size in pixels."""

    digest: str
    data: bytes = field(repr=False)
    mime: str
    width: int
    height: int

    @property
    def part(self) -> dict[str, Any]:
        """The canonical conversation's content part for this image."""
        return image_part(self.digest, self.width, self.height)


def check_image_count(count: int, *, where: str, limits: ImageLimits) -> None:
    """Refuse a request with more images than allowed; call it before decoding any."""
    if count > limits.max_images:
        raise refusal(
            where,
            f"{count} images in one request, over the limit of {limits.max_images} "
            f"(the gateway's {SETTING['images']}): send fewer, or raise the limit",
        )


def image_from_data_url(url: object, *, where: str, limits: ImageLimits) -> CheckedImage:
    """``data:image/png;base64,...`` -> a ``CheckedImage``, or a 400 (RFC 2397, base64 only)."""
    if not isinstance(url, str):
        raise refusal(where, f"the image URL must be a string, not {type(url).__name__}")
    comma = url.find(",", 0, 5 + _MAX_HEAD)
    if url[:5].lower() != "data:" or comma < 0:
        raise refusal(where, f"{shown(url)} is not a data URL: send {DATA_URL}")
    media_type, *params = url[5:comma].split(";")
    if not params or params[-1].lower() != "base64":
        raise refusal(
            where, f"the data URL {shown(url[: comma + 1])} is not base64: send {DATA_URL}"
        )
    if any(param.count("=") != 1 for param in params[:-1]):
        raise refusal(where, f"the data URL's head {shown(url[:comma])} is malformed: {DATA_URL}")
    _declared(media_type, where=where)  # refused before the base64 is decoded
    data = _base64_bytes(url[comma + 1 :], where=where, limits=limits)
    return check_image(data, where=where, limits=limits, declared=media_type)


def image_from_base64(
    data: object, media_type: object, *, where: str, limits: ImageLimits
) -> CheckedImage:
    """An Anthropic ``{"type": "base64", "media_type": ..., "data": ...}`` source's fields (or
    any base64 string and its declared media type) -> a ``CheckedImage``, or a 400."""
    _declared(media_type, where=where)  # refused before the base64 is decoded
    if not isinstance(data, str):
        raise refusal(where, f"the image data must be a base64 string, not {type(data).__name__}")
    decoded = _base64_bytes(data, where=where, limits=limits)
    return check_image(decoded, where=where, limits=limits, declared=str(media_type))


async def image_from_url(
    url: object, *, where: str, limits: ImageLimits, client: httpx.AsyncClient | None = None
) -> CheckedImage:
    """An image URL as the OpenAI APIs carry it (Chat ``image_url.url``, Responses
    ``input_image.image_url``), or an Anthropic ``url`` source's -> a ``CheckedImage``, or a
    400: a data URL is decoded; an http(s) URL fetched only from a listed host (``fetching``;
    ``client``: the one to fetch with, None: one for this fetch); any other scheme refused."""
    if not isinstance(url, str):
        raise refusal(where, f"the image URL must be a string, not {type(url).__name__}")
    if url[:5].lower() == "data:":
        return image_from_data_url(url, where=where, limits=limits)
    target = fetchable_url(url, where=where, limits=limits)
    data = await fetch_image(target, where=where, limits=limits, client=client)
    return check_image(data, where=where, limits=limits)


def _base64_bytes(text: str, *, where: str, limits: ImageLimits) -> bytes:
    """Base64 text -> bytes, its size checked on the text before it is decoded."""
    # A bound that needs no pass over the text: the base64 of the byte limit, plus an eighth
    # for the whitespace clients wrap it with (a line break every 76 columns is 1/38 more).
    encoded_max = (limits.max_bytes + 2) // 3 * 4
    if len(text) > encoded_max + encoded_max // 8 + 64:
        raise refusal(
            where,
            f"the image's base64 is {len(text):,} characters, more than the base64 of "
            f"{limits.max_bytes:,} bytes, the limit per image (the gateway's {SETTING['bytes']}): "
            f"send a smaller image (scaled down, or JPEG/WebP), or raise the limit",
        )
    if not text.isascii():
        raise refusal(where, "the image's base64 holds a non-ASCII character: send plain base64")
    compact = "".join(text.split())  # the whitespace base64 may be wrapped with, gone
    size = len(compact) * 3 // 4 - compact.endswith("=") - compact.endswith("==")
    if size > limits.max_bytes:
        raise refusal(where, over_bytes(size, limits))
    if not compact:
        raise refusal(where, "the image's base64 is empty: send the base64 of its bytes")
    if ("-" in compact or "_" in compact) and not ("+" in compact or "/" in compact):
        compact = compact.translate(_URLSAFE)  # the URL-safe alphabet, throughout: taken
    compact += "=" * (-len(compact) % 4)  # padding left off: taken (a length of 4n+1 fails)
    try:
        return binascii.a2b_base64(compact, strict_mode=True)
    except binascii.Error as exc:
        raise refusal(
            where, f"the image is not valid base64 ({exc}): send the standard base64 of its bytes"
        ) from None


def _declared(media_type: object, *, where: str) -> str:
    """A client's declared media type, if accepted."""
    if not isinstance(media_type, str):
        raise refusal(where, f"the image's media type must be a string, one of {_ACCEPTED}")
    mime = _DECLARED.get(media_type.strip().lower())
    if mime is None:
        svg = " (SVG is not: send it rendered as PNG)" if "svg" in media_type.lower() else ""
        raise refusal(
            where, f"media type {shown(media_type)} is not accepted: images are {_ACCEPTED}{svg}"
        )
    return mime


def check_image(
    data: bytes, *, where: str, limits: ImageLimits, declared: str | None = None
) -> CheckedImage:
    """Bytes -> a ``CheckedImage``, or a 400: an accepted format (and the ``declared`` media
    type's, if given), within the byte and pixel limits, whole (module docstring)."""
    if len(data) > limits.max_bytes:
        raise refusal(where, over_bytes(len(data), limits))
    if not data:
        raise refusal(where, "the image is empty (0 bytes)")
    kind = "image"
    # Any exception out of Pillow here is the client's bytes' doing: its parsers raise OSError,
    # SyntaxError, ValueError, struct.error, EOFError, ... on broken input. None may be a 500.
    try:
        with Image.open(io.BytesIO(data), formats=_FORMATS) as image:
            kind, (width, height) = str(image.format), image.size
            if width * height > limits.max_pixels or width < 1 or height < 1:
                raise refusal(
                    where,
                    f"the image is {width}x{height} = {width * height:,} pixels; "
                    f"{_pixels_hint(limits)}",
                )
            mime = _true_type(kind, declared, where=where)
            image.verify()  # chunk structure and CRCs: a PNG cut before its end chunk
        with Image.open(io.BytesIO(data), formats=_FORMATS) as image:
            image.load()  # every pixel of the first frame: a cut JPEG, a short IDAT
    except InvalidRequest:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise refusal(
            where, f"the image is a decompression bomb ({exc}); {_pixels_hint(limits)}"
        ) from None
    except UnidentifiedImageError:
        raise refusal(
            where, f"the bytes are not a PNG, JPEG, GIF or WebP image ({_sniffed(data)})"
        ) from None
    except Exception as exc:
        raise refusal(
            where,
            f"the {kind} is damaged or truncated ({type(exc).__name__}: {str(exc)[:200]}): "
            f"send the whole file",
        ) from None
    return CheckedImage(content_digest(data), data, mime, width, height)


def _true_type(kind: str, declared: str | None, *, where: str) -> str:
    """The media type of Pillow's format ``kind``, if the client declared that one (or none)."""
    mime = _MEDIA_TYPES.get(kind)
    if mime is None:  # a format one of the four parsers names otherwise (none known to us)
        raise refusal(where, f"the image is {kind}, not one of {_ACCEPTED}")
    if declared is not None and _declared(declared, where=where) != mime:
        raise refusal(
            where,
            f"the image is declared {shown(declared)} but its bytes are {mime}: declare {mime}",
        )
    return mime


def _pixels_hint(limits: ImageLimits) -> str:
    return (
        f"at most {limits.max_pixels:,} pixels per image (the gateway's {SETTING['pixels']}): "
        f"scale it down, or raise the limit"
    )


_KINDS = {"image/png": "PNG", "image/jpeg": "JPEG", "image/gif": "GIF", "image/webp": "WebP"}


def _sniffed(data: bytes) -> str:
    """What the bytes look like, for the message (a hint, never a decision)."""
    if b"<svg" in data[:1024].lower():
        return "an SVG, a vector image: send it rendered as PNG"
    kind = _KINDS.get(sniff_mime(data))
    if kind is not None:
        return f"it starts as a {kind} but is damaged or truncated: send the whole file"
    return f"they start {data[:8]!r}; send one of {_ACCEPTED}"
