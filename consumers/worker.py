"""The fold worker: each SessionClosed in, that session's trajectories out to TRAJ (DESIGN §1, §5).

A thin loop around pure decisions::

    fetch close -> already folded? -> read the session back -> fold -> publish trajectories
                -> mark folded -> ack the close

Every process runs this loop on one shared durable pull consumer (``fold``) filtered on
``ts.ev.*.*.close``, so JetStream spreads the closes over the processes and gives a dead
process's unacked closes to the others. Exactly-once into TRAJ comes from four layers:

- the close is acked only after JetStream acknowledged every TrajectoryReady;
- each TrajectoryReady carries ``Nats-Msg-Id`` = trajectory id, so a fold repeated inside the
  duplicate window is absorbed by the stream;
- a marker in the ``ts_folded`` bucket, written before the ack, makes a close redelivered after
  the window (a worker stalled for minutes) a no-op;
- a close redelivered without a marker and old enough that an earlier delivery's trajectories may
  be past the window (the worker or nats-server died between the TRAJ acks and the marker, and
  the close came back minutes later) first looks in TRAJ for what that delivery stored
  (``republish_could_duplicate``, ``stored_msg_ids``) and publishes only the rest. Only such
  redeliveries pay for the look; a first delivery reads and writes nothing more.

The worker is a handler of the one pull loop (``eventlog.loop.PullLoop``), which fetches,
keeps the close alive while it folds, acks, and dead-letters what the handler rejects or what
``eventlog.dispositions.disposition`` gives up on (bad input at once, anything else after
``max_deliver`` tries).

**Trust.** The close must match its subject and carry a Msg-Id, or it is dead-lettered
(``subject_mismatch``, ``no_msg_id``) and nothing is folded. The session's events are vetted
the same way (``schemas.trust.vet_session``): an event stored under another subject, without a
Msg-Id, or a second different turn *t* (the one the stream stored first wins) is dead-lettered
and left out of the fold; the trajectories' metadata counts ``conflicting_turns``. Bytes that are
no event at all stop the fold: the session is dead-lettered with the bad event's bytes.
A trajectory naming an image the log's image store lacks, or holds altered (bytes that do not
hash to the name), is not published: the turn that named it is dead-lettered with the reason
(``image_missing``, ``image_altered``) and the trajectories left out; the session's other
trajectories are published. (An event whose images do not fit its prompt never decodes:
``TurnCompleted`` refuses it.) Without an image store (``images=None``) nothing is checked.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import logging
import time
from dataclasses import dataclass
from typing import Protocol

import msgspec

from consumers.config import FoldWorkerSettings
from consumers.errors import FoldError
from consumers.fold import FoldOptions, FoldResult, fold
from eventlog import (
    ImageAltered,
    ImageMissing,
    JetStream,
    Publisher,
    StreamNames,
    read_session_messages,
)
from eventlog.buckets import Bucket
from eventlog.loop import ACK, Delivery, Outcome, PullLoop, Reject
from eventlog.metrics import ConsumerMetrics, LoopMetrics
from eventlog.pull import ConsumerSpec
from eventlog.reader import stored_msg_ids
from eventlog.streams import stream_facts
from schemas.codec import Codec
from schemas.events import CompactTrajectory, SessionClosed, SessionOpened, TurnCompleted
from schemas.ids import EVENT_SUBJECT_PREFIX, traj_subject
from schemas.trust import PoisonEvent, StoredMessage, VettedSession, check_stored, vet_session

__all__ = [
    "FoldMarker",
    "FoldWorker",
    "ImageReader",
    "WorkerStats",
    "fold_options",
    "fold_session",
    "republish_could_duplicate",
]

log = logging.getLogger(__name__)

CLOSE_FILTER = f"{EVENT_SUBJECT_PREFIX}.*.*.close"
SOURCE = "fold"
# How far before a close TRAJ is searched for an earlier delivery's trajectories: the close and
# the trajectories may be stamped by different servers' clocks (streams led by different nodes).
CLOCK_SKEW_S = 5.0


class ImageReader(Protocol):
    """What the worker needs of the log's image store (``eventlog.ImageStore``)."""

    async def get(self, digest: str) -> bytes:
        """The bytes named ``digest``: ``ImageMissing`` / ``ImageAltered`` when it cannot."""
        ...


class FoldMarker(msgspec.Struct, frozen=True):
    """What the ``ts_folded`` bucket keeps per folded session (key ``<run>.<session>``)."""

    trajectories: int
    fold_version: int
    close_seq: int
    forks: int = 0
    late_events: int = 0
    folded_at: float = 0.0


@dataclass
class WorkerStats:
    sessions_folded: int = 0
    trajectories: int = 0
    already_folded: int = 0  # closes redelivered after their session was folded
    already_published: int = 0  # trajectories an earlier delivery stored past the dup window
    late_events: int = 0  # events the fold left out because they came after the close
    forks: int = 0
    untrusted_events: int = 0  # events of folded sessions left out (schemas.trust)
    without_images: int = 0  # trajectories left out: an image missing or altered in the store


def fold_options(defaults: FoldWorkerSettings, opened: SessionOpened | None) -> FoldOptions:
    """The worker's fold options, overridden by the session's ``metadata["fold"]``.

    An agent (or whoever opens the session) may ask for step-wise samples of its own session:
    ``{"fold": {"per_turn": true}}``. A value of the wrong type is a FoldError.
    """
    override = opened.metadata.get("fold", {}) if opened is not None else {}
    where = f"run={opened.run} session={opened.session}" if opened is not None else ""
    if not isinstance(override, dict):
        raise FoldError(f"{where}: metadata.fold must be an object, got {override!r}")
    unknown = set(override) - {"per_turn", "final_reward_scope"}
    per_turn = override.get("per_turn", defaults.per_turn)
    scope = override.get("final_reward_scope", defaults.final_reward_scope)
    if unknown or not isinstance(per_turn, bool) or scope not in ("last", "all"):
        raise FoldError(
            f"{where}: metadata.fold={override!r} is not valid: it takes per_turn (true/false) "
            f"and final_reward_scope ('last' or 'all') only"
        )
    return FoldOptions(per_turn=per_turn, final_reward_scope=scope)


def fold_session(
    vetted: VettedSession, defaults: FoldWorkerSettings, *, per_turn: bool | None = None
) -> FoldResult:
    """How the worker folds one vetted session (``schemas.trust.vet_session``). Pure.

    The options are ``fold_options`` (the worker's defaults, overridden by the session's
    ``metadata["fold"]``; ``per_turn``, when given, overrides both). When the vetting left out
    conflicting turns, every trajectory's metadata counts them (``conflicting_turns``).
    ``turnstream refold`` folds with this too, so a refold is the worker's fold, byte for byte.
    """
    opened = next((e for e in vetted.events if isinstance(e, SessionOpened)), None)
    options = fold_options(defaults, opened)
    if per_turn is not None:
        options = dataclasses.replace(options, per_turn=per_turn)
    result = fold(vetted.events, options)
    if not vetted.conflicting_turns:
        return result
    count = {"conflicting_turns": vetted.conflicting_turns}
    return dataclasses.replace(
        result,
        compact_trajectories=[
            msgspec.structs.replace(t, metadata={**t.metadata, **count})
            for t in result.compact_trajectories
        ],
    )


def republish_could_duplicate(*, delivery: int, close_age_s: float, window_s: float) -> bool:
    """Could an earlier delivery's trajectories be outside TRAJ's duplicate window by the time
    this delivery's republish is stored? Then TRAJ must be searched before publishing.

    An earlier delivery published after the close was stored, so a republish stored within one
    window of the close is absorbed by its Msg-Id. Half the window is kept for what lies between
    this check and the stored republish (rehydrating and folding the session, the publisher's
    retry horizon, ~10 s by default) and for skew between this host's clock and the server's:
    with the default 120 s window, redeliveries of closes older than 60 s are checked.

    >>> republish_could_duplicate(delivery=3, close_age_s=90.0, window_s=120.0)
    True
    >>> republish_could_duplicate(delivery=1, close_age_s=900.0, window_s=120.0)  # no earlier one
    False
    """
    return delivery > 1 and close_age_s >= window_s / 2


class FoldWorker:
    """One process's share of the fold: call ``run(stop)``; it returns after ``stop`` is set
    and the closes it had taken are finished."""

    def __init__(
        self,
        js: JetStream,
        publisher: Publisher,
        settings: FoldWorkerSettings | None = None,
        names: StreamNames | None = None,
        *,
        codec: Codec | None = None,
        max_payload: int = 8 * 1024 * 1024,
        metrics: ConsumerMetrics | None = None,
        images: ImageReader | None = None,
    ) -> None:
        self._js = js
        self._publisher = publisher
        self._images = images
        self.settings = settings or FoldWorkerSettings()
        self.names = names or StreamNames()
        self._codec = codec or Codec(max_payload=max_payload)
        self.stats = WorkerStats()
        self._markers: Bucket | None = None
        self._traj_window_s: float | None = None
        self.loop = PullLoop(
            js,
            ConsumerSpec.of(
                self.settings, stream=self.names.events, filter_subjects=[CLOSE_FILTER]
            ),
            self,
            publisher=publisher,
            source=SOURCE,
            max_payload=max_payload,
            concurrency=self.settings.concurrency,
            metrics=metrics.loop(SOURCE) if metrics else LoopMetrics.disabled(),
        )

    async def run(self, stop: asyncio.Event) -> None:
        self._markers = await Bucket.open(self._js, self.names.folded_bucket)
        await self.loop.run(stop)

    async def handle(self, delivery: Delivery) -> Outcome:
        """One close: fold its session unless that was done; raises what should be retried."""
        close = check_stored(delivery.stored, self._codec.decode(delivery.data))
        if not isinstance(close, SessionClosed):
            raise FoldError(f"{delivery.subject} holds a {type(close).__name__}")
        assert self._markers is not None
        key = f"{close.run}.{close.session}"
        if await self._markers.get(key) is not None:
            self.stats.already_folded += 1
            return ACK
        stored = await read_session_messages(
            self._js,
            close.run,
            close.session,
            stream=self.names.events,
            batch=self.settings.rehydrate_batch,
        )
        try:
            vetted = vet_session(stored, self._codec)
        except PoisonEvent as exc:
            return Reject(
                exc.reason,
                f"{type(exc.error).__name__}: {exc.error} (the session is not folded; its "
                f"close is {delivery.subject} seq {delivery.seq})",
                about=exc.stored,
            )
        await self._dead_letter_untrusted(delivery, vetted)
        result = fold_session(vetted, self.settings)
        trajectories = await self._with_images_stored(delivery, vetted, stored, result)
        await self._publish_unstored(delivery, close, trajectories)
        marker = FoldMarker(
            trajectories=len(trajectories),
            fold_version=trajectories[0].fold_version if trajectories else 0,
            close_seq=delivery.seq,
            forks=result.forks,
            late_events=result.late_events,
            folded_at=time.time(),
        )
        await self._write_marker(key, marker)
        self._count(close, result)
        return ACK

    async def _write_marker(self, key: str, marker: FoldMarker) -> None:
        assert self._markers is not None
        await self._markers.put(key, msgspec.json.encode(marker))

    async def _dead_letter_untrusted(self, delivery: Delivery, vetted: VettedSession) -> None:
        """Letters for the events the fold leaves out; published before the fold's output, so a
        failure retries the whole close (the letters' Msg-Ids make the repeat harmless)."""
        for stored, error in vetted.rejected:
            await self.loop.dead_letter(
                delivery, Reject(error.reason, f"UntrustedEvent: {error}", about=stored)
            )
        self.stats.untrusted_events += len(vetted.rejected)

    async def _with_images_stored(
        self,
        delivery: Delivery,
        vetted: VettedSession,
        stored: list[StoredMessage],
        result: FoldResult,
    ) -> list[CompactTrajectory]:
        """The trajectories whose every image the store holds as named (read back and hashed:
        ``ImageReader.get``); for the others, a dead letter per turn that named a bad image,
        published before anything else (a failure retries the close; Msg-Ids absorb repeats)."""
        trajectories = result.compact_trajectories
        digests = sorted({ref.sha256 for t in trajectories for ref in t.images})
        if self._images is None or not digests:
            return trajectories
        found = await asyncio.gather(*(self._image_problem(d) for d in digests))
        bad = {d: problem for d, problem in zip(digests, found, strict=True) if problem}
        if not bad:
            return trajectories
        left_out = [
            t.trajectory_id for t in trajectories if any(ref.sha256 in bad for ref in t.images)
        ]
        named = ", ".join(left_out)
        by_seq = {message.seq: message for message in stored}
        for event, seq in zip(vetted.events, vetted.seqs, strict=True):
            if not isinstance(event, TurnCompleted):
                continue
            mine = [bad[r.sha256] for r in event.images if r.sha256 in bad]
            if mine:  # the turn that brought the image in, not those that kept it in the prefix
                reason = mine[0].reason
                error = "; ".join(dict.fromkeys(str(p) for p in mine))
                await self.loop.dead_letter(
                    delivery,
                    Reject(
                        reason,
                        f"{type(mine[0]).__name__}: {error} (turn {event.turn}; trajectories "
                        f"not published: {named})",
                        about=by_seq[seq],
                    ),
                )
        self.stats.without_images += len(left_out)
        return [t for t in trajectories if t.trajectory_id not in left_out]

    async def _image_problem(self, digest: str) -> ImageMissing | ImageAltered | None:
        assert self._images is not None
        try:
            await self._images.get(digest)
        except (ImageMissing, ImageAltered) as exc:
            return exc
        return None

    async def _publish_unstored(
        self, delivery: Delivery, close: SessionClosed, trajectories: list[CompactTrajectory]
    ) -> None:
        """Publish the trajectories that no earlier delivery of this close stored in TRAJ."""
        if not trajectories:
            return
        if republish_could_duplicate(
            delivery=delivery.delivery,
            close_age_s=time.time() - delivery.stored_at,
            window_s=await self._traj_duplicate_window_s(),
        ):
            since = datetime.datetime.fromtimestamp(
                delivery.stored_at - CLOCK_SKEW_S, tz=datetime.UTC
            )
            stored = await stored_msg_ids(
                self._js,
                self.names.trajectories,
                traj_subject(close.run),
                [t.trajectory_id for t in trajectories],
                since=since,
            )
            if stored:
                self.stats.already_published += len(stored)
                log.warning(
                    "run=%s session=%s: %d of %d trajectories already in %s from an earlier "
                    "delivery of the close (past the duplicate window); not published again",
                    close.run,
                    close.session,
                    len(stored),
                    len(trajectories),
                    self.names.trajectories,
                )
                trajectories = [t for t in trajectories if t.trajectory_id not in stored]
        if trajectories:
            await self._publisher.publish_many(trajectories)

    async def _traj_duplicate_window_s(self) -> float:
        """TRAJ's duplicate window as the server has it (an operator may have changed it)."""
        if self._traj_window_s is None:
            facts = await stream_facts(self._js, self.names.trajectories)
            self._traj_window_s = facts.duplicate_window_s
        return self._traj_window_s

    def _count(self, close: SessionClosed, result: FoldResult) -> None:
        st = self.stats
        st.sessions_folded += 1
        st.trajectories += len(result.compact_trajectories)
        st.forks += result.forks
        if result.late_events:
            st.late_events += result.late_events
            log.warning(
                "run=%s session=%s: %d late event(s) (after the close) not folded",
                close.run,
                close.session,
                result.late_events,
            )
