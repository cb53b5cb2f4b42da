"""``turnstream record``: a run's raw events from EVENTS into one checksummed file.

    turnstream record --log.url nats://127.0.0.1:4222 --run r1 -o r1.parquet [--since T] [--until T]

Every message of the run (``ts.ev.<run>.>``), in stream order, with its subject, stream sequence,
stored time, Msg-Id and bytes as stored, then every image those events name, its bytes read from
the log's image store and checked against its digest (``consumers.recording`` has the format),
so the file is all a replay needs. An image the store no longer holds (expired, deleted) or
holds altered is left out, named in the footer (``images_missing``), warned about and counted
in the summary: the recording is still written, and says what it lacks. Read-only: the stream,
its consumers and the image store are not changed.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Callable
from pathlib import Path

from pydantic import AliasChoices, Field
from pydantic_settings import SettingsConfigDict
from rich.console import Console

from consumers.recording import (
    IMAGE_BATCH_BYTES,
    RecordedEvent,
    RecordingMeta,
    RecordingWriter,
    images_named,
)
from eventlog.errors import ImageAltered, ImageMissing
from eventlog.objects import JetStreamImageStore
from eventlog.reader import read_subject
from schemas.codec import Codec
from schemas.errors import TurnstreamError
from schemas.ids import EVENT_SUBJECT_PREFIX
from turnstream.data.progress import progress_bar
from turnstream.stack.event_log import open_log, require_log_url
from turnstream.stack.settings import ServiceSettings
from turnstream.stack.stack_file import join_stack

__all__ = ["RecordCommand", "record_run"]

console = Console(stderr=True)

WRITE_BATCH = 4096  # events per Parquet row group write
IMAGE_READS = 8  # images read from the store at once
MISSING_SHOWN = 10  # missing images named one by one in the warning


async def record_run(
    settings: ServiceSettings,
    output: Path,
    *,
    since: dt.datetime | None = None,
    until: dt.datetime | None = None,
    progress: bool = True,
) -> RecordingMeta:
    """Record ``settings.run``'s events and their images to ``output``; the recording's footer
    (``images_missing``: the images named that the store did not hold whole)."""
    stream = settings.log.names.events
    subject = f"{EVENT_SUBJECT_PREFIX}.{settings.run}.>"
    codec = Codec(max_payload=settings.log.max_payload)
    writer = RecordingWriter(output)
    batch: list[RecordedEvent] = []
    named: dict[str, None] = {}  # the images the events name, in order of first naming
    missing: dict[str, str] = {}
    # The file is written while the stream is read: a batch is compressed in a thread while
    # the next one arrives (at most one write in flight, so the rows stay in stream order).
    writing: asyncio.Future[None] | None = None
    try:
        async with open_log(settings, name="turnstream-record") as event_log:
            with progress_bar(f"recording run {settings.run}", console, enabled=progress) as bar:
                task = bar.add_task("events", total=None)
                read = 0
                async for stored, at, left in read_subject(
                    event_log.js, stream, subject, since=since, until=until
                ):
                    batch.append(
                        RecordedEvent(stored.seq, stored.subject, at, stored.msg_id, stored.data)
                    )
                    if stored.subject.endswith(".turn"):
                        named.update(dict.fromkeys(images_named(stored.data, codec)))
                    read += 1
                    if len(batch) >= WRITE_BATCH or left == 0:
                        if writing is not None:
                            await writing
                        writing = asyncio.ensure_future(asyncio.to_thread(writer.append, batch))
                        batch = []
                        bar.update(task, completed=read, total=read + left)
                if writing is not None:
                    await writing
                writer.append(batch)
                if named and writer.count:
                    store = await JetStreamImageStore.open(event_log.nc, settings.log)
                    task = bar.add_task("images", total=len(named))
                    missing = await _record_images(
                        store, list(named), writer, lambda n: bar.update(task, advance=n)
                    )
        if not writer.count:
            window = "".join(
                [f" stored from {since.isoformat()}" if since else "",
                 f" stored until {until.isoformat()}" if until else ""]
            )  # fmt: skip
            raise TurnstreamError(
                f"run {settings.run} has no events in {stream}{window}; check --run "
                f"(and --since/--until) and --log.url"
            )
        if missing:
            _warn_missing(missing, settings.run)
        return await asyncio.to_thread(
            writer.finish,
            stream=stream,
            run=settings.run,
            since=since,
            until=until,
            images_missing=list(missing),
        )
    except BaseException:
        if writing is not None and not writing.done():
            await asyncio.wait([writing])
        writer.abort()
        raise


async def _record_images(
    store: JetStreamImageStore,
    digests: list[str],
    writer: RecordingWriter,
    advance: Callable[[int], object],
) -> dict[str, str]:
    """Read ``digests`` from the store (a few at once) into ``writer``'s image rows, about
    IMAGE_BATCH_BYTES per write; the ones not stored whole, with why."""
    missing: dict[str, str] = {}
    rows: list[tuple[str, bytes]] = []
    size = 0

    async def read(digest: str) -> bytes | None:
        try:
            return await store.get(digest)
        except (ImageMissing, ImageAltered) as exc:
            missing[digest] = str(exc)
            return None

    for start in range(0, len(digests), IMAGE_READS):
        window = digests[start : start + IMAGE_READS]
        for digest, data in zip(window, await asyncio.gather(*map(read, window)), strict=True):
            if data is not None:
                rows.append((digest, data))
                size += len(data)
        if size >= IMAGE_BATCH_BYTES:
            await asyncio.to_thread(writer.append_images, rows)
            rows, size = [], 0
        advance(len(window))
    await asyncio.to_thread(writer.append_images, rows)
    return missing


def _warn_missing(missing: dict[str, str], run: str) -> None:
    console.print(
        f"[bold yellow]warning:[/] {len(missing)} image(s) that events of run {run} name are "
        f"not in the log's image store whole; the recording is written without them (its "
        f"footer names them), and a replay of it cannot restore them:"
    )
    for digest, why in list(missing.items())[:MISSING_SHOWN]:
        console.print(f"  sha256:{digest}: {why}", soft_wrap=True)
    if len(missing) > MISSING_SHOWN:
        console.print(f"  … and {len(missing) - MISSING_SHOWN} more")


class RecordCommand(ServiceSettings):
    """Record a run's raw events (EVENTS) into one portable, checksummed Parquet file."""

    model_config = SettingsConfigDict(cli_prog_name="turnstream record")

    output: Path = Field(
        validation_alias=AliasChoices("o", "output"), description="the recording file to write"
    )
    since: dt.datetime | None = Field(None, description="only events stored at or after this")
    until: dt.datetime | None = Field(None, description="only events stored at or before this")

    def cli_cmd(self) -> None:
        settings, _ = join_stack(self)
        require_log_url(settings, "record")
        meta = asyncio.run(record_run(settings, self.output, since=self.since, until=self.until))
        lacking = (
            f", {len(meta.images_missing)} missing from the store (not recorded)"
            if meta.images_missing
            else ""
        )
        console.print(
            f"recorded {meta.count} events of run {meta.run} ({meta.stream} seq "
            f"{meta.first_seq}..{meta.last_seq}) and {meta.images} images{lacking} to "
            f"{self.output}, sha256 {meta.sha256[:16]}…",
            soft_wrap=True,
        )
