"""Remote image URLs: refused unless the operator lists their host, fetched with care if so.

A gateway that fetches whatever URL a client names is a server-side request forgery: the
client reaches the gateway's network (cloud metadata at 169.254.169.254, internal services).
So an http(s) image URL is fetched only from a host and port ``--image-url-hosts`` lists; the
fetch has one deadline for all of it (a server dripping bytes cannot hold a request), asks for
the body uncompressed and refuses a compressed one (a gzip body unpacks ~1000x past the byte
limit), counts the byte limit as the bytes arrive, and follows a redirect only to a listed host
(at most 3). The server's Content-Type is ignored: the bytes decide (``intake.check_image``).
Every failure, the server's included, is a 400 naming the part: the client chose the URL.

A listed host is trusted to be what its name says: its DNS answers are not checked against
private addresses (list only hosts whose names you control).
"""

from __future__ import annotations

import asyncio

import httpx

from gateway.errors import InvalidRequest
from gateway.images.limits import (
    ACCEPTED_MEDIA_TYPES,
    DATA_URL,
    SETTING,
    ImageLimits,
    host_of,
    over_bytes,
    port_of,
    refusal,
    shown,
)

__all__ = ["fetch_image", "fetchable_url"]

_MAX_REDIRECTS = 3
_HEADERS = {"Accept": ", ".join(ACCEPTED_MEDIA_TYPES), "Accept-Encoding": "identity"}


def fetchable_url(url: str, *, where: str, limits: ImageLimits) -> httpx.URL:
    """``url`` parsed, if the gateway may fetch it (http or https, a listed host and port)."""
    try:
        target: httpx.URL | None = httpx.URL(url)
    except httpx.InvalidURL:
        target = None
    if target is None or target.scheme not in ("http", "https") or not target.raw_host:
        raise refusal(
            where,
            f"{shown(url)} is not an image URL the gateway takes: send the image inline as "
            f"{DATA_URL} (or an http(s) URL of a host the gateway's {SETTING['hosts']} lists)",
        )
    if not limits.allows(target):
        listed = "lists" if limits.url_hosts else "would have to list"
        raise refusal(
            where,
            f"the gateway does not fetch images from {host_of(target)}:{port_of(target)} (a "
            f"server fetching a client's URL is a request forgery risk): send the image inline "
            f"as {DATA_URL}; the gateway's {SETTING['hosts']} {listed} the hosts it fetches from",
        )
    return target


async def fetch_image(
    target: httpx.URL, *, where: str, limits: ImageLimits, client: httpx.AsyncClient | None
) -> bytes:
    """The body of a GET of ``target`` (a ``fetchable_url``), as the module docstring says;
    ``client``: the one to fetch with (its redirect setting is overridden), None: a new one."""
    http = client or httpx.AsyncClient(trust_env=False, timeout=limits.fetch_timeout_s)
    try:
        async with asyncio.timeout(limits.fetch_timeout_s):
            for _ in range(_MAX_REDIRECTS + 1):
                body = await _get(http, target, where=where, limits=limits)
                if isinstance(body, bytes):
                    return body
                target = body
            raise refusal(where, f"{shown(str(target))}: more than {_MAX_REDIRECTS} redirects")
    except TimeoutError:
        raise refusal(
            where, f"{shown(str(target))} was not fetched within {limits.fetch_timeout_s} s"
        ) from None
    except httpx.HTTPError as exc:
        raise refusal(
            where, f"{shown(str(target))} could not be fetched ({type(exc).__name__}: {exc})"
        ) from None
    finally:
        if client is None:
            await http.aclose()


async def _get(
    http: httpx.AsyncClient, target: httpx.URL, *, where: str, limits: ImageLimits
) -> bytes | httpx.URL:
    """One GET: the body, or where a redirect points (a listed host's URL, else a 400)."""
    url = shown(str(target))
    async with http.stream("GET", target, headers=_HEADERS, follow_redirects=False) as response:
        if response.is_redirect:
            location = response.headers.get("location", "")
            try:
                return fetchable_url(str(target.join(location)), where=where, limits=limits)
            except InvalidRequest as exc:
                problem = str(exc.args[0]).removeprefix(f"{where}: ")
                raise refusal(where, f"{url} redirects elsewhere: {problem}") from None
        if response.status_code != 200:
            raise refusal(where, f"{url} answered {response.status_code}, not the image")
        encoding = response.headers.get("content-encoding", "identity").strip().lower()
        if encoding != "identity":
            raise refusal(where, f"{url} was sent compressed ({encoding}): send it as it is")
        length = response.headers.get("content-length", "")
        if length.isdigit() and int(length) > limits.max_bytes:
            raise refusal(where, over_bytes(int(length), limits))
        body = bytearray()
        async for chunk in response.aiter_raw():
            body += chunk
            if len(body) > limits.max_bytes:
                raise refusal(where, over_bytes(len(body), limits, at_least=True))
        return bytes(body)
