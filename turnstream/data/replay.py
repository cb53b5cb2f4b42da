"""``turnstream replay``: a recording's events published into a log again (DESIGN §9).

    turnstream replay r1.parquet --log.url nats://127.0.0.1:4222 [--run NEW] [--rate max|original|N]

The file (``turnstream record``) is verified first: a file whose rows do not match its footer's
count and SHA-256 is refused and nothing is published. Then every event is published, in the
recorded stream order, through the same pipelined publisher the gateway uses (retries with the
same Msg-Id; many events in flight), and the fold workers of that log fold the sessions as they
did the first time.

- **Same run** (no ``--run``): each event's bytes exactly as recorded, on its recorded subject,
  with its recorded Msg-Id.
- **``--run NEW``**: each event is decoded, its run set to NEW and encoded again; its subject
  becomes ``ts.ev.NEW.<session>.<kind>`` and the run part of its Msg-Id NEW. An event stored under
  a subject that disagrees with it (which no fold trusts) keeps its own run, so it stays
  untrusted. A recording holding bytes that are no event cannot be rewritten: it is refused
  (how many, the first one's sequence) before anything is published; replay it into its own
  run instead, where its bytes travel unread.
- **Idempotent**: before publishing, the target run's subjects are scanned for the Msg-Ids
  already stored (``eventlog.reader.msg_id_counts``, any age); those events are skipped and
  counted as ``already stored``. So replaying a file twice, or after an interrupted replay,
  publishes only what the log lacks, inside the stream's duplicate window or long after it
  (where the window alone would store every event a second time). What races the scan is still
  absorbed by the window and counted as ``duplicates``.
- A Msg-Id recorded twice (a second copy the stream stored after its duplicate window: a
  conflicting turn, say) is replayed with ``.again-<seq>`` appended to the later copy's Msg-Id,
  so the replayed stream holds both, in order, and the fold vets them as it did the first time.
- Recorded messages without a Msg-Id (published by something other than turnstream; no fold
  trusts them) are skipped and counted: without one they could not be deduplicated.
- **Images first** (issue 39): a recording holds the images its events name (format 2); each
  is put into the target log's image store (put-if-absent: one the store holds is kept)
  before any event is published, so no replayed event names an image the log lacks. Images
  are named by their bytes, so ``--run NEW`` changes none of them. An image the recording
  lacks (its store had lost it when recorded: the footer's ``images_missing``) and the target
  does not hold is warned about and counted: the fold dead-letters the events naming it.
- ``--rate max`` (default) publishes as fast as the log acknowledges; ``original`` reproduces
  the recorded gaps between stored times; a number N publishes N events per second.

Without ``--log.url`` the events go into the log of the ``turnstream up`` running on
``--data-dir`` (its ``stack.json``); with none running, into the embedded log of ``--data-dir``
(its nats-server started for the replay), for a later ``turnstream up`` there to fold.

**``--regenerate``** publishes nothing: every recorded turn is sent again, with its recorded
sampling (its seed included), to a backend set up as ``turnstream gateway``'s (``--backend``,
``--backend-urls``, ``--model``; unset: the built-in tiny model on ``--data-dir``), and its
tokens compared with the recorded ones (``turnstream.data.regenerate``). Exit code 1 when a turn
differs or fails, or when no turn could be sent again (all recorded without a seed)::

    turnstream replay r1.parquet --regenerate --backend vllm --backend-urls http://gpu1:8000

A turn the gateway continued across a weight update (``sampling["continued"]``) is regenerated
part by part, each against the weights of its own version: ``--checkpoint VERSION=PATH``
(repeatable, local backend) names them; a part whose version has none here, or is unknown, is
reported as not regenerated (``turnstream.data.parts``)::

    turnstream replay r1.parquet --regenerate --checkpoint 3=ckpt/v3 --checkpoint 4=ckpt/v4
"""

from __future__ import annotations

import asyncio
import collections
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, NamedTuple

import msgspec
from pydantic import Field, field_validator
from pydantic_settings import CliPositionalArg, SettingsConfigDict
from rich.console import Console

from consumers.recording import Recording, read_recording
from eventlog import JetStreamPublisher
from eventlog.objects import JetStreamImageStore
from eventlog.reader import msg_id_counts
from schemas.codec import Codec
from schemas.errors import SchemaError, TurnstreamError
from schemas.ids import EVENT_SUBJECT_PREFIX, ID_PATTERN
from turnstream.data.progress import progress_bar
from turnstream.data.regenerate import LOGPROB_TOLERANCE
from turnstream.data.regenerate_command import regenerate_recording
from turnstream.stack.event_log import EventLog, open_log
from turnstream.stack.settings import PublishingSettings
from turnstream.stack.stack_file import join_stack

__all__ = [
    "ReplayCommand",
    "ReplayItem",
    "ReplayPlan",
    "ReplayReport",
    "due_times",
    "plan_replay",
    "publish_paced",
    "publish_unstored",
    "put_images",
    "replay_recording",
    "unstored",
]

console = Console(stderr=True)

# One publish_many_raw call: bounded so the progress bar moves and pacing can interleave; large
# enough that waiting for a batch's last acks costs little next to sending it.
BATCH_EVENTS = 4096
BATCH_BYTES = 16 * 1024 * 1024
PACING_SLICE_S = 0.02  # events due within this much of now go out together
IMAGE_PUTS = 8  # images put at once
_AGAIN = re.compile(r"\.again-\d+$")  # a later copy's Msg-Id suffix (see the module doc)


class ReplayItem(NamedTuple):
    subject: str
    data: bytes
    msg_id: str
    stored_at: float  # the recorded stored time, epoch seconds


@dataclass(frozen=True)
class ReplayPlan:
    """What a replay publishes: the recording's events, rewritten into ``run`` if asked."""

    source_run: str
    run: str
    items: list[ReplayItem]
    without_msg_id: int  # recorded messages that had no Msg-Id: not replayed


@dataclass
class ReplayReport:
    source_run: str
    run: str
    url: str
    events: int  # in the recording
    published: int = 0  # stored anew by this replay
    duplicates: int = 0  # absorbed by the stream's duplicate window
    already_stored: int = 0  # Msg-Id found in the target run before publishing: skipped
    without_msg_id: int = 0  # skipped: nothing to deduplicate them by
    spooled: int = 0  # in the publisher's outbox (an outbox is configured and the log was down)
    images: int = 0  # in the recording, all put into the target's store
    images_held: int = 0  # of those, already in the target's store
    images_missing: list[str] = field(default_factory=list)  # lacked by recording and target


def plan_replay(recording: Recording, into: str | None, codec: Codec) -> ReplayPlan:
    """The items to publish, in recorded order; ``into`` rewrites every event into that run.

    Pure. Raises TurnstreamError, naming the first offending row, for a recording that cannot
    be rewritten (undecodable events) or whose subjects are not its run's.
    """
    source = recording.meta.run
    run = into or source
    prefix = f"{EVENT_SUBJECT_PREFIX}.{source}."
    items: list[ReplayItem] = []
    without_msg_id = 0
    seen: set[str] = set()
    undecodable: list[tuple[int, SchemaError]] = []
    for event in recording.events:
        if not event.subject.startswith(prefix):
            raise TurnstreamError(
                f"recording of run {source}: seq {event.seq} is on {event.subject}, not a subject "
                f"of run {source}; this file was not written by `turnstream record`"
            )
        if not event.msg_id:
            without_msg_id += 1
            continue
        recorded_id = event.msg_id
        if recorded_id in seen:  # the stream stored a second copy past its duplicate window
            recorded_id = f"{recorded_id}.again-{event.seq}"
        seen.add(recorded_id)
        if run == source:
            items.append(ReplayItem(event.subject, event.data, recorded_id, event.stored_at))
            continue
        try:
            decoded = codec.decode(event.data)
        except SchemaError as exc:
            undecodable.append((event.seq, exc))
            continue
        # Only what says it is of the source run moves: a mismatch stays a mismatch.
        data = (
            codec.encode(msgspec.structs.replace(decoded, run=run))
            if decoded.run == source
            else event.data
        )
        own = recorded_id.startswith(f"{source}.")
        msg_id = f"{run}.{recorded_id[len(source) + 1 :]}" if own else recorded_id
        subject = f"{EVENT_SUBJECT_PREFIX}.{run}.{event.subject[len(prefix) :]}"
        items.append(ReplayItem(subject, data, msg_id, event.stored_at))
    if undecodable:
        seq, error = undecodable[0]
        raise TurnstreamError(
            f"recording of run {source}: {len(undecodable)} event(s) cannot be decoded (first: "
            f"seq {seq}: {type(error).__name__}: {error}), so they cannot be rewritten into run "
            f"{run}; nothing was published. Replay the file into its own run (no --run): its "
            f"events are then published as recorded, unread"
        )
    return ReplayPlan(source, run, items, without_msg_id)


def unstored(items: Sequence[ReplayItem], held: Mapping[str, int]) -> list[ReplayItem]:
    """The items the target does not hold yet: of the copies of one Msg-Id (``.again-<seq>``
    ones counted with theirs), the first ``held`` ones are taken as stored.

    >>> a, b, b2 = (ReplayItem("s", b"", m, 0.0) for m in ("r.a", "r.b", "r.b.again-7"))
    >>> [i.msg_id for i in unstored([a, b, b2], {"r.b": 1})]
    ['r.a', 'r.b.again-7']
    >>> unstored([a, b, b2], {"r.a": 1, "r.b": 1, "r.b.again-7": 1})
    []
    """
    left: collections.Counter[str] = collections.Counter()
    for msg_id, copies in held.items():
        left[_AGAIN.sub("", msg_id)] += copies
    todo: list[ReplayItem] = []
    for item in items:
        base = _AGAIN.sub("", item.msg_id)
        if left[base] > 0:
            left[base] -= 1
        else:
            todo.append(item)
    return todo


def due_times(items: Sequence[ReplayItem], rate: str) -> list[float]:
    """When each item is due, in seconds after the replay starts: all at once (``max``), at the
    recorded gaps (``original``), or N per second.

    >>> items = [ReplayItem("s", b"", "m", t) for t in (10.0, 10.5, 12.0)]
    >>> due_times(items, "original"), due_times(items, "4"), due_times(items, "max")
    ([0.0, 0.5, 2.0], [0.0, 0.25, 0.5], [0.0, 0.0, 0.0])
    """
    if rate == "max":
        return [0.0] * len(items)
    if rate == "original":
        first = items[0].stored_at if items else 0.0
        return [max(item.stored_at - first, 0.0) for item in items]
    per_s = float(rate)
    return [i / per_s for i in range(len(items))]


async def replay_recording(
    settings: PublishingSettings,
    path: Path,
    *,
    into: str | None = None,
    rate: str = "max",
    progress: bool = True,
) -> ReplayReport:
    """Verify ``path``, then publish its events into ``settings``' log; what happened."""
    recording = await asyncio.to_thread(read_recording, path)
    plan = await asyncio.to_thread(
        plan_replay, recording, into, Codec(max_payload=settings.log.max_payload)
    )
    async with open_log(settings, name="turnstream-replay") as event_log:
        report = ReplayReport(
            plan.source_run,
            plan.run,
            event_log.url,
            len(recording.events),
            without_msg_id=plan.without_msg_id,
        )
        label = f"replaying run {plan.source_run} into run {plan.run}"
        await put_images(event_log, settings, recording, report, label, progress)
        await publish_unstored(event_log, settings, plan.items, report, label, rate, progress)
    return report


async def put_images(
    event_log: EventLog,
    settings: PublishingSettings,
    recording: Recording,
    report: ReplayReport,
    label: str,
    progress: bool,
) -> None:
    """Put the recording's images into the target log's store, before any event that names
    them is published; count those it already held, and the ones nobody has."""
    lacking = recording.meta.images_missing
    if not (recording.images or lacking):
        return
    store = await JetStreamImageStore.open(event_log.nc, settings.log)

    async def put(digest: str, data: bytes) -> bool:
        held = await store.has(digest)
        await store.put(data)  # held ones too: an old upload is refreshed (eventlog.objects)
        return held

    with progress_bar(label, console, enabled=progress) as bar:
        task = bar.add_task("images", total=len(recording.images))
        images = list(recording.images.items())
        for start in range(0, len(images), IMAGE_PUTS):
            window = images[start : start + IMAGE_PUTS]
            report.images_held += sum(await asyncio.gather(*(put(*image) for image in window)))
            report.images += len(window)
            bar.update(task, advance=len(window))
    report.images_missing = [d for d in lacking if not await store.has(d)]
    if report.images_missing:
        console.print(
            f"[bold yellow]warning:[/] {len(report.images_missing)} image(s) that events of "
            f"the recording name are neither in it (its log had lost them when it was "
            f"recorded) nor in the target's image store; the fold dead-letters the events "
            f"naming them (first: sha256:{report.images_missing[0]})",
            soft_wrap=True,
        )


async def publish_unstored(
    event_log: EventLog,
    settings: PublishingSettings,
    items: Sequence[ReplayItem],
    report: ReplayReport,
    label: str,
    rate: str,
    progress: bool,
) -> None:
    """Publish those of ``items`` whose Msg-Id ``report.run`` does not hold yet, paced at
    ``rate``, under a progress bar: a replay's and an import's last step (``report`` counts)."""
    stream = settings.log.names.events
    held = await msg_id_counts(event_log.js, stream, f"{EVENT_SUBJECT_PREFIX}.{report.run}.>")
    todo = unstored(items, held)
    report.already_stored = len(items) - len(todo)
    publisher = await JetStreamPublisher(
        event_log.nc, settings.publisher, Codec(max_payload=settings.log.max_payload)
    ).start()
    try:
        with progress_bar(label, console, enabled=progress) as bar:
            task = bar.add_task("events", total=len(todo))
            await publish_paced(
                publisher,
                todo,
                due_times(todo, rate),
                report,
                lambda n: bar.update(task, advance=n),
            )
    finally:
        await publisher.close()


async def publish_paced(
    publisher: JetStreamPublisher,
    items: Sequence[ReplayItem],
    dues: Sequence[float],
    report: ReplayReport,
    advance: Callable[[int], object],
) -> None:
    """Publish ``items`` in order, each batch when its first item is due, pipelined."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    i = 0
    while i < len(items):
        wait = dues[i] - (loop.time() - start)
        if wait > 0:
            await asyncio.sleep(wait)
        horizon = loop.time() - start + PACING_SLICE_S
        j, size = i, 0
        while j < len(items) and j - i < BATCH_EVENTS and size < BATCH_BYTES and dues[j] <= horizon:
            size += len(items[j].data)
            j += 1
        receipts = await publisher.publish_many_raw(
            [(item.subject, item.data, item.msg_id) for item in items[i:j]]
        )
        for receipt in receipts:
            if receipt.spooled:
                report.spooled += 1
            elif receipt.duplicate:
                report.duplicates += 1
            else:
                report.published += 1
        advance(j - i)
        i = j


class ReplayCommand(PublishingSettings):
    """Publish a recording's events into a log again (same run, or a new one)."""

    model_config = SettingsConfigDict(cli_prog_name="turnstream replay")

    file: CliPositionalArg[Path] = Field(description="the recording (`turnstream record -o`)")
    run: str = Field(
        "",  # "": the recording's run (a str like every command's run, so no None here)
        pattern=f"^({ID_PATTERN})?$",
        description="publish into this run instead (events, subjects and Msg-Ids rewritten); "
        "unset: the recording's own run",
    )
    rate: str = Field(
        "max",
        description="'max' (as fast as the log acknowledges), 'original' (the recorded gaps "
        "between events), or N events per second",
    )

    regenerate: bool = Field(
        False,
        description="publish nothing: send every recorded turn again to a backend (--backend, "
        "--backend-urls, --model) with its recorded sampling and seed, and compare its tokens; "
        "exit code 1 when any differs",
    )
    backend: Literal["local", "vllm", "sglang"] = Field(
        "local", description="--regenerate: the inference backend, as `turnstream gateway`'s"
    )
    backend_urls: list[str] = Field(
        default_factory=list, description="--regenerate: vllm/sglang replica URLs"
    )
    model: Path | None = Field(
        None,
        description="--regenerate: the model dir (tokenizer; weights for local); unset: the "
        "built-in tiny model",
    )
    model_name: str | None = Field(
        None, description="--regenerate: model name sent to vllm/sglang; unset: the served one"
    )
    max_context: int | None = Field(
        None, description="--regenerate, remote: the model's context length; unset: asked"
    )
    checkpoint: dict[int, Path] = Field(
        default_factory=dict,
        description="--regenerate, local: VERSION=PATH, the weights of a recorded policy "
        "version (a .safetensors file or a checkpoint directory), repeatable: each part of a "
        "turn continued across a weight update is sent to its own version's, and a turn of one "
        "version to its version's where given (else to --model's weights)",
    )
    logprob_tolerance: float = Field(
        LOGPROB_TOLERANCE,
        ge=0,
        description="--regenerate: the largest |Δ log-prob| of a regenerated token that is "
        "still the same",
    )

    @field_validator("rate")
    @classmethod
    def _rate_known(cls, rate: str) -> str:
        if rate in ("max", "original"):
            return rate
        try:
            per_s = float(rate)
        except ValueError:
            per_s = math.nan
        if not (per_s > 0 and math.isfinite(per_s)):
            raise ValueError(f"--rate takes max, original or a positive number, not {rate!r}")
        return rate

    def cli_cmd(self) -> None:
        if self.regenerate:
            if self.run:
                raise TurnstreamError("--regenerate publishes nothing: --run does not apply")
            if self.checkpoint and self.backend != "local":
                raise TurnstreamError(
                    f"--checkpoint loads weights into the local backend; --backend "
                    f"{self.backend} serves the weights its servers hold: leave it out"
                )
            if missing := [f"{v}={p}" for v, p in self.checkpoint.items() if not p.exists()]:
                raise TurnstreamError(f"--checkpoint: no such file or directory: {missing}")
            from turnstream.services.gateway.settings import GatewaySettings

            backend = GatewaySettings(
                data_dir=self.data_dir,
                backend=self.backend,
                backend_urls=self.backend_urls,
                model=self.model,
                model_name=self.model_name,
                max_context=self.max_context,
            )
            checked = asyncio.run(
                regenerate_recording(
                    self.file,
                    backend,
                    self.log.max_payload,
                    self.logprob_tolerance,
                    console,
                    checkpoints=self.checkpoint,
                )
            )
            console.print(f"regenerated {self.file}: {checked.summary()}")
            if not checked.ok:
                raise TurnstreamError(
                    f"{self.file}: not every turn regenerated its recorded tokens "
                    f"({checked.summary()})"
                )
            return
        settings, _ = join_stack(self)  # a running `up` on --data-dir, unless --log.url
        report = asyncio.run(
            replay_recording(settings, self.file, into=self.run or None, rate=self.rate)
        )
        skipped = [
            f"{report.already_stored} already stored (skipped)" if report.already_stored else "",
            f"{report.without_msg_id} without a Msg-Id (skipped)" if report.without_msg_id else "",
            f"{report.spooled} spooled to the outbox" if report.spooled else "",
        ]
        if report.images or report.images_missing:
            skipped.append(
                f"{report.images} images put first ({report.images_held} already held)"
                + (f", {len(report.images_missing)} missing" if report.images_missing else "")
            )
        console.print(
            f"replayed {self.file} (run {report.source_run}, {report.events} events) into run "
            f"{report.run} at {report.url}: {report.published} published, {report.duplicates} "
            f"duplicates absorbed" + "".join(f", {part}" for part in skipped if part)
        )
