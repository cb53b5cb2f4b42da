"""``turnstream status``: what a running log holds, and the shards.

    turnstream status [--log.url nats://127.0.0.1:4222] [--shards DIR]

Streams (messages, bytes, sequences), consumers (lag, unacked, redelivered), dead letters by
reason, sessions per run (open / closed / folded, from counts the server keeps: nothing is read
event by event) and the committed shards per run. Without ``--log.url`` it reports on the
``turnstream up`` running on ``--data-dir`` (its ``stack.json``), and says which log and which
shard directory it reports on.
"""

from __future__ import annotations

import asyncio
import json

from pydantic import Field
from pydantic_settings import SettingsConfigDict
from rich.console import Console
from rich.table import Table
from rich.text import Text

from eventlog import map_nats_errors
from schemas.errors import EventLogUnavailable, TurnstreamError
from schemas.ids import EVENT_SUBJECT_PREFIX
from turnstream.stack.event_log import EventLog, open_log
from turnstream.stack.settings import ServiceSettings

__all__ = ["StatusCommand"]

console = Console(stderr=True)


class StatusCommand(ServiceSettings):
    """Streams, consumer lag, dead letters, sessions per run and shards of a running log.

    The log is --log.url, else that of the ``turnstream up`` running on --data-dir (its
    stack.json); the shards are --shards, else that stack's, else <data_dir>/shards."""

    model_config = SettingsConfigDict(cli_prog_name="turnstream status")

    shards: str | None = Field(
        None,
        description="shard directory or URI to summarize; unset: stack.json's, else "
        "<data_dir>/shards",
    )

    def cli_cmd(self) -> None:
        from turnstream.stack.stack_file import join_stack, stack_file_path

        settings, stack = join_stack(self)
        if settings.log.url is None:
            raise TurnstreamError(
                f"status needs --log.url (or TURNSTREAM_LOG__URL), or a running `turnstream "
                f"up` on this data dir: {stack_file_path(self.data_dir)} names none"
            )
        from_file = f"from {stack_file_path(self.data_dir)}"
        if self.shards:
            shards, shards_from = self.shards, "--shards"
        elif stack is not None:
            shards, shards_from = stack.shards, from_file
        else:
            shards, shards_from = str(self.data_dir / "shards"), "<data_dir>/shards"
        said = Text.assemble(
            "log ", (settings.log.url, "bold"), f" ({from_file if stack else '--log.url'}); ",
            "shards ", (shards, "bold"), f" ({shards_from})",
        )  # fmt: skip
        console.print(said, soft_wrap=True)  # one line, whatever the paths: grep-able
        asyncio.run(settings._run(shards))

    async def _run(self, shards: str) -> None:
        async with open_log(self, name="turnstream-status") as event_log:
            js = event_log.js
            streams = Table("stream", "messages", "bytes", "first seq", "last seq", "subjects")
            consumers = Table(
                "stream",
                "consumer",
                "waiting (lag)",
                "delivered, not acked",
                "redelivered",
                title="consumers",
            )
            infos = await js.streams_info()
            for info in infos:
                st = info.state
                streams.add_row(
                    info.config.name,
                    f"{st.messages:,}",
                    f"{st.bytes:,}",
                    str(st.first_seq),
                    str(st.last_seq),
                    ", ".join(info.config.subjects or []),
                )
                name = info.config.name or ""
                for c in await js.consumers_info(name):
                    consumers.add_row(
                        name,
                        c.name,
                        f"{c.num_pending or 0:,}",
                        f"{c.num_ack_pending or 0:,}",
                        f"{c.num_redelivered or 0:,}",
                    )
            console.print(streams)
            if consumers.row_count:
                console.print(consumers)
            names = self.log.names
            if any(info.config.name == names.dead_letters for info in infos):
                dlq = await js.stream_info(names.dead_letters, subjects_filter=">")
                letters = Table("source.reason", "dead letters", title=f"{names.dead_letters}")
                for subject, count in sorted((dlq.state.subjects or {}).items()):
                    letters.add_row(subject.removeprefix("ts.dlq."), f"{count:,}")
                if letters.row_count:
                    console.print(letters)
            console.print(await self._sessions_table(event_log))
        console.print(_shards_table(shards))

    async def _sessions_table(self, event_log: EventLog) -> Table | str:
        """Sessions per run: open (opened, not closed), closed, folded (a ``ts_folded``
        marker). From the subjects the server counts (``ts.ev.<run>.<session>.open``, ...),
        never from reading the events: bounded however long the log."""
        names = self.log.names
        prefix = f"{EVENT_SUBJECT_PREFIX}."
        opened = await self._sessions(event_log, names.events, f"{prefix}*.*.open", prefix)
        closed = await self._sessions(event_log, names.events, f"{prefix}*.*.close", prefix)
        kv = f"$KV.{names.folded_bucket}."
        folded = await self._sessions(event_log, f"KV_{names.folded_bucket}", f"{kv}>", kv)
        runs = sorted({run for run, _ in opened | closed | folded})
        if not runs:
            return f"no sessions in {names.events}"
        table = Table(
            "run",
            "open",
            "closed",
            "folded",
            title="sessions per run",
            caption=f"open: opened, not closed ({names.events}); folded: a marker in "
            f"{names.folded_bucket} (kept {self.log.folded_marker_ttl_s / 86_400:g} days)",
        )
        for run in runs:
            mine = [{s for r, s in group if r == run} for group in (opened, closed, folded)]
            table.add_row(
                run, f"{len(mine[0] - mine[1]):,}", f"{len(mine[1]):,}", f"{len(mine[2]):,}"
            )
        return table

    @staticmethod
    async def _sessions(
        event_log: EventLog, stream: str, subjects: str, prefix: str
    ) -> set[tuple[str, str]]:
        """(run, session) of each subject of ``stream`` matching ``subjects``, read as
        ``<prefix><run>.<session>[.<kind>]``. JetStream answers stream info with at most
        100,000 subjects at a time (nats-py does not page): ``offset`` pages through them."""
        found: set[tuple[str, str]] = set()
        offset = 0
        while True:
            request = json.dumps({"subjects_filter": subjects, "offset": offset}).encode()
            with map_nats_errors(f"counting {subjects} in stream {stream}"):
                reply = await event_log.nc.request(
                    f"$JS.API.STREAM.INFO.{stream}", request, timeout=10
                )
            answer = json.loads(reply.data)
            if "error" in answer:
                raise EventLogUnavailable(
                    f"counting {subjects} in stream {stream}: {answer['error']}"
                )
            page = (answer.get("state") or {}).get("subjects") or {}
            for subject in page:
                run, session = subject.removeprefix(prefix).split(".")[:2]
                found.add((run, session))
            offset += len(page)
            if not page or offset >= int(answer.get("total") or 0):
                return found


def _shards_table(target: str) -> Table | str:
    """Committed shards per run: files, trajectories, TRAJ sequences (footers only)."""
    from shardstore import FileShardStore  # pyarrow: import on use

    store = FileShardStore(target)
    runs: dict[str, list[int]] = {}  # run -> [shards, rows, first seq, last seq]
    for shard in store.committed():
        meta = store.read_metadata(shard)
        row = runs.setdefault(shard.run, [0, 0, shard.first_seq, shard.last_seq])
        row[0] += 1
        row[1] += meta.rows
        row[2], row[3] = min(row[2], shard.first_seq), max(row[3], shard.last_seq)
    if not runs:
        return f"no shards under {store.display(store.root)}"
    table = Table("run", "shards", "trajectories", "TRAJ seqs", title=f"shards: {target}")
    for run, (files, rows, first, last) in sorted(runs.items()):
        table.add_row(run, f"{files:,}", f"{rows:,}", f"{first}..{last}")
    return table
