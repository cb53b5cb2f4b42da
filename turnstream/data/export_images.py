"""Where ``turnstream export`` reads the images its rows show: the log's image store.

The shards name an image by its digest only (``schemas.images``); its bytes are in the log.
``LogImages`` opens the log on the first image asked for, so an export whose rows show none
never connects: ``--log.url``, else the log of the ``turnstream up`` running on ``--data-dir``
(its ``stack.json``), else the embedded log of ``--data-dir`` when it has one (its nats-server
started for the export). A data dir with no log of its own (shards copied elsewhere) cannot
give the images: the export says so and writes nothing (``export --kind tokens`` needs none).

The export runs in threads of its own (the rows are converted as they are read), the store is
async: the log's connection lives on an event loop in a thread of its own, and ``get`` waits
there for each image.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading

from consumers.errors import ExportError
from eventlog.errors import ImageAltered, ImageMissing
from eventlog.objects import JetStreamImageStore
from schemas.errors import EventLogUnavailable
from turnstream.stack.event_log import open_log
from turnstream.stack.settings import ServiceSettings
from turnstream.stack.stack_file import join_stack

__all__ = ["LogImages"]

CLOSE_TIMEOUT_S = 30.0


class LogImages:
    """``consumers.export_images.ImageSource`` over the log's image store (see the module
    docstring); a context manager that closes the log it opened."""

    def __init__(self, settings: ServiceSettings) -> None:
        self.settings = settings
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._store: JetStreamImageStore | None = None
        self._stop: asyncio.Event | None = None
        self._serving: concurrent.futures.Future[None] | None = None

    def __enter__(self) -> LogImages:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def get(self, digest: str) -> bytes:
        store = self._store or self._open()
        assert self._loop is not None
        try:
            return asyncio.run_coroutine_threadsafe(store.get(digest), self._loop).result()
        except (ImageMissing, ImageAltered) as exc:
            raise ExportError(
                f"{exc}. The export writes every image its rows show: export the rows without "
                f"that one (--where), or put the image back; nothing was written"
            ) from exc
        except EventLogUnavailable as exc:
            raise ExportError(f"reading the images of the export from the log: {exc}") from exc

    def _open(self) -> JetStreamImageStore:
        settings, _ = join_stack(self.settings)
        if settings.log.url is None and not settings.nats_store_dir.is_dir():
            raise ExportError(
                f"the rows show images, whose bytes are in the log's image store, and "
                f"{settings.data_dir} has no log (no {settings.nats_store_dir}) and no "
                f"`turnstream up` running: give the log with --log.url nats://HOST:4222 (or "
                f"the --data-dir whose log holds the run), or export --kind tokens; nothing "
                f"was written"
            )
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._thread = threading.Thread(target=loop.run_forever, name="export-images", daemon=True)
        self._thread.start()
        opened: concurrent.futures.Future[JetStreamImageStore] = concurrent.futures.Future()
        self._serving = asyncio.run_coroutine_threadsafe(self._serve(settings, opened), loop)
        try:
            self._store = opened.result()
        except EventLogUnavailable as exc:
            raise ExportError(
                f"the rows show images, whose bytes are in the log's image store, and the log "
                f"cannot be read: {exc}; nothing was written"
            ) from exc
        return self._store

    async def _serve(
        self,
        settings: ServiceSettings,
        opened: concurrent.futures.Future[JetStreamImageStore],
    ) -> None:
        """The log, open until ``close``."""
        self._stop = asyncio.Event()
        try:
            async with open_log(settings, name="turnstream-export") as event_log:
                opened.set_result(await JetStreamImageStore.open(event_log.nc, settings.log))
                await self._stop.wait()
        except BaseException as exc:
            if not opened.done():
                opened.set_exception(exc)
            raise

    def close(self) -> None:
        loop = self._loop
        if loop is None:
            return
        if self._stop is not None:
            loop.call_soon_threadsafe(self._stop.set)
        if self._serving is not None:
            # its opening failed: raised to the export already
            with contextlib.suppress(Exception):
                self._serving.result(CLOSE_TIMEOUT_S)
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(CLOSE_TIMEOUT_S)
        loop.close()
        self._loop = None
