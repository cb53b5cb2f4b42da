"""``turnstream export``: a run's trajectories from the shards as a dataset, tokens or messages.

    turnstream export --run r1 --kind tokens|messages --format parquet|jsonl -o DIR
        [--where "reward > 0 and num_turns >= 3"] [--shards URI] [--overwrite]
        [--tokenizer MODEL_DIR | --no-fidelity] [--rows-per-part 100000] [--keep-side-calls]

Reads the shards (``--shards``, default ``<data_dir>/shards``), and the log only for the images
the conversations show (``--log.url``, else the data dir's; ``turnstream.data.export_images``).
``--where`` is a DuckDB SQL predicate over the shard columns. ``tokens`` keeps the training columns,
``messages`` the OpenAI-shaped conversation and tool schemas for SFT (``consumers.export`` has
the columns); DIR is laid out as the Hugging Face Hub lays out a dataset: the parts under
``data/`` (``data/train-00000-of-00002.parquet``), ``manifest.json`` and a dataset card
``README.md`` beside it (``consumers.export_layout``, ``consumers.export_files``,
``consumers.export_formats``), written to a hidden sibling and renamed into place when complete.
It loads with ``datasets.load_dataset(DIR)``, ``pd.read_parquet(DIR/data)``, polars or DuckDB.

For ``messages``, every row is rendered again with the chat template of ``--tokenizer`` (default:
the built-in tiny model, when ``<data_dir>/models`` has it — what the gateway serves by default)
through the gateway's own rendering, and compared with its tokens: the rows that do not
round-trip are counted in the summary and the manifest, and flagged in ``round_trips``.

Conversations that show images (issue 39) are exported as vision chat datasets are: an ``images``
column of ``datasets.Image()`` values (the bytes, read from the log's image store), and
``{"type": "image"}`` in the messages where each sits (``consumers.export_images``); Parquet
only (JSON Lines has no image type: refused, naming ``--format parquet``). Without the log (no
``--log.url``, no log in ``--data-dir``) such an export is refused, naming what it needs.

``--kind atif`` writes one ATIF trajectory (JSON) per session under ``DIR/data/`` instead, for
eval harnesses (``turnstream.data.export_atif``, ``consumers.atif``).

Rows of side requests (metadata ``side: true``: a compaction, auxiliary or side-reply call of a
coding agent, not its own turn) are left out unless ``--keep-side-calls``; the manifest counts
them (``side_calls``).
"""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc
from pydantic import AliasChoices, Field
from pydantic_settings import SettingsConfigDict
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from consumers.export import (
    MESSAGES_IMAGES_SCHEMA,
    MESSAGES_SCHEMA,
    TOKENS_SCHEMA,
    ChatRenderer,
    ExportError,
    ExportKind,
    Fidelity,
    messages_table,
    tokens_table,
    without_side_calls,
)
from consumers.export_files import ExportDirectory, ExportFormat, Selection
from consumers.export_formats import dataset_card
from consumers.export_images import ImageSource
from consumers.export_layout import DATA_DIR
from schemas.errors import TurnstreamError
from schemas.ids import ID_PATTERN
from turnstream.data.export_atif import AtifSessions, atif_summary
from turnstream.data.export_images import LogImages
from turnstream.stack.settings import ServiceSettings

if TYPE_CHECKING:  # transformers: imported only when a chat template is loaded
    from gateway.templates import ChatTemplate

__all__ = ["ExportCommand", "FidelityCheck", "TemplateRenderer", "export_run", "load_renderer"]

console = Console(stderr=True)
JSON = dict[str, Any]
# 2: the parts under data/ (issue 38); 1: at the top of DIR. Each part's "file" is relative to DIR.
MANIFEST_FORMAT = 2


@dataclass(frozen=True)
class FidelityCheck:
    """What renders the ``messages`` rows again (``renderer``, named by ``tokenizer``), or
    why nothing does (``skipped``)."""

    renderer: ChatRenderer | None = None
    tokenizer: str | None = None
    skipped: str | None = None


@dataclass
class _Tally:
    rows: int = 0
    tokens: int = 0
    read: int = 0  # shard rows read, side calls left out included
    side_calls: int = 0  # left out
    dropped: Counter[str] = field(default_factory=Counter)
    image_rows: int = 0  # rows showing at least one image
    images: int = 0  # images shown, a resent one each time


def export_run(
    shards: str,
    run: str,
    output: Path,
    *,
    kind: ExportKind,
    format: ExportFormat,
    where: str | None = None,
    fidelity: FidelityCheck = FidelityCheck(skipped="not asked for"),
    rows_per_part: int = 100_000,
    overwrite: bool = False,
    progress: bool = True,
    batch_rows: int = 1024,
    keep_side_calls: bool = False,
    images: ImageSource | None = None,
) -> JSON:
    """Export ``run``'s shard rows matching ``where`` to ``output``, those of side requests only
    with ``keep_side_calls``; the manifest written. ``images``: where the bytes of the images
    the ``messages`` rows show are (the log's store); needed only when a row shows one."""
    selection = Selection(shards, run, where)
    try:
        total = selection.count()
        if total == 0:
            matching = f"matches --where {where!r}" if where is not None else "is there"
            raise ExportError(
                f"no trajectory of run {run} {matching} (in its {len(selection.sources)} "
                f"shard(s) under {selection.target}); nothing was written"
            )
        schema = MESSAGES_SCHEMA if kind == "messages" else TOKENS_SCHEMA  # atif: no rows
        if kind == "messages" and selection.mentioning_images():
            _can_export_images(run, format, images)
            schema = MESSAGES_IMAGES_SCHEMA
        else:
            images = None
        tally = _Tally()
        check = Fidelity() if kind == "messages" and fidelity.renderer is not None else None
        with (
            ExportDirectory(
                output,
                format=format,
                schema=schema,
                rows_per_part=rows_per_part,
                overwrite=overwrite,
            ) as directory,
            Progress(
                TextColumn(f"exporting run {run} ({kind}, {format})"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[tokens]:,} tokens"),
                TimeElapsedColumn(),
                console=console,
                disable=not progress,
            ) as bar,
        ):
            task = bar.add_task("rows", total=total, tokens=0)
            atif = AtifSessions(directory, keep_side_calls) if kind == "atif" else None
            for shard_rows in selection.batches(batch_rows):
                tally.read += shard_rows.num_rows
                if atif is not None:  # documents per session, not rows
                    atif.add(shard_rows)
                    bar.update(task, completed=tally.read, tokens=atif.tokens)
                    continue
                if not keep_side_calls:
                    shard_rows, side_calls = without_side_calls(shard_rows)
                    tally.side_calls += side_calls
                if kind == "tokens":
                    rows = tokens_table(shard_rows)
                else:
                    rows = messages_table(
                        shard_rows,
                        renderer=fidelity.renderer,
                        fidelity=check,
                        dropped=tally.dropped,
                        images=images,
                    )
                    if images is not None:
                        shown = pc.list_value_length(rows.column("images"))
                        tally.images += int(pc.sum(shown).as_py() or 0)
                        tally.image_rows += int(pc.sum(pc.greater(shown, 0)).as_py() or 0)
                directory.write(rows)
                tally.rows += shard_rows.num_rows
                tally.tokens += _tokens(shard_rows)
                bar.update(task, completed=tally.read, tokens=tally.tokens)
            if atif is not None:
                atif.finish()
                tally.rows, tally.tokens, tally.side_calls = atif.rows, atif.tokens, atif.side_calls
            if tally.rows == 0:
                raise ExportError(
                    f"all {tally.side_calls} trajectories of run {run} that "
                    f"{'match --where' if where is not None else 'are there'} are side calls "
                    f"(compaction, auxiliary, ...); pass --keep-side-calls to export them; "
                    f"nothing was written"
                )
            manifest = _manifest(selection, kind, format, tally, directory, fidelity, check)
            manifest["side_calls"] = {"kept": keep_side_calls, "left_out": tally.side_calls}
            if images is not None:
                manifest["images"] = {"rows": tally.image_rows, "count": tally.images}
            if atif is not None:
                directory.commit(*atif.manifest(manifest))
            else:
                directory.commit(manifest, dataset_card(manifest, schema))
    finally:
        selection.close()
    return manifest


def _can_export_images(run: str, format: ExportFormat, images: ImageSource | None) -> None:
    """Rows that show images are exported with the images' bytes, from the log's store, as
    Parquet: JSON Lines has no image type ``datasets`` loads (base64 text would load as
    text), and the shards hold the images' digests only."""
    if format == "jsonl":
        raise ExportError(
            f"the conversations of run {run} show images, and JSON Lines has no image type "
            f"that datasets loads as images: export them with --format parquet (its images "
            f"column loads as PIL images), or export --kind tokens; nothing was written"
        )
    if images is None:
        raise ExportError(
            f"the conversations of run {run} show images; the shards name them by digest "
            f"only, and their bytes are in the log's image store: give the log (--log.url, "
            f"or the --data-dir of its `turnstream up`), or export --kind tokens; nothing "
            f"was written"
        )


def _tokens(shard_rows: pa.Table) -> int:
    return int(pc.sum(pc.list_value_length(shard_rows.column("input_ids"))).as_py() or 0)


def _manifest(
    selection: Selection,
    kind: ExportKind,
    format: ExportFormat,
    tally: _Tally,
    directory: ExportDirectory,
    fidelity: FidelityCheck,
    check: Fidelity | None,
) -> JSON:
    manifest: JSON = {
        "turnstream_export": MANIFEST_FORMAT,
        "run": selection.run,
        "kind": kind,
        "format": format,
        "where": selection.where,
        "rows": tally.rows,
        "tokens": tally.tokens,
        "parts": [{"file": p.file, "rows": p.rows} for p in directory.parts],
        "columns": {f.name: str(f.type) for f in directory.schema},
        "source": {
            "target": selection.target,
            "shards": [
                {"path": s.path, "first_seq": s.first_seq, "last_seq": s.last_seq}
                for s in selection.sources
            ],
        },
        "created_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "turnstream_version": _version(),
    }
    if kind == "messages":
        if check is not None:
            manifest["fidelity"] = {"tokenizer": fidelity.tokenizer, **check.summary()}
        else:
            manifest["fidelity"] = {"skipped": fidelity.skipped}
        manifest["dropped_message_fields"] = dict(sorted(tally.dropped.items()))
    return manifest


def _version() -> str:
    try:
        return importlib.metadata.version("turnstream")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


# -- the chat template: the gateway's, rendering as the gateway does -----------------------------


class TemplateRenderer:
    """The gateway's ``ChatTemplate`` as the fidelity check's ``ChatRenderer``."""

    def __init__(self, template: ChatTemplate) -> None:
        self.template = template
        self._closing: dict[int | None, list[int]] = {}

    def conversation_ids(self, messages: Sequence[JSON], tools: Sequence[JSON]) -> list[int]:
        from gateway.errors import InvalidRequest

        try:
            text = self.template.render(messages, list(tools) or None, generation=False)
        except InvalidRequest as exc:
            raise ValueError(str(exc)) from exc
        return list(self.template.prompt_ids_of(text, messages))  # images expanded

    def closing_ids(self, last_token: int | None) -> list[int]:
        # As ChatTemplate.continuation_ids closes a turn: its turn-end text, less the stop
        # token the model sampled.
        if last_token not in self._closing:
            tail: str = self.template.turn_end_text
            if last_token is not None and last_token in self.template.stop_token_ids:
                sampled = self.template.decode([last_token], skip_special_tokens=False)
                if tail.startswith(sampled):
                    tail = tail[len(sampled) :]
            self._closing[last_token] = list(self.template.encode(tail))
        return self._closing[last_token]


def load_renderer(model_dir: Path) -> TemplateRenderer:
    """The chat template of the model at ``model_dir``, loaded as the gateway loads it."""
    from transformers import GenerationConfig

    from gateway.images import VisionSpec
    from gateway.templates import ChatTemplate, load_tokenizer

    try:
        tokenizer = load_tokenizer(model_dir)
    except (OSError, ValueError) as exc:
        raise TurnstreamError(
            f"--tokenizer {model_dir}: no tokenizer could be loaded there ({exc}); name the "
            f"model directory the gateway served (its --model), or pass --no-fidelity"
        ) from exc
    try:  # every end token the model may sample closes its turn, as in the gateway
        eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    except OSError:
        eos = None
    stop_ids = [eos] if isinstance(eos, int) else list(eos or [])
    try:
        # Samples are checked whole, whatever their length: the template lifts the tokenizer's
        # own limit, so no "longer than the maximum" warning.
        template = ChatTemplate(
            tokenizer,
            stop_token_ids=stop_ids,
            max_context=sys.maxsize,
            vision=VisionSpec.load(model_dir),  # None for a text model
        )
        return TemplateRenderer(template)
    except ValueError as exc:
        raise TurnstreamError(f"--tokenizer {model_dir}: {exc}") from exc


class ExportCommand(ServiceSettings):
    """Export a run's trajectories from the shards as a dataset (tokens or chat messages)."""

    model_config = SettingsConfigDict(cli_prog_name="turnstream export")

    run: str = Field("default", pattern=f"^{ID_PATTERN}$", description="the run to export")
    output: Path = Field(
        validation_alias=AliasChoices("o", "output"),
        description="directory to write (new or empty; see --overwrite)",
    )
    kind: ExportKind = Field(
        description="tokens: the training columns; messages: chat conversations for SFT; "
        "atif: one ATIF trajectory (JSON) per session, for eval harnesses (Harbor)"
    )
    format: ExportFormat | None = Field(
        None, description="parquet (zstd; the default) or jsonl files; atif writes JSON"
    )
    where: str | None = Field(
        None, description="DuckDB SQL predicate over the shard columns, e.g. 'reward > 0'"
    )
    shards: str | None = Field(
        None, description="shard directory or URI to read; unset: <data_dir>/shards"
    )
    tokenizer: Path | None = Field(
        None,
        description="messages: the served model's directory, whose chat template each row is "
        "checked against; unset: the built-in tiny model if <data_dir>/models has it",
    )
    fidelity: bool = Field(True, description="messages: check the chat-template round trip")
    rows_per_part: int = Field(100_000, ge=1, description="rows per output file")
    overwrite: bool = Field(False, description="replace a non-empty output directory")
    keep_side_calls: bool = Field(
        False,
        description="export the rows of side requests too (metadata side=true: compaction, "
        "auxiliary, side_reply, count_tokens calls); by default they are left out",
    )

    def _fidelity(self) -> FidelityCheck:
        if self.kind != "messages":
            return FidelityCheck(skipped="tokens export")
        if not self.fidelity:
            return FidelityCheck(skipped="--no-fidelity")
        model_dir = self.tokenizer
        if model_dir is None:
            from gateway.model import tiny_model_dir

            model_dir = tiny_model_dir(self.data_dir / "models")
            if not model_dir.is_dir():
                return FidelityCheck(
                    skipped=f"no tokenizer: pass --tokenizer MODEL_DIR (none at {model_dir})"
                )
        return FidelityCheck(renderer=load_renderer(model_dir), tokenizer=str(model_dir))

    def cli_cmd(self) -> None:
        if self.kind == "atif" and self.format is not None:
            raise TurnstreamError(
                f"--kind atif writes one JSON document per session: leave out --format "
                f"{self.format}"
            )
        fidelity = self._fidelity()
        with LogImages(self) as images:  # the log is opened only if a row shows an image
            manifest = export_run(
                self.shards or str(self.data_dir / "shards"),
                self.run,
                self.output,
                kind=self.kind,
                format=self.format or "parquet",
                where=self.where,
                fidelity=fidelity,
                rows_per_part=self.rows_per_part,
                overwrite=self.overwrite,
                keep_side_calls=self.keep_side_calls,
                images=images,
            )
        parts = len(manifest["parts"])
        rows = manifest["rows"]
        if self.kind == "atif":
            console.print(atif_summary(manifest, self.output), soft_wrap=True)
        else:
            console.print(
                f"exported {rows:,} {'trajectory' if rows == 1 else 'trajectories'} "
                f"({manifest['tokens']:,} tokens) of run "
                f"{self.run} as {self.kind} to {self.output} ({parts} {manifest['format']} "
                f"part{'s' if parts != 1 else ''} in {self.output / DATA_DIR}, its card and "
                f"manifest beside)",
                soft_wrap=True,
            )
        if left_out := manifest["side_calls"]["left_out"]:
            console.print(
                f"{left_out:,} side-call {'trajectory' if left_out == 1 else 'trajectories'} "
                f"(compaction, auxiliary, ...) left out: --keep-side-calls exports them",
                soft_wrap=True,
            )
        if self.kind == "messages":
            console.print(_fidelity_line(manifest["fidelity"]), soft_wrap=True)
            if manifest["dropped_message_fields"]:
                console.print(
                    "message fields not exported: "
                    + ", ".join(
                        f"{k} ({v})" for k, v in manifest["dropped_message_fields"].items()
                    ),
                    soft_wrap=True,
                )


def _fidelity_line(fidelity: JSON) -> str:
    if "skipped" in fidelity:
        return f"chat-template round trip not checked: {fidelity['skipped']}"
    line = (
        f"chat-template round trip: {fidelity['round_trips']:,} of {fidelity['checked']:,} rows "
        f"render to exactly their tokens with {fidelity['tokenizer']}"
    )
    if fidelity["not_round_trips"]:
        line += (
            f"; {fidelity['not_round_trips']:,} do not "
            f"({fidelity['not_round_trips_in_forked_sessions']:,} of forked sessions), "
            f"flagged round_trips=false (manifest.json names the first)"
        )
    return line
