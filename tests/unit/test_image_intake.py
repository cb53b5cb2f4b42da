"""The image edge as a hostile client meets it (issue 39, point 1): every bad image is a 400
(``InvalidRequest``) naming the part as the caller named it and what to do; good PNG, JPEG, GIF
and WebP pass with their true size, media type and digest. Remote URLs: refused by default,
file: and friends always, a listed host fetched from a real local HTTP server."""

from __future__ import annotations

import base64
import hashlib
import http.server
import io
import re
import struct
import threading
import time
import warnings
import zlib
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image
from pydantic import ValidationError
from pydantic_settings import CliApp

from gateway.errors import InvalidRequest, error_body, error_spec
from gateway.images import (
    CheckedImage,
    ImageLimits,
    check_image,
    check_image_count,
    image_from_base64,
    image_from_data_url,
    image_from_url,
)
from schemas.images import part_digest
from turnstream.services.gateway.settings import GatewaySettings

WHERE = "messages[2].content[1].image_url"
LIMITS = ImageLimits()


def picture(fmt: str, size: tuple[int, int] = (64, 48), **save: Any) -> bytes:
    """A real image, not one colour (so that a cut in its middle cuts pixels)."""
    image = Image.new("RGB", size, (10, 200, 30))
    for x in range(size[0]):
        image.putpixel((x, x % size[1]), (x * 3 % 256, 0, 255 - x % 256))
    out = io.BytesIO()
    image.save(out, fmt, **save)
    return out.getvalue()


def flat_png(width: int, height: int) -> bytes:
    """A one-colour 1-bit PNG of any size, made without holding its pixels: a 20000x20000 one
    is ~60 KB on disk and 400 M pixels decoded (a decompression bomb)."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return (
            struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
        )

    packer = zlib.compressobj(9)
    row = b"\x00" * (1 + (width + 7) // 8)  # filter byte + the row's bits
    rows_per_block = max(1, (4 << 20) // len(row))
    idat = b"".join(
        packer.compress(row * min(rows_per_block, height - start))
        for start in range(0, height, rows_per_block)
    )
    idat += packer.flush()
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")
    )


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{b64(data)}"


PNG = picture("PNG")
JPEG = picture("JPEG", quality=90)
GIF = picture("GIF")
WEBP = picture("WEBP", quality=80)
WRAPPED = [b64(PNG)[i : i + 76] for i in range(0, len(b64(PNG)), 76)]
SVG = b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"><rect/></svg>'


def refused(call: Callable[[], object], *mentions: str) -> str:
    """``call`` is a 400 whose message names ``WHERE`` first, its param ``WHERE``, and says each
    of ``mentions``."""
    with pytest.raises(InvalidRequest) as caught:
        call()
    message = str(caught.value)
    assert message.startswith(f"{WHERE}: "), message
    assert caught.value.param == WHERE
    assert error_spec(caught.value).status == 400 and error_body(caught.value)["param"] == WHERE
    for mention in mentions:
        assert mention in message, f"{mention!r} not in {message!r}"
    return message


# -- good images ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "mime"),
    [(PNG, "image/png"), (JPEG, "image/jpeg"), (GIF, "image/gif"), (WEBP, "image/webp")],
)
def test_a_good_image_passes_with_its_size_type_and_digest(data: bytes, mime: str) -> None:
    for image in (
        image_from_data_url(data_url(data, mime), where=WHERE, limits=LIMITS),
        image_from_base64(b64(data), mime, where=WHERE, limits=LIMITS),
        check_image(data, where=WHERE, limits=LIMITS),
    ):
        assert image == CheckedImage(hashlib.sha256(data).hexdigest(), data, mime, 64, 48)
        assert image.part == {
            "type": "image",
            "image": f"sha256:{image.digest}",
            "width": 64,
            "height": 48,
        }
        assert part_digest(image.part) == image.digest


@pytest.mark.parametrize(
    "url",
    [
        "data:image/png;base64,"
        + "\n".join(b64(PNG)[i : i + 76] for i in range(0, len(b64(PNG)), 76)),
        "data:image/png;base64,\r\n " + b64(PNG) + "\n",  # wrapped and padded with whitespace
        "DATA:IMAGE/PNG;BASE64," + b64(PNG),  # RFC 2397: case-insensitive
        "data:image/png;name=screen.png;base64," + b64(PNG),  # a parameter, as some clients add
        "data:image/png;base64," + base64.urlsafe_b64encode(PNG).decode(),
        "data:image/png;base64," + b64(PNG).rstrip("="),  # padding left off
    ],
    ids=["wrapped-76", "whitespace", "upper-case", "parameter", "urlsafe", "unpadded"],
)
def test_what_clients_send_is_taken(url: str) -> None:
    assert image_from_data_url(url, where=WHERE, limits=LIMITS).data == PNG


def test_image_jpg_is_taken_for_image_jpeg() -> None:
    image = image_from_data_url(data_url(JPEG, "image/jpg"), where=WHERE, limits=LIMITS)
    assert image.mime == "image/jpeg"


def test_a_phone_cameras_mpo_is_a_jpeg() -> None:
    pictures = [Image.new("RGB", (30, 20), colour) for colour in ("red", "blue")]
    out = io.BytesIO()
    pictures[0].save(out, "MPO", save_all=True, append_images=pictures[1:])
    image = image_from_data_url(data_url(out.getvalue(), "image/jpeg"), where=WHERE, limits=LIMITS)
    assert (image.mime, image.width, image.height) == ("image/jpeg", 30, 20)


def test_an_animated_gif_is_its_first_frame() -> None:
    frames = [Image.new("P", (20, 10), i) for i in range(3)]
    out = io.BytesIO()
    frames[0].save(out, "GIF", save_all=True, append_images=frames[1:], duration=50)
    assert check_image(out.getvalue(), where=WHERE, limits=LIMITS).mime == "image/gif"


# -- bad images -------------------------------------------------------------------------------

BAD_BYTES = [
    ("not-an-image", b"hello, world: not an image at all", ["not a PNG, JPEG, GIF or WebP"]),
    ("svg", SVG, ["SVG", "rendered as PNG"]),
    ("bmp", picture("BMP"), ["not a PNG, JPEG, GIF or WebP"]),
    ("tiff", picture("TIFF"), ["not a PNG, JPEG, GIF or WebP"]),
    ("empty", b"", ["empty"]),
    ("png-cut-in-half", PNG[: len(PNG) // 2], ["PNG is damaged or truncated"]),
    ("png-without-its-end", PNG[:-12], ["PNG is damaged or truncated"]),
    ("png-bad-crc", PNG[:-20] + bytes([PNG[-20] ^ 0xFF]) + PNG[-19:], ["damaged or truncated"]),
    ("png-bad-chunk", PNG[:40] + bytes([PNG[40] ^ 0xFF]) + PNG[41:], ["starts as a PNG"]),
    ("jpeg-cut", JPEG[: len(JPEG) - 40], ["JPEG is damaged or truncated"]),
    ("jpeg-header-only", JPEG[:200], ["damaged or truncated"]),
    ("gif-cut", GIF[: len(GIF) // 2], ["GIF"]),
    ("webp-cut", WEBP[:-10], ["damaged or truncated"]),
    ("png-signature-only", PNG[:8], ["PNG"]),
    ("zero-width", flat_png(0, 10), ["PNG"]),
    ("bomb-20000x20000", flat_png(20000, 20000), ["decompression bomb", "--max-image-pixels"]),
    ("too-many-pixels", flat_png(6000, 6000), ["6000x6000 = 36,000,000 pixels", "33,177,600"]),
]


@pytest.mark.parametrize(
    ("data", "mentions"), [c[1:] for c in BAD_BYTES], ids=[c[0] for c in BAD_BYTES]
)
def test_bad_bytes_are_a_400_naming_the_part(data: bytes, mentions: list[str]) -> None:
    refused(lambda: check_image(data, where=WHERE, limits=LIMITS), *mentions)
    declared = {b"\xff\xd8": "image/jpeg", b"GI": "image/gif", b"RI": "image/webp"}
    url = data_url(data, declared.get(data[:2], "image/png"))  # declared truthfully
    refused(lambda: image_from_data_url(url, where=WHERE, limits=LIMITS), *mentions)


def test_a_bomb_below_pillows_error_is_refused_with_pillows_warning_on_or_off() -> None:
    """100 M pixels: past Pillow's warning (89.5 M), short of its error (179 M)."""
    bomb = flat_png(10000, 10000)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        refused(lambda: check_image(bomb, where=WHERE, limits=LIMITS), "10000x10000")
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        refused(lambda: check_image(bomb, where=WHERE, limits=LIMITS), "decompression bomb")


def test_pillows_own_limit_is_left_as_it_was() -> None:
    before = Image.MAX_IMAGE_PIXELS
    with pytest.raises(InvalidRequest):
        check_image(flat_png(20000, 20000), where=WHERE, limits=ImageLimits(max_pixels=10**9))
    assert before == Image.MAX_IMAGE_PIXELS


def test_the_pixel_and_byte_limits_are_the_callers() -> None:
    small = ImageLimits(max_pixels=64 * 48 - 1, max_bytes=len(PNG))
    refused(lambda: check_image(PNG, where=WHERE, limits=small), "64x48", "3,071 pixels")
    tiny = ImageLimits(max_bytes=len(PNG) - 1)
    for call in (
        lambda: check_image(PNG, where=WHERE, limits=tiny),
        lambda: image_from_data_url(data_url(PNG), where=WHERE, limits=tiny),
        lambda: image_from_base64(b64(PNG), "image/png", where=WHERE, limits=tiny),
    ):
        refused(call, f"{len(PNG):,} bytes", f"limit of {len(PNG) - 1:,}", "--max-image-bytes")


def test_50_mb_of_base64_is_refused_before_it_is_decoded(monkeypatch: pytest.MonkeyPatch) -> None:
    class NoDecoding:
        def a2b_base64(self, *args: object, **kwargs: object) -> bytes:
            raise AssertionError("decoded")

    monkeypatch.setattr("gateway.images.intake.binascii", NoDecoding())
    huge = "A" * (50 << 20)
    refused(
        lambda: image_from_data_url("data:image/png;base64," + huge, where=WHERE, limits=LIMITS),
        "52,428,800 characters, more than the base64 of 20,971,520 bytes",
        "--max-image-bytes",
    )
    refused(lambda: image_from_base64(huge, "image/png", where=WHERE, limits=LIMITS), "characters")


def test_too_many_images_is_refused_before_any_is_decoded() -> None:
    check_image_count(64, where=WHERE, limits=LIMITS)
    refused(lambda: check_image_count(65, where=WHERE, limits=LIMITS), "65 images", "--max-images")


BAD_DATA_URLS = [
    ("not-base64", "data:image/png," + b64(PNG), ["not base64"]),
    ("no-comma", "data:image/png;base64" + b64(PNG), ["not a data URL"]),
    ("no-media-type", "data:;base64," + b64(PNG), ["media type ''"]),
    ("text", "data:text/plain;base64," + b64(PNG), ["'text/plain' is not accepted"]),
    ("svg-type", "data:image/svg+xml;base64," + b64(SVG), ["SVG is not"]),
    ("bmp-type", "data:image/bmp;base64," + b64(picture("BMP")), ["image/png, image/jpeg"]),
    ("bare-param", "data:image/png;foo;base64," + b64(PNG), ["malformed"]),
    ("jpeg-as-png", data_url(JPEG, "image/png"), ["declared 'image/png'", "declare image/jpeg"]),
    ("png-as-jpg", data_url(PNG, "image/jpg"), ["declared 'image/jpg'", "declare image/png"]),
    ("png-as-webp", data_url(PNG, "image/webp"), ["its bytes are image/png"]),
    ("bad-char", "data:image/png;base64,iVBO!!!!", ["not valid base64"]),
    ("4n+1", "data:image/png;base64,iVBORw0KG", ["not valid base64"]),
    ("after-padding", "data:image/png;base64,aGk=aGk=", ["not valid base64"]),
    ("mixed-alphabets", "data:image/png;base64,ab+/cd-_", ["not valid base64"]),
    ("empty", "data:image/png;base64,", ["empty"]),
    ("whitespace-only", "data:image/png;base64, \n\t ", ["empty"]),
    ("unicode", "data:image/png;base64,iVBOR☃w0KGgo=", ["non-ASCII"]),
    ("fullwidth", "data:image/png;base64,ｉＶＢＯＲｗ０ＫＧｇｏ", ["non-ASCII"]),
    ("surrogate", "data:image/png;base64,iVBO\ud800", ["non-ASCII"]),
    ("nul", "data:image/png;base64,iVBO\x00Rw0K", ["not valid base64"]),
    ("head-too-long", "data:image/png;" + "a=b;" * 100 + "base64," + b64(PNG), ["not a data"]),
]


@pytest.mark.parametrize(
    ("url", "mentions"), [c[1:] for c in BAD_DATA_URLS], ids=[c[0] for c in BAD_DATA_URLS]
)
async def test_a_bad_data_url_is_a_400_naming_the_part(url: str, mentions: list[str]) -> None:
    refused(lambda: image_from_data_url(url, where=WHERE, limits=LIMITS), *mentions)
    with pytest.raises(InvalidRequest, match=re.escape(WHERE)):
        await image_from_url(url, where=WHERE, limits=LIMITS)


@pytest.mark.parametrize(
    ("data", "media_type", "mention"),
    [
        (None, "image/png", "not NoneType"),
        (["iVBO"], "image/png", "not list"),
        (b64(PNG), None, "must be a string"),
        (b64(PNG), "png", "'png' is not accepted"),
        (b64(PNG), "image/png; charset=utf-8", "not accepted"),
        (b64(JPEG), "image/gif", "declare image/jpeg"),
    ],
)
def test_a_bad_anthropic_source_is_a_400(data: object, media_type: object, mention: str) -> None:
    refused(lambda: image_from_base64(data, media_type, where=WHERE, limits=LIMITS), mention)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    original=st.sampled_from([PNG, JPEG, GIF, WEBP]),
    cut=st.integers(min_value=0, max_value=2000),
    flips=st.lists(st.tuples(st.integers(0, 2000), st.integers(1, 255)), max_size=4),
)
def test_a_damaged_image_is_taken_or_a_400_never_anything_else(
    original: bytes, cut: int, flips: list[tuple[int, int]]
) -> None:
    data = bytearray(original[: max(1, len(original) - cut)])
    for at, xor in flips:
        data[at % len(data)] ^= xor
    try:
        image = check_image(bytes(data), where=WHERE, limits=LIMITS)
    except InvalidRequest as exc:
        assert exc.param == WHERE
    else:
        assert image.width * image.height <= LIMITS.max_pixels


# -- remote URLs ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "mention"),
    [
        ("https://example.com/cat.png", "does not fetch images from example.com:443"),
        ("http://169.254.169.254/latest/meta-data/", "169.254.169.254:80"),
        ("http://127.0.0.1:6379/", "request forgery"),
        ("file:///etc/passwd", "not an image URL the gateway takes"),
        ("ftp://example.com/cat.png", "not an image URL"),
        ("gopher://127.0.0.1:6379/_FLUSHALL", "not an image URL"),
        ("javascript:alert(1)", "not an image URL"),
        ("/etc/passwd", "not an image URL"),
        ("", "not an image URL"),
        ("http://", "not an image URL"),
        ("http://exa mple.com/", "does not fetch"),
        (None, "must be a string"),
        ({"url": "data:"}, "must be a string"),
    ],
)
async def test_remote_urls_are_refused_by_default(url: object, mention: str) -> None:
    with pytest.raises(InvalidRequest, match=re.escape(WHERE)) as caught:
        await image_from_url(url, where=WHERE, limits=LIMITS)
    assert mention in str(caught.value) and caught.value.param == WHERE


class Site(http.server.BaseHTTPRequestHandler):
    """A local web server of images: /cat.png, redirects, errors, an endless body."""

    routes: ClassVar[dict[str, tuple[int, dict[str, str], bytes]]] = {}

    def do_GET(self) -> None:
        status, headers, body = self.routes.get(self.path, (404, {}, b"no such image"))
        self.send_response(status)
        for name, value in {"Content-Length": str(len(body)), **headers}.items():
            if value:
                self.send_header(name, value)
        self.end_headers()
        if self.path == "/drip":  # a byte every 0.2 s: no read waits long, the fetch does
            for byte in body:
                time.sleep(0.2)
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
            return
        if self.path == "/endless":
            try:
                while True:
                    self.wfile.write(b"\x00" * 65536)
            except OSError:
                return
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def site() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Site)
    server.daemon_threads = True
    host = f"127.0.0.1:{server.server_address[1]}"
    Site.routes = {
        "/cat.png": (200, {"Content-Type": "application/octet-stream"}, PNG),
        "/cat.jpg": (200, {}, JPEG),
        "/here": (302, {"Location": "/cat.png"}, b""),
        "/away": (302, {"Location": "http://localhost:1/cat.png"}, b""),
        "/meta": (301, {"Location": "http://169.254.169.254/"}, b""),
        "/file": (302, {"Location": "file:///etc/passwd"}, b""),
        "/loop": (302, {"Location": "/loop"}, b""),
        "/big": (200, {}, PNG + b"\x00" * 200),
        "/endless": (200, {"Content-Length": ""}, b""),
        "/gzip": (200, {"Content-Encoding": "gzip"}, zlib.compress(PNG)),
        "/svg": (200, {"Content-Type": "image/png"}, SVG),
        "/cut": (200, {}, PNG[:-12]),
        "/gone": (410, {}, b""),
        "/drip": (200, {}, PNG),
    }
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield host
    server.shutdown()
    server.server_close()


async def test_a_listed_host_is_fetched_and_checked(site: str) -> None:
    limits = ImageLimits(url_hosts=("example.com", site))
    for path, data, mime in [
        ("/cat.png", PNG, "image/png"),
        ("/cat.jpg", JPEG, "image/jpeg"),
        ("/here", PNG, "image/png"),
    ]:
        image = await image_from_url(f"http://{site}{path}", where=WHERE, limits=limits)
        assert (image.data, image.mime, image.digest) == (
            data,
            mime,
            hashlib.sha256(data).hexdigest(),
        )


@pytest.mark.parametrize(
    ("path", "mention"),
    [
        (
            "/away",
            "redirects elsewhere: the gateway does not fetch images from localhost:1",
        ),  # another host, though the same IP
        ("/meta", "169.254.169.254:80"),
        ("/file", "not an image URL"),
        ("/loop", "more than 3 redirects"),
        ("/big", "over the limit"),  # Content-Length says so
        ("/endless", "the image is over"),  # no length: counted as it streams in
        ("/gzip", "compressed (gzip)"),
        ("/svg", "SVG"),
        ("/cut", "PNG is damaged or truncated"),
        ("/gone", "answered 410"),
        ("/nothing", "answered 404"),
        ("/drip", "was not fetched within 1.0 s"),
    ],
)
async def test_a_listed_host_gets_no_further_than_an_inline_image(
    site: str, path: str, mention: str
) -> None:
    limits = ImageLimits(url_hosts=(site,), max_bytes=len(PNG) + 100, fetch_timeout_s=1.0)
    with pytest.raises(InvalidRequest, match=re.escape(WHERE)) as caught:
        await image_from_url(f"http://{site}{path}", where=WHERE, limits=limits)
    assert mention in str(caught.value) and caught.value.param == WHERE


async def test_a_listed_host_on_another_port_or_posing_is_not_fetched(site: str) -> None:
    limits = ImageLimits(url_hosts=("127.0.0.1",))  # the default port only
    port = site.rpartition(":")[2]
    for url in (
        f"http://{site}/cat.png",
        f"http://127.0.0.1.nip.io:{port}/cat.png",
        f"http://127.0.0.1@localhost:{port}/cat.png",
    ):
        with pytest.raises(InvalidRequest, match="does not fetch images from"):
            await image_from_url(url, where=WHERE, limits=limits)


async def test_a_dead_listed_host_is_a_400_not_a_500() -> None:
    limits = ImageLimits(url_hosts=("127.0.0.1:1",), fetch_timeout_s=5)
    with pytest.raises(InvalidRequest, match="could not be fetched"):
        await image_from_url("http://127.0.0.1:1/cat.png", where=WHERE, limits=limits)


@pytest.mark.parametrize(
    ("hosts", "url", "allowed"),
    [
        (["example.com"], "https://example.com/a.png", True),
        (["example.com"], "http://EXAMPLE.com./a.png", True),
        (["example.com"], "https://example.com:8443/a.png", False),
        (["example.com:8443"], "https://example.com:8443/a.png", True),
        (["example.com"], "https://a.example.com/a.png", False),
        (["*.example.com"], "https://a.example.com/a.png", True),
        (["*.example.com"], "https://a.b.example.com/a.png", True),
        (["*.example.com"], "https://example.com/a.png", False),
        (["*.example.com"], "https://evilexample.com/a.png", False),
        (["*.example.com"], "https://example.com.evil.org/a.png", False),
        (["bücher.de"], "https://xn--bcher-kva.de/a.png", True),
        (["[::1]:8080"], "http://[::1]:8080/a.png", True),
        (["example.com"], "https://example.com@evil.org/a.png", False),
    ],
)
def test_the_allow_list(hosts: list[str], url: str, allowed: bool) -> None:
    import httpx

    assert ImageLimits(url_hosts=tuple(hosts)).allows(httpx.URL(url)) is allowed


@pytest.mark.parametrize("spec", ["", "*", "a.com/path", "user@a.com", "*.a*.com", "a.com:port"])
def test_a_bad_allow_list_entry_is_refused_up_front(spec: str) -> None:
    with pytest.raises(ValueError, match="is not HOST"):
        ImageLimits(url_hosts=(spec,))


# -- the settings: flags, env vars, what reaches the adapters ---------------------------------


def test_the_settings_build_the_limits() -> None:
    argv = ["--max-image-bytes", "1000", "--max-image-pixels", "5000", "--max-images", "3"]
    argv += ["--image-url-hosts", "cdn.example.com,*.example.org:8443", "--image-url-hosts", "a.io"]
    read = CliApp.run(GatewaySettings, cli_args=[*argv, "--image-fetch-timeout-s", "2.5"])
    assert read.image_limits == ImageLimits(
        1000, 5000, 3, ("cdn.example.com", "*.example.org:8443", "a.io"), 2.5
    )
    assert GatewaySettings().image_limits == ImageLimits()  # the defaults are one's


def test_the_env_var_lists_hosts_as_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TURNSTREAM_IMAGE_URL_HOSTS", "cdn.example.com, 127.0.0.1:8080")
    assert GatewaySettings().image_limits.url_hosts == ("cdn.example.com", "127.0.0.1:8080")


@pytest.mark.parametrize(
    ("field", "value", "mention"),
    [
        ("image_url_hosts", ["cdn.example.com/images"], "is not HOST"),
        ("max_image_pixels", 10**9, "less than or equal to 89478485"),  # Pillow's bomb limit
        ("max_images", 0, "greater than or equal to 1"),
    ],
)
def test_a_bad_setting_stops_the_gateway_before_it_starts(
    field: str, value: object, mention: str
) -> None:
    with pytest.raises(ValidationError, match=mention):
        GatewaySettings.model_validate({field: value})
