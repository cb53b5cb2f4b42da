"""What the image edge accepts (``ImageLimits``), and how it says no: a 400 naming the part.

The limits are built once from the gateway's settings (``GatewaySettings.image_limits``) and
passed down to each API's adapter; nothing below the entry point reads the environment. Their
defaults (README, "Gateway settings"):

- 20 MiB per image: OpenAI's own per-image limit; a 4K PNG screenshot is 2-10 MB.
- 7680 x 4320 = 33,177,600 pixels (8K UHD): every real screen, and at most 133 MB of RGBA
  while one is decoded; below Pillow's own bomb threshold (89.5 M), which stays as it is.
- 64 images per request: a long GUI-agent conversation resends its screenshots, and 64 at the
  pixel limit is the most memory one request can make the edge hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import httpx

from gateway.errors import InvalidRequest

__all__ = [
    "ACCEPTED_MEDIA_TYPES",
    "DEFAULT_FETCH_TIMEOUT_S",
    "DEFAULT_MAX_IMAGES",
    "DEFAULT_MAX_IMAGE_BYTES",
    "DEFAULT_MAX_IMAGE_PIXELS",
    "ImageLimits",
    "parse_host_rule",
]

MiB = 1 << 20
DEFAULT_MAX_IMAGE_BYTES = 20 * MiB
DEFAULT_MAX_IMAGE_PIXELS = 7680 * 4320
DEFAULT_MAX_IMAGES = 64
DEFAULT_FETCH_TIMEOUT_S = 10.0
ACCEPTED_MEDIA_TYPES = ("image/png", "image/jpeg", "image/gif", "image/webp")
DATA_URL = "data:image/png;base64,<base64 of the bytes>"  # what to send, in messages
# The settings each refusal names, as an operator sets them.
SETTING = {
    "bytes": "--max-image-bytes (TURNSTREAM_MAX_IMAGE_BYTES)",
    "pixels": "--max-image-pixels (TURNSTREAM_MAX_IMAGE_PIXELS)",
    "images": "--max-images (TURNSTREAM_MAX_IMAGES)",
    "hosts": "--image-url-hosts (TURNSTREAM_IMAGE_URL_HOSTS)",
}


@dataclass(frozen=True)
class HostRule:
    """One allow-list entry: a host (``*.``: its subdomains) on one port."""

    host: str  # IDNA ASCII, lowercase, no trailing dot
    port: int | None  # None: the scheme's default port only
    subdomains: bool

    def allows(self, url: httpx.URL) -> bool:
        host = host_of(url)
        if not (host.endswith("." + self.host) if self.subdomains else host == self.host):
            return False
        return port_of(url) == (self.port if self.port is not None else _default_port(url))


def host_of(url: httpx.URL) -> str:
    """The host as compared: IDNA ASCII (``bücher.de`` is ``xn--bcher-kva.de``), lowercase."""
    return url.raw_host.decode("ascii").lower().rstrip(".")


def _default_port(url: httpx.URL) -> int:
    return 443 if url.scheme == "https" else 80


def port_of(url: httpx.URL) -> int:
    return url.port if url.port is not None else _default_port(url)


def parse_host_rule(spec: str) -> HostRule:
    """``HOST``, ``HOST:PORT``, ``*.DOMAIN`` or ``*.DOMAIN:PORT`` (IPv6 in brackets). Without a
    port only the scheme's default one is allowed: a listed web host's other ports (its Redis,
    its admin console) are as off limits as any other host.

    >>> parse_host_rule("*.Example.com:8443")
    HostRule(host='example.com', port=8443, subdomains=True)
    """
    text = spec.strip()
    subdomains = text.startswith("*.")
    try:
        url = httpx.URL("http://" + text.removeprefix("*."))
    except httpx.InvalidURL as exc:
        raise ValueError(f"{spec!r} is not HOST, HOST:PORT or *.DOMAIN[:PORT]: {exc}") from None
    if (
        not url.raw_host
        or url.path not in ("", "/")
        or url.query
        or url.userinfo
        or "*" in host_of(url)
    ):
        raise ValueError(f"{spec!r} is not HOST, HOST:PORT or *.DOMAIN[:PORT] (no path, no user)")
    return HostRule(host_of(url), url.port, subdomains)


@dataclass(frozen=True)
class ImageLimits:
    """What the edge accepts of a request's images (module docstring: the defaults)."""

    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    max_images: int = DEFAULT_MAX_IMAGES
    url_hosts: tuple[str, ...] = ()  # hosts remote image URLs may name (parse_host_rule); none
    fetch_timeout_s: float = DEFAULT_FETCH_TIMEOUT_S  # a whole fetch, redirects included
    _rules: tuple[HostRule, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if min(self.max_bytes, self.max_pixels, self.max_images) < 1 or self.fetch_timeout_s <= 0:
            raise ValueError(f"image limits must be positive: {self}")
        object.__setattr__(self, "_rules", tuple(parse_host_rule(h) for h in self.url_hosts))

    def allows(self, url: httpx.URL) -> bool:
        """Whether ``url`` (http or https) names a listed host and port."""
        return any(rule.allows(url) for rule in self._rules)


def refusal(where: str, problem: str) -> InvalidRequest:
    """The 400 of an image: ``where`` is the part as the client's request names it
    (``messages[2].content[1].image_url``), ``problem`` what was wrong and what to do."""
    return InvalidRequest(f"{where}: {problem}", param=where)


def shown(text: str, limit: int = 60) -> str:
    """A client's string as a message may quote it: cut, so a 20 MB URL is not echoed."""
    return repr(text[:limit]) + ("..." if len(text) > limit else "")


def over_bytes(size: int, limits: ImageLimits, *, at_least: bool = False) -> str:
    return (
        f"the image is {'over ' if at_least else ''}{size:,} bytes, over the limit of "
        f"{limits.max_bytes:,} bytes per image (the gateway's {SETTING['bytes']}): send a "
        f"smaller image (scaled down, or JPEG/WebP), or raise the limit"
    )
