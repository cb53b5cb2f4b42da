"""``turnstream import-atif``: ATIF trajectories with token ids as a run's events.

    turnstream import-atif PATH... --run RUN [--log.url nats://...]

Each PATH is an ATIF trajectory file (``trajectory.json`` of a Harbor trial, ``data/*.json`` of
``turnstream export --kind atif``) or a directory searched for ATIF ``*.json`` files (Harbor's
job directories included: its other JSON files are passed over, a trajectory's continuation and
sub-agent files join its session, and the trial's ``result.json`` gives its reward;
``turnstream.data.atif_files``). Every trajectory file that no other one refers to becomes one
session of RUN, with the files it refers to (``consumers.atif_events``): ``SessionOpened``,
one ``TurnCompleted`` per agent step, its rewards, ``SessionClosed``, published through the
gateway's publisher; the
fold workers of that log fold them into trajectories (the shards, the trainer sink, ``export``)
as they fold served sessions. Imported turns record an unknown policy version and log-probs of
kind ``imported``: SFT or off-policy data, never taken for fresh on-policy samples.

Every file is read and converted before anything is published: one without token ids (or not
ATIF) refuses the whole import, naming the file, the trajectory and the step. The session id is
the document's ``session_id`` when it is a valid id (``[A-Za-z0-9_-]{1,64}``), else one derived
from it (or from the file's bytes), so importing the same files again publishes the same
Msg-Ids, which the log's duplicate window absorbs, and events already stored are skipped
(``eventlog.reader.msg_id_counts``) as ``turnstream replay`` does.

Without ``--log.url`` the events go into the log of the ``turnstream up`` running on
``--data-dir``, else into the embedded log of ``--data-dir``, as for ``replay``.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import time
from pathlib import Path

from pydantic import Field
from pydantic_settings import CliPositionalArg, SettingsConfigDict
from rich.console import Console

from consumers.atif_events import ImportedSession, session_events
from consumers.errors import AtifRefused
from schemas.codec import Codec
from schemas.ids import ID_PATTERN
from schemas.routing import route
from turnstream.data.atif_files import gather
from turnstream.data.replay import ReplayItem, ReplayReport, publish_unstored
from turnstream.stack.event_log import open_log
from turnstream.stack.settings import PublishingSettings
from turnstream.stack.stack_file import join_stack

__all__ = ["ImportAtifCommand", "import_atif", "read_sessions"]

console = Console(stderr=True)
_ID = re.compile(f"^{ID_PATTERN}$")


def _session_id(document: object, data: bytes) -> str:
    given = document.get("session_id") if isinstance(document, dict) else None
    if isinstance(given, str) and _ID.match(given):
        return given
    basis = given.encode() if isinstance(given, str) and given else data
    return f"atif-{hashlib.sha256(basis).hexdigest()[:32]}"


def read_sessions(paths: list[Path], run: str, now: float) -> tuple[list[ImportedSession], int]:
    """Every session of the ATIF files under ``paths`` (``turnstream.data.atif_files``) as a
    session of ``run``, and how many JSON files were passed over; AtifRefused at the first that
    cannot be one, or when two would be the same session."""
    found, passed_over = gather(paths)
    sessions: list[ImportedSession] = []
    sources: dict[str, Path] = {}
    for files in found:
        root = files.root
        session = _session_id(root.document, root.data)
        if session in sources:
            raise AtifRefused(
                f"{root.path} and {sources[session]} are both session {session} (their "
                f"session_id), and neither refers to the other: import them into different "
                f"runs; nothing was imported"
            )
        sources[session] = root.path
        imported = session_events(
            root.document,
            run=run,
            session=session,
            source=str(root.path),
            now=now,
            attached=[(str(f.path), f.document) for f in files.attached],
            reward=files.reward,
        )
        sessions.append(imported)
    return sessions, passed_over


async def import_atif(
    settings: PublishingSettings, paths: list[Path], *, progress: bool = True
) -> tuple[list[ImportedSession], int, ReplayReport]:
    """Convert every document under ``paths``, then publish their events into ``settings.run``:
    the sessions, how many JSON files were no ATIF (passed over), and what was published."""
    sessions, passed_over = await asyncio.to_thread(read_sessions, paths, settings.run, time.time())
    codec = Codec(max_payload=settings.log.max_payload)
    items = []
    for session in sessions:
        for event in session.events:
            subject, msg_id = route(event)
            items.append(ReplayItem(subject, codec.encode(event), msg_id, event.created_at))
    async with open_log(settings, name="turnstream-import-atif") as event_log:
        report = ReplayReport("atif", settings.run, event_log.url, len(items))
        label = f"importing {len(sessions)} ATIF trajectories into run {settings.run}"
        await publish_unstored(event_log, settings, items, report, label, "max", progress)
    return sessions, passed_over, report


class ImportAtifCommand(PublishingSettings):
    """ATIF trajectories with token ids as a run's sessions (SFT / off-policy data)."""

    model_config = SettingsConfigDict(cli_prog_name="turnstream import-atif")

    paths: CliPositionalArg[list[Path]] = Field(
        description="ATIF trajectory files (trajectory.json), or directories of *.json files"
    )

    def cli_cmd(self) -> None:
        if "run" not in self.model_fields_set:
            raise AtifRefused(
                "name the run to import into (--run RUN): imported trajectories are not "
                "samples of a running policy, so they go into a run of their own"
            )
        settings, _ = join_stack(self)  # a running `up` on --data-dir, unless --log.url
        sessions, passed_over, report = asyncio.run(import_atif(settings, self.paths))
        skipped = [
            f"{passed_over} JSON files that are no ATIF trajectory passed over"
            if passed_over
            else "",
            f"{report.already_stored} already stored (skipped)" if report.already_stored else "",
            f"{report.spooled} spooled to the outbox" if report.spooled else "",
        ]
        console.print(
            f"imported {len(sessions)} ATIF trajectories ({sum(s.turns for s in sessions)} "
            f"turns) into run "
            f"{report.run} at {report.url}: {report.published} events published, "
            f"{report.duplicates} duplicates absorbed" + "".join(f", {p}" for p in skipped if p),
            soft_wrap=True,
        )
