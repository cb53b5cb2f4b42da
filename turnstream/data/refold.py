"""``turnstream refold``: a run's stored events folded again, published as a new run (DESIGN §9).

    turnstream refold --log.url nats://127.0.0.1:4222 --run r1 [--into r1b]
                      [--mode merge|per_turn] [--sessions s1,s2]

Every closed session of run R (``--sessions``: only those) is read back from EVENTS and folded
exactly as the fold worker folds it: the same rehydration (``read_session_messages``), the same
vetting (``schemas.trust.vet_session``: events that disagree with their subject, carry no
Msg-Id or conflict with an earlier turn are left out and ``conflicting_turns`` counted) and the
same fold (``consumers.worker.fold_session``). The events' run is set to R2 before the fold, so
the trajectories are R2's (``R2/<session>/<segment>``); each is published on ``ts.traj.R2`` with
its id as Msg-Id, so the shard writer writes them under ``run=R2`` and live sinks take them.
With an unchanged fold, every trajectory is byte-identical to the worker's, but for its run and
id. The events are folded whole (only their run is set), so a turn's images travel with it: they
are named by digest, in the same log's image store, so R2 needs no copy of them.
``--mode per_turn`` makes every turn its own sample, ``--mode merge`` one sample per segment,
for every session; unset, each session folds as the worker folded it (merge, unless the session
asked otherwise in ``metadata.fold``).

R2 defaults to a fresh ``<R>-refold-<unix time>``, printed. A run TRAJ already holds
trajectories of is refused: refolding into it would mix two folds. Sessions not folded are
listed with why: not closed, their close or an event dead-lettered by the fold, a fold error.
EVENTS is only read. Without ``--log.url`` the log of the ``turnstream up`` running on
``--data-dir`` is used (its ``stack.json``); with none running, the embedded log of
``--data-dir`` is refolded (its nats-server started for the refold), and a later ``turnstream
up`` there writes the shards.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Literal

import msgspec
from pydantic import AliasChoices, Field
from pydantic_settings import SettingsConfigDict
from rich.console import Console
from rich.table import Table

from consumers import FoldWorkerSettings
from consumers.worker import fold_session
from eventlog import JetStreamPublisher, read_session_messages
from eventlog.reader import read_subject
from schemas.codec import Codec
from schemas.errors import SchemaError, TurnstreamError
from schemas.events import SessionClosed, TrajectoryReady
from schemas.ids import EVENT_SUBJECT_PREFIX, ID_PATTERN, traj_subject
from schemas.trust import PoisonEvent, VettedSession, check_stored, vet_session
from turnstream.data.progress import progress_bar
from turnstream.stack.event_log import EventLog, open_log
from turnstream.stack.settings import PublishingSettings
from turnstream.stack.stack_file import join_stack

__all__ = ["RefoldCommand", "RefoldReport", "default_into", "refold_run"]

console = Console(stderr=True)

WINDOW = 32  # sessions read back at once; their trajectories are published in close order
SKIPPED_SHOWN = 20


def default_into(run: str, now: float) -> str:
    """A fresh run id for a refold of ``run``, at most 64 characters.

    >>> default_into("r1", 1700000000.0)
    'r1-refold-1700000000'
    """
    return f"{run[: 64 - 18]}-refold-{int(now)}"


@dataclass
class RefoldReport:
    run: str
    into: str
    sessions_folded: int = 0
    trajectories: int = 0
    forks: int = 0
    skipped: dict[str, str] = field(default_factory=dict)  # session -> why it was not folded


@dataclass(frozen=True)
class _Closes:
    """The run's sessions by their close: folded in close order, the others with a reason."""

    closed: list[str]
    untrusted: dict[str, str]
    opened_only: set[str]


async def _closes(event_log: EventLog, stream: str, run: str, codec: Codec) -> _Closes:
    """Which sessions the worker would fold: those with a close it trusts (the first one)."""
    closed: dict[str, None] = {}  # ordered set
    untrusted: dict[str, str] = {}
    async for stored, _, _ in read_subject(
        event_log.js, stream, f"{EVENT_SUBJECT_PREFIX}.{run}.*.close"
    ):
        session = stored.subject.split(".")[3]
        if session in closed:
            continue
        try:
            close = check_stored(stored, codec.decode(stored.data))
        except SchemaError as exc:
            untrusted.setdefault(session, f"close dead-lettered by the fold ({exc.reason}): {exc}")
            continue
        if isinstance(close, SessionClosed):
            closed[session] = None
            untrusted.pop(session, None)
    opened: set[str] = set()
    async for stored, _, _ in read_subject(
        event_log.js, stream, f"{EVENT_SUBJECT_PREFIX}.{run}.*.open"
    ):
        opened.add(stored.subject.split(".")[3])
    return _Closes(list(closed), untrusted, opened - set(closed) - set(untrusted))


async def _fold_one(
    event_log: EventLog,
    stream: str,
    run: str,
    into: str,
    session: str,
    codec: Codec,
    defaults: FoldWorkerSettings,
    per_turn: bool | None,
) -> tuple[list[TrajectoryReady], int] | str:
    """The session's trajectories under ``into`` and its forks, or why it is not folded."""
    stored = await read_session_messages(event_log.js, run, session, stream=stream)
    try:
        vetted = vet_session(stored, codec)
    except PoisonEvent as exc:
        return f"dead-lettered by the fold ({exc.reason}): {exc}"
    moved = VettedSession(
        [msgspec.structs.replace(e, run=into) for e in vetted.events], vetted.rejected
    )
    try:
        result = fold_session(moved, defaults, per_turn=per_turn)
    except TurnstreamError as exc:
        return f"{type(exc).__name__}: {exc}"
    return result.trajectories, result.forks


async def refold_run(
    settings: PublishingSettings,
    *,
    into: str,
    per_turn: bool | None = None,
    final_reward_scope: Literal["last", "all"] = "all",
    sessions: Collection[str] | None = None,
    progress: bool = True,
) -> RefoldReport:
    """Fold ``settings.run``'s closed sessions again and publish them as run ``into``."""
    run, names = settings.run, settings.log.names
    if into == run:
        raise TurnstreamError(
            f"--into {into} is the run being refolded; its trajectories are already in "
            f"{names.trajectories}: name another run (or leave --into unset for a fresh one)"
        )
    codec = Codec(max_payload=settings.log.max_payload)
    defaults = FoldWorkerSettings(final_reward_scope=final_reward_scope)
    report = RefoldReport(run, into)
    async with open_log(settings, name="turnstream-refold") as event_log:
        info = await event_log.js.stream_info(
            names.trajectories, subjects_filter=traj_subject(into)
        )
        held = sum((info.state.subjects or {}).values())
        if held:
            raise TurnstreamError(
                f"{names.trajectories} already holds {held} trajectories of run {into}; a refold "
                f"into it would mix two folds: pick another --into (or leave it unset)"
            )
        found = await _closes(event_log, names.events, run, codec)
        if not (found.closed or found.untrusted or found.opened_only):
            raise TurnstreamError(
                f"run {run} has no sessions in {names.events}; check --run and --log.url"
            )
        wanted = set(sessions) if sessions is not None else None
        todo = [s for s in found.closed if wanted is None or s in wanted]
        for session, why in found.untrusted.items():
            if wanted is None or session in wanted:
                report.skipped[session] = why
        for session in sorted(found.opened_only):
            if wanted is None or session in wanted:
                report.skipped[session] = "not closed"
        for session in sorted((wanted or set()) - set(todo) - set(report.skipped)):
            report.skipped[session] = f"no events in run {run}"
        publisher = await JetStreamPublisher(event_log.nc, settings.publisher, codec).start()
        try:
            label = f"refolding run {run} into run {into}"
            with progress_bar(label, console, enabled=progress) as bar:
                task = bar.add_task("sessions", total=len(todo))
                for start in range(0, len(todo), WINDOW):
                    window = todo[start : start + WINDOW]
                    folds = await asyncio.gather(
                        *(
                            _fold_one(
                                event_log, names.events, run, into, s, codec, defaults, per_turn
                            )
                            for s in window
                        )
                    )
                    await _publish(publisher, window, folds, report)
                    bar.update(task, advance=len(window))
        finally:
            await publisher.close()
    return report


async def _publish(
    publisher: JetStreamPublisher,
    window: Sequence[str],
    folds: Sequence[tuple[list[TrajectoryReady], int] | str],
    report: RefoldReport,
) -> None:
    trajectories: list[TrajectoryReady] = []
    for session, folded in zip(window, folds, strict=True):
        if isinstance(folded, str):
            report.skipped[session] = folded
            continue
        trajectories += folded[0]
        report.forks += folded[1]
        report.sessions_folded += 1
    if trajectories:
        await publisher.publish_many(trajectories)
    report.trajectories += len(trajectories)


class RefoldCommand(PublishingSettings):
    """Fold a run's stored events again and publish the trajectories under a new run."""

    model_config = SettingsConfigDict(cli_prog_name="turnstream refold")

    run: str = Field(
        "default", pattern=f"^{ID_PATTERN}$", description="the run whose events are folded again"
    )
    into: str | None = Field(
        None,
        pattern=f"^{ID_PATTERN}$",
        description="the run the trajectories are published as; unset: <run>-refold-<unix time>",
    )
    mode: Literal["merge", "per_turn"] | None = Field(
        None,
        description="merge: a sample per segment; per_turn: a sample per turn; unset: as the "
        "worker folded each session (merge, or the session's own metadata.fold)",
    )
    final_reward_scope: Literal["last", "all"] = Field(
        "all", description="'all': every sample carries the final reward; 'last': the last only"
    )
    sessions: list[str] | None = Field(
        None,
        validation_alias=AliasChoices("sessions", "session"),
        description="only these sessions (comma-separated or repeated); unset: every one",
    )

    def cli_cmd(self) -> None:
        into = self.into or default_into(self.run, time.time())
        console.print(f"refolding run {self.run} into run [bold]{into}[/]")
        settings, _ = join_stack(self)  # a running `up` on --data-dir, unless --log.url
        report = asyncio.run(
            refold_run(
                settings,
                into=into,
                per_turn=None if self.mode is None else self.mode == "per_turn",
                final_reward_scope=self.final_reward_scope,
                sessions=self.sessions,
            )
        )
        if report.skipped:
            table = Table("session", "not folded because", title=f"skipped: {len(report.skipped)}")
            for session, why in sorted(report.skipped.items())[:SKIPPED_SHOWN]:
                table.add_row(session, why)
            console.print(table)
        console.print(
            f"refolded run {report.run} into run {report.into}: {report.sessions_folded} sessions "
            f"folded, {report.trajectories} trajectories published to "
            f"{self.log.names.trajectories} ({traj_subject(report.into)}), {report.forks} forks, "
            f"{len(report.skipped)} sessions skipped"
        )
