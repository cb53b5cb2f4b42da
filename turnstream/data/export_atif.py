"""``turnstream export --kind atif``: one ATIF trajectory (JSON) per session of a run.

    turnstream export --run r1 --kind atif -o DIR [--where ...] [--keep-side-calls]

DIR gets ``data/<session>.json`` — one ATIF document per session (``consumers.atif``), the file
Harbor writes per trial as ``trajectory.json`` and its validator reads — beside
``manifest.json`` and a README.md card, written whole or not at all like every export
(``consumers.export_files``).

A session's samples are gathered as the shards yield them: a session is written once it has
as many as its fold made (metadata ``segments``), so memory holds the sessions still arriving,
not the run. Sessions that a ``--where`` cut (some of their samples match, others not), whose
side calls were left out, or whose samples do not say how many there are (folds before the
``segments`` key), are written at the end with the samples there are.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pyarrow as pa

from consumers.atif import ATIF_SCHEMA_VERSION, session_document
from consumers.export_files import ExportDirectory
from consumers.export_layout import DATA_DIR
from schemas.agents import is_side_call
from schemas.events import TrajectoryReady
from schemas.shards import table_to_trajectories

__all__ = ["AtifSessions", "atif_card", "atif_summary"]

_encode = msgspec.json.Encoder()


@dataclass
class AtifSessions:
    """Shard rows in, one ATIF document per session out to ``directory``."""

    directory: ExportDirectory
    keep_side_calls: bool
    sessions: int = 0
    rows: int = 0  # samples written
    tokens: int = 0
    side_calls: int = 0  # left out
    _pending: dict[str, list[TrajectoryReady]] = field(default_factory=dict)
    _seen: dict[str, int] = field(default_factory=dict)  # samples read, side calls included
    _written: dict[str, int] = field(default_factory=dict)  # documents written per session

    def add(self, shard_rows: pa.Table) -> None:
        for _, sample in table_to_trajectories(shard_rows):
            session = sample.session
            self._seen[session] = self._seen.get(session, 0) + 1
            if not self.keep_side_calls and is_side_call(sample.metadata):
                self.side_calls += 1
            else:
                self._pending.setdefault(session, []).append(sample)
            if _known_count(sample) and self._seen[session] >= sample.expected_segments:
                self._write(session)

    def finish(self) -> None:
        """Write the sessions not all of whose samples came (cut by --where, or side calls)."""
        for session in list(self._pending):
            self._write(session)

    def manifest(self, manifest: dict[str, object]) -> tuple[dict[str, object], str]:
        """``export_run``'s manifest made this export's, and its card."""
        manifest.update(format="json", sessions=self.sessions)
        manifest["atif"] = {"schema_version": ATIF_SCHEMA_VERSION}
        del manifest["columns"]  # documents, not rows
        return manifest, atif_card(manifest)

    def _write(self, session: str) -> None:
        self._seen.pop(session, None)
        samples = self._pending.pop(session, [])
        if not samples:  # only side calls, left out
            return
        document = session_document(samples)
        # A session seen again after it was written (samples of an older fold, which did not
        # say how many it made, split by --where): a document of its own, never overwritten.
        written = self._written.get(session, 0)
        self._written[session] = written + 1
        name = f"{session}.json" if not written else f"{session}.{written}.json"
        self.directory.add_file(name, _encode.encode(document), len(samples))
        self.sessions += 1
        self.rows += len(samples)
        self.tokens += sum(len(s.input_ids) for s in samples)


def _known_count(sample: TrajectoryReady) -> bool:
    """Whether the sample's metadata says how many samples its session's fold made (folds
    before the ``segments`` key said only a lower bound): only then is a session written as
    soon as it has them all."""
    segments = sample.metadata.get("segments")
    return isinstance(segments, int) and not isinstance(segments, bool)


def atif_summary(manifest: dict[str, Any], output: Path) -> str:
    """The line ``turnstream export --kind atif`` ends with."""
    return (
        f"exported {manifest['sessions']:,} ATIF trajectories (sessions; {manifest['rows']:,} "
        f"samples, {manifest['tokens']:,} tokens) of run {manifest['run']} to {output / DATA_DIR}"
    )


def atif_card(manifest: dict[str, object]) -> str:
    """The README.md of an ATIF export: what the files are and how to read them."""
    return f"""# ATIF trajectories of run {manifest["run"]}

{manifest["sessions"]} sessions ({manifest["rows"]} samples, {manifest["tokens"]} tokens) exported
by `turnstream export --kind atif`, one Agent Trajectory Interchange Format document
({ATIF_SCHEMA_VERSION}) per session: `data/<session>.json`.

Each agent step is one LLM call with its `metrics`: the whole prompt's token ids
(`prompt_token_ids`), the sampled ones (`completion_token_ids`) and their `logprobs`. A
session's sub-agents, forks and side calls are embedded in `subagent_trajectories`. Rewards,
weight versions and the session's metadata are under `extra`.

Validate a file with Harbor's models (`harbor.models.trajectories.Trajectory`), or bring the
trajectories back into a log as a run's events with
`turnstream import-atif data/*.json --run RUN`. `manifest.json` lists the files.
"""
