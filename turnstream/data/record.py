"""``turnstream record``: a run's raw events from EVENTS into one checksummed file.

    turnstream record --log.url nats://127.0.0.1:4222 --run r1 -o r1.parquet [--since T] [--until T]

Every message of the run (``ts.ev.<run>.>``), in stream order, with its subject, stream sequence,
stored time, Msg-Id and bytes as stored (``consumers.recording`` has the format). Read-only: the
stream and its consumers are not changed.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from pathlib import Path

from pydantic import AliasChoices, Field
from pydantic_settings import SettingsConfigDict
from rich.console import Console

from consumers.recording import RecordedEvent, RecordingMeta, RecordingWriter
from eventlog.reader import read_subject
from schemas.errors import TurnstreamError
from schemas.ids import EVENT_SUBJECT_PREFIX
from turnstream.data.progress import progress_bar
from turnstream.stack.event_log import open_log, require_log_url
from turnstream.stack.settings import ServiceSettings
from turnstream.stack.stack_file import join_stack

__all__ = ["RecordCommand", "record_run"]

console = Console(stderr=True)

WRITE_BATCH = 4096  # events per Parquet row group write


async def record_run(
    settings: ServiceSettings,
    output: Path,
    *,
    since: dt.datetime | None = None,
    until: dt.datetime | None = None,
    progress: bool = True,
) -> RecordingMeta:
    """Record ``settings.run``'s events to ``output``; the recording's footer."""
    stream = settings.log.names.events
    subject = f"{EVENT_SUBJECT_PREFIX}.{settings.run}.>"
    writer = RecordingWriter(output)
    batch: list[RecordedEvent] = []
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
        if not writer.count:
            window = "".join(
                [f" stored from {since.isoformat()}" if since else "",
                 f" stored until {until.isoformat()}" if until else ""]
            )  # fmt: skip
            raise TurnstreamError(
                f"run {settings.run} has no events in {stream}{window}; check --run "
                f"(and --since/--until) and --log.url"
            )
        return await asyncio.to_thread(
            writer.finish, stream=stream, run=settings.run, since=since, until=until
        )
    except BaseException:
        if writing is not None and not writing.done():
            await asyncio.wait([writing])
        writer.abort()
        raise


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
        console.print(
            f"recorded {meta.count} events of run {meta.run} ({meta.stream} seq "
            f"{meta.first_seq}..{meta.last_seq}) to {self.output}, sha256 {meta.sha256[:16]}…"
        )
