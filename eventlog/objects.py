"""The log's image store: a JetStream object store bucket, an image named by its SHA-256.

Events never carry image bytes (issue 39): a turn's messages name an image by the digest of its
bytes (``schemas.images.content_digest``), and the bytes live once in the bucket
``ts_images`` (stream ``OBJ_ts_images``), on the same servers as the events and replicated
like them. The gateway ``put``s a turn's new images before it publishes the TurnCompleted
that names them, so a stored event never names an object the log does not hold; consumers
``get`` them back, checked against the name.

Retention follows the events'. A JetStream object expires its bucket's max age after its
upload, not after the last event that names it, so the two ages differ (``ImageRetention``):
with ``E`` the events' max age, the bucket keeps an object ``2E`` after its upload, and a
``put`` of an image whose upload is older than ``E/2`` uploads it again. An event is published
just after its images' ``put``, so each of its images then has at least ``1.5E`` to live, the
event ``E``: the rest (``E/2``) covers a publish delayed in the outbox and clocks that
disagree. An image no event names any more is gone within ``2E`` of its last upload.

nats-py's object store re-uploads an object on every ``put`` of its name, so ``put`` looks
first (``get_info``: one request) and uploads only what is absent, old or damaged. Its ``get``
follows the chunks with an ordered consumer that waits forever when they are gone (expired,
purged by a concurrent refresh): ``get`` bounds the wait and then says what it found.

>>> ImageRetention.following(86_400.0)
ImageRetention(ttl_s=172800.0, refresh_after_s=43200.0)
>>> ImageRetention.following(0.0)  # events kept forever: so are images
ImageRetention(ttl_s=None, refresh_after_s=None)
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Protocol

import nats.errors
from nats.js import api as js_api
from nats.js import errors as js_errors
from nats.js.object_store import ObjectStore

from eventlog.config import LogSettings
from eventlog.connection import Connection, answered, map_nats_errors
from eventlog.errors import ImageAltered, ImageMissing, LogStoreFull, PublishForbidden
from eventlog.publisher import STORE_FULL_CODES
from schemas.errors import EventLogUnavailable
from schemas.images import content_digest

__all__ = [
    "ImageInfo",
    "ImageRetention",
    "ImageStore",
    "JetStreamImageStore",
    "image_bucket_config",
]

_DIGEST = re.compile(r"[0-9a-f]{64}")
# JetStream's 'store failed' (10077) says why; 'maximum bytes exceeded': the bucket's own
# max_bytes reached (discard new, as object stores are made).
_STORE_FAILED = 10077


@dataclass(frozen=True)
class ImageRetention:
    """How long the bucket keeps an object (``ttl_s``) and the age past which a ``put``
    uploads it again (``refresh_after_s``); None: forever, never (the events are kept
    forever)."""

    ttl_s: float | None
    refresh_after_s: float | None

    @classmethod
    def following(cls, events_max_age_s: float) -> ImageRetention:
        if not events_max_age_s:
            return cls(None, None)
        return cls(2 * events_max_age_s, events_max_age_s / 2)


@dataclass(frozen=True)
class ImageInfo:
    """What the bucket records of a stored image."""

    digest: str
    size: int
    uploaded_at: datetime | None  # the uploader's clock as it began the upload


class ImageStore(Protocol):
    """The log's images by content digest (64 lowercase hex SHA-256). Every method raises
    ``EventLogUnavailable`` when the log does not answer, ``ValueError`` for a digest that is no
    SHA-256 hex (a caller's bug: events hold digests checked at decoding)."""

    async def put(self, data: bytes) -> str:
        """Store ``data`` unless it is already stored (and fresh); its digest."""
        ...

    async def get(self, digest: str) -> bytes:
        """The bytes named ``digest``; ``ImageMissing`` if none are stored, ``ImageAltered`` if
        what is stored is not what the name says."""
        ...

    async def has(self, digest: str) -> bool: ...

    async def info(self, digest: str) -> ImageInfo | None: ...

    async def digests(self) -> list[str]:
        """The digests stored, sorted."""
        ...


def image_bucket_config(s: LogSettings) -> js_api.ObjectStoreConfig:
    """The image bucket as the settings want it (``provision`` makes it)."""
    return js_api.ObjectStoreConfig(
        bucket=s.names.images_bucket,
        description="turnstream: images of turns by SHA-256 of their bytes",
        ttl=ImageRetention.following(s.events_max_age_s).ttl_s,
        max_bytes=s.images_max_bytes,
        storage=js_api.StorageType.FILE,
        replicas=s.replicas,
    )


def _checked(digest: str) -> str:
    if not _DIGEST.fullmatch(digest):
        raise ValueError(f"{digest!r} is not an image digest (64 lowercase hex SHA-256)")
    return digest


def _nats_digest(data_digest: str) -> str:
    """nats-py's record of a SHA-256: 'SHA-256=' + URL-safe base64."""
    return "SHA-256=" + base64.urlsafe_b64encode(bytes.fromhex(data_digest)).decode()


class JetStreamImageStore:
    """``ImageStore`` over a nats-py connection (``open`` it; the bucket must be provisioned).

    ``read_timeout_s`` bounds one ``get`` (a big image on a slow link needs more),
    ``request_timeout_s`` each request and chunk publish (nats-py's JetStream default)."""

    def __init__(
        self,
        nc: Connection,
        store: ObjectStore,
        bucket: str,
        retention: ImageRetention,
        read_timeout_s: float = 30.0,
        request_timeout_s: float = 5.0,
    ) -> None:
        self._nc = nc
        self._store = store
        self.bucket = bucket
        self.retention = retention
        self.read_timeout_s = read_timeout_s
        self.request_timeout_s = request_timeout_s
        self._putting: dict[str, asyncio.Future[str]] = {}

    @classmethod
    async def open(
        cls,
        nc: Connection,
        settings: LogSettings,
        read_timeout_s: float = 30.0,
        request_timeout_s: float = 5.0,
    ) -> JetStreamImageStore:
        bucket = settings.names.images_bucket
        js = nc.jetstream(timeout=request_timeout_s)
        try:
            store = await answered(lambda: js.object_store(bucket), f"opening bucket {bucket}")
        except js_errors.BucketNotFoundError as exc:
            raise EventLogUnavailable(
                f"the image bucket {bucket} does not exist: provision the log "
                f"(`turnstream provision`, or any service started by an admin user)"
            ) from exc
        except (TimeoutError, nats.errors.Error, OSError) as exc:
            raise EventLogUnavailable(f"cannot open the image bucket {bucket}: {exc}") from exc
        retention = ImageRetention.following(settings.events_max_age_s)
        return cls(nc, store, bucket, retention, read_timeout_s, request_timeout_s)

    # -- the port ------------------------------------------------------------------------------

    async def put(self, data: bytes) -> str:
        """Concurrent puts of one image share one look-up and upload: the n samples of a GRPO
        group start from the same screenshot at once, and each would upload it (nats-py's
        put of a name not yet recorded purges nothing). Two processes can still race; the
        loser's chunks are left until the bucket's max age (nothing reads them)."""
        digest = content_digest(data)
        putting = self._putting.get(digest)
        if putting is None:
            putting = asyncio.ensure_future(self._put(digest, data))
            self._putting[digest] = putting
            putting.add_done_callback(lambda _: self._putting.pop(digest, None))
        # shielded: a caller that gives up (its request cancelled) leaves the others' upload
        return await asyncio.shield(putting)

    async def _put(self, digest: str, data: bytes) -> str:
        with self._translated(f"storing image {digest} in bucket {self.bucket}"):
            stored = await self._stored(digest)
            if stored is not None and not self._needs_upload(stored, digest):
                return digest
            await self._store.put(digest, data)
        return digest

    async def get(self, digest: str) -> bytes:
        _checked(digest)
        with self._translated(f"reading image {digest} from bucket {self.bucket}"):
            # Once more when a concurrent refresh replaced the chunks being read. A read cut
            # off by the timeout leaves nats-py's chunk subscription behind (its ``get`` does
            # not unsubscribe when cancelled): rare, only when chunks are gone or late.
            for _ in range(2):
                try:
                    async with asyncio.timeout(self.read_timeout_s):
                        result = await self._store.get(digest)
                except js_errors.ObjectNotFoundError as exc:
                    raise ImageMissing(digest, self.bucket) from exc
                except (js_errors.DigestMismatchError, js_errors.BadObjectMetaError) as exc:
                    raise ImageAltered(
                        digest, self.bucket, "its chunks do not match its own record"
                    ) from exc
                except TimeoutError:
                    await self._after_a_stalled_read(digest)
                    continue
                data = result.data or b""
                if content_digest(data) != digest:
                    raise ImageAltered(
                        digest, self.bucket, f"the bytes stored hash to {content_digest(data)}"
                    )
                return data
        raise EventLogUnavailable(
            f"reading image {digest} from bucket {self.bucket}: no data within "
            f"{self.read_timeout_s}s, twice, though the bucket holds it; is nats-server answering?"
        )

    async def has(self, digest: str) -> bool:
        return await self.info(digest) is not None

    async def info(self, digest: str) -> ImageInfo | None:
        _checked(digest)
        with self._translated(f"looking up image {digest} in bucket {self.bucket}"):
            stored = await self._stored(digest)
        if stored is None:
            return None
        return ImageInfo(digest, stored.size or 0, _uploaded_at(stored))

    async def digests(self) -> list[str]:
        """Every object name of the bucket's meta subjects, paged as nats-server pages them
        (100,000 subjects an answer; nats-py's ``stream_info`` does not page, and ``list``
        races like a KV watch: see ``Bucket.entries``); names that are no SHA-256 (put there
        by hand) are left out. An object deleted by hand keeps its meta subject (a delete
        marker), so it is listed and ``get`` says it is missing."""
        prefix = f"$O.{self.bucket}.M."
        found: list[str] = []
        offset = 0
        with self._translated(f"listing bucket {self.bucket}"):
            while True:
                request = {"subjects_filter": prefix + ">", "offset": offset}
                reply = await self._nc.request(
                    f"$JS.API.STREAM.INFO.OBJ_{self.bucket}",
                    json.dumps(request).encode(),
                    timeout=self.request_timeout_s,
                )
                answer = json.loads(reply.data)
                if "error" in answer:
                    raise EventLogUnavailable(f"JetStream answered {answer['error']}")
                subjects = answer.get("state", {}).get("subjects") or {}
                for subject in subjects:
                    name = _name_of(subject[len(prefix) :])
                    if name is not None and _DIGEST.fullmatch(name):
                        found.append(name)
                offset += len(subjects)
                if not subjects or offset >= answer.get("total", 0):
                    return sorted(found)

    # -- inside --------------------------------------------------------------------------------

    async def _stored(self, digest: str) -> js_api.ObjectInfo | None:
        try:
            return await self._store.get_info(digest)
        except js_errors.ObjectNotFoundError:  # never stored, expired, or deleted
            return None

    def _needs_upload(self, stored: js_api.ObjectInfo, digest: str) -> bool:
        """A stored object is uploaded again when it is older than the refresh age (it must
        outlive the event about to name it) or not what its name says (an upload cut short
        cannot leave that, a hand can; the put repairs it)."""
        if stored.digest != _nats_digest(digest):
            return True
        refresh_after = self.retention.refresh_after_s
        uploaded = _uploaded_at(stored)
        if refresh_after is None or uploaded is None:
            return refresh_after is not None  # no upload time: assume old
        return (datetime.now(UTC) - uploaded).total_seconds() > refresh_after

    async def _after_a_stalled_read(self, digest: str) -> None:
        """A ``get`` got no chunks in time: missing if the object or its chunks are gone;
        back to the caller's loop (read again) if they are there (a refresh replaced them
        mid-read, or the server was slow)."""
        stored = await self._stored(digest)
        if stored is None:
            raise ImageMissing(digest, self.bucket)
        chunks = f"$O.{self.bucket}.C.{stored.nuid}"
        js = self._nc.jetstream(timeout=self.request_timeout_s)
        info = await js.stream_info(f"OBJ_{self.bucket}", chunks)
        held = sum((info.state.subjects or {}).values())
        if held < (stored.chunks or 0):
            raise ImageMissing(
                digest, self.bucket, f"{held} of its {stored.chunks} chunks are left"
            )

    @contextlib.contextmanager
    def _translated(self, what: str) -> Iterator[None]:
        """nats' errors as ours: a full store or bucket is ``LogStoreFull``, a refusal of
        these credentials ``PublishForbidden``, anything else ``EventLogUnavailable``."""
        try:
            with map_nats_errors(what):
                try:
                    yield
                except js_errors.APIError as exc:
                    if exc.err_code in STORE_FULL_CODES or (
                        exc.err_code == _STORE_FAILED and "maximum bytes" in (exc.description or "")
                    ):
                        raise LogStoreFull(
                            f"{what}: JetStream has no room ({exc}); the bucket's cap is "
                            f"--log.images-max-bytes, the server's its jetstream "
                            f"max_file_store: nothing was stored, retry once there is room"
                        ) from exc
                    raise
        except EventLogUnavailable as exc:
            if isinstance(exc, LogStoreFull):
                raise
            refused = str(self._nc.last_error or "")
            if "permissions violation" in refused.lower() and self.bucket in refused:
                raise PublishForbidden(
                    f"{what}: the log refused it ({refused}); the role of these credentials "
                    f"may not do that (eventlog.server.permissions: gateways store images, "
                    f"every role reads them)"
                ) from exc
            raise


def _uploaded_at(stored: js_api.ObjectInfo) -> datetime | None:
    if not stored.mtime:
        return None
    try:
        return datetime.fromisoformat(stored.mtime.replace("Z", "+00:00"))
    except ValueError:
        return None


def _name_of(token: str) -> str | None:
    try:
        return base64.urlsafe_b64decode(token).decode()
    except (binascii.Error, UnicodeDecodeError):
        return None
