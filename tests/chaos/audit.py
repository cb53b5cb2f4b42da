"""The soak's auditor: what the clients received against the log, the shards and the sink.

Once the system is quiet it checks, for the soak's run:

- every completion a client received is in EVENTS, at the turn its id names, as the first event
  stored for that turn, with the same token strings, logprobs and text;
- every session in EVENTS is closed (by its client, or by the reaper once idle), and every
  session whose client got 200 on close has its close in EVENTS;
- every closed session's trajectories (the pure fold of its stored events) are in the shards,
  each trajectory id in exactly one row;
- every TRAJ message reached the sink and was committed, and none was delivered again after
  the journal line that says its batch's ack was confirmed;
- no stored turn continues another without its whole context, and no completion a client
  received is stored after its session's close (``tests.chaos.seams``: what gateways sharing
  one log without affinity must get right);
- every stored turn's token versions hold together (``tests.chaos.versions``: the soak's
  trainer updates the weights mid-turn; a continued turn must still be what its client got).

``lost`` adds up completions missing from EVENTS, sessions missing from the shards (or never
closed), and TRAJ messages the sink never committed.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats.errors
import nats.js.errors
import numpy as np
from nats.js import JetStreamContext

from consumers.fold import fold
from eventlog import read_session_messages
from schemas.codec import Codec
from schemas.events import SessionClosed, TrajectoryReady, TurnCompleted
from schemas.trust import VettedSession, vet_session
from shardstore import open_shards_dataset
from tests.chaos.agents import AgentSession, Completion
from tests.chaos.logprobs import TOLERANCE, VersionScorer
from tests.chaos.seams import retokenized_continuations, served_after_close
from tests.chaos.versions import VersionAudit, interrupted
from tests.helpers.streams import stream_payloads
from turnstream.data.regenerate import full_prompts

SINK_DURABLE = "soak-sink"
PIPELINE_CONSUMERS = (("EVENTS", "fold"), ("TRAJ", "shard-writer"), ("TRAJ", SINK_DURABLE))


@dataclass
class SinkJournal:
    """The sink consumer's journal, parsed (see ``tests.chaos.sink_consumer``)."""

    # (line, seq, delivery count, unix time)
    deliveries: list[tuple[int, int, int, float | None]] = field(default_factory=list)
    committing: dict[str, tuple[int, list[int]]] = field(default_factory=dict)
    committed: dict[str, tuple[int, float | None]] = field(default_factory=dict)
    abandoned: set[str] = field(default_factory=set)
    starts: int = 0

    @classmethod
    def read(cls, path: Path) -> SinkJournal:
        journal = cls()
        if not path.exists():
            return journal
        for number, line in enumerate(path.read_text().splitlines()):
            match line.split(" "):
                case ["started", *_]:
                    journal.starts += 1
                case ["delivered", seq, count, _, *at]:
                    journal.deliveries.append((number, int(seq), int(count), _time(at)))
                case ["committing", batch, seqs, *_]:
                    journal.committing[batch] = (number, [int(s) for s in seqs.split(",")])
                case ["committed", batch, *at]:
                    journal.committed[batch] = (number, _time(at))
                case ["abandoned", batch, *_]:
                    journal.abandoned.add(batch)
        return journal


def _time(fields: list[str]) -> float | None:
    return float(fields[0]) if fields else None


@dataclass
class SinkAudit:
    traj_messages: int
    delivered: int
    batches_committed: int
    never_committed: list[int]  # TRAJ seqs: the sink never confirmed them and they are unacked
    commit_unconfirmed: int  # acked (the consumer says so) but killed before `committed`
    redelivered_after_commit: int
    # ... of which a nats-server SIGKILL followed the commit within NATS_CRASH_WINDOW_S: the
    # server confirmed the acks but had not yet written the consumer's state
    redelivered_after_commit_nats_crash: int
    redelivered_before_commit: int
    traj_duplicate_ids: int  # the same trajectory id at two TRAJ seqs (the sink drops repeats)


# nats-server 2.15 writes a consumer's ack state asynchronously: in a standalone experiment
# (ack_sync confirmed, then SIGKILL, then restart) acks confirmed less than ~0.1 s before the
# kill were lost and redelivered, whatever sync_interval; after 0.1 s they always survived.
NATS_CRASH_WINDOW_S = 1.0


def audit_sink(
    traj: dict[int, str],
    journal: SinkJournal,
    consumer_acked_all: bool,
    nats_kills: Sequence[float] = (),
) -> SinkAudit:
    committed_at: dict[int, tuple[int, float | None]] = {}
    for batch, (line, at) in sorted(journal.committed.items(), key=lambda kv: kv[1][0]):
        for seq in journal.committing[batch][1]:
            committed_at.setdefault(seq, (line, at))
    in_commit: set[int] = {s for _, seqs in journal.committing.values() for s in seqs}
    seen: Counter[int] = Counter()
    after = after_crash = before = 0
    for line, seq, _count, delivered_at in journal.deliveries:
        commit = committed_at.get(seq)
        if commit is not None and line > commit[0]:
            after += 1
            after_crash += _crash_between(commit[1], delivered_at, nats_kills)
        elif seen[seq]:
            before += 1
        seen[seq] += 1
    uncommitted = [s for s in traj if s not in committed_at]
    # Killed between a confirmed ack and the `committed` line: JetStream has the ack (the
    # consumer has nothing pending) though the journal cannot say so.
    unconfirmed = [s for s in uncommitted if s in in_commit and consumer_acked_all]
    never = sorted(set(uncommitted) - set(unconfirmed))
    ids = Counter(traj.values())
    return SinkAudit(
        traj_messages=len(traj),
        delivered=len(journal.deliveries),
        batches_committed=len(journal.committed),
        never_committed=never,
        commit_unconfirmed=len(unconfirmed),
        redelivered_after_commit=after,
        redelivered_after_commit_nats_crash=after_crash,
        redelivered_before_commit=before,
        traj_duplicate_ids=sum(n - 1 for n in ids.values() if n > 1),
    )


def _crash_between(
    committed_at: float | None, delivered_at: float | None, nats_kills: Sequence[float]
) -> bool:
    if committed_at is None:
        return False
    # The acks were confirmed just before the `committed` line (an fsync apart).
    since = committed_at - 0.5
    until = committed_at + NATS_CRASH_WINDOW_S
    if delivered_at is not None:
        until = min(until, delivered_at)
    return any(since <= kill <= until for kill in nats_kills)


@dataclass
class Report:
    sessions: int = 0  # opened by agents (200)
    turns: int = 0  # 200 answers to chat completions
    outcomes: Counter[str] = field(default_factory=Counter)
    log_sessions: int = 0  # sessions in EVENTS (opens whose answer was lost included)
    reaped: int = 0  # closed by the reaper (status timeout)
    late_turns: list[str] = field(default_factory=list)  # served after the session's close:
    # in EVENTS, but the fold leaves them out (a late event, dead-lettered by the reaper); by
    # turn index against the close's num_turns
    # The same by stream position: received with 200, stored after the session's close event.
    served_after_close: list[str] = field(default_factory=list)
    # Turns that continue a stored turn without its whole context (tests.chaos.seams).
    retokenized: list[str] = field(default_factory=list)
    # closes answered 200 whose event the log dropped as a repeat of the reaper's close (same
    # Msg-Id): the session is folded as `timeout`, without the client's reward
    closes_overridden: list[str] = field(default_factory=list)
    trajectories: int = 0  # shard rows
    duplicated: int = 0
    lost_completions: list[str] = field(default_factory=list)
    lost_sessions: list[str] = field(default_factory=list)
    unclosed: list[str] = field(default_factory=list)
    sink: SinkAudit | None = None
    dead_letters: dict[str, int] = field(default_factory=dict)
    untrusted: Counter[str] = field(default_factory=Counter)  # events the fold would not believe
    versions: VersionAudit = field(default_factory=VersionAudit)  # of the stored turns

    @property
    def lost(self) -> int:
        uncommitted = len(self.sink.never_committed) if self.sink else 0
        return (
            len(self.lost_completions) + len(self.lost_sessions) + len(self.unclosed) + uncommitted
        )


async def log_sessions(js: JetStreamContext, run: str) -> tuple[set[str], set[str]]:
    """(every session with an event in EVENTS, those with a close event) for ``run``."""
    prefix = f"ts.ev.{run}."
    info = await js.stream_info("EVENTS", subjects_filter=f"{prefix}>")
    subjects = info.state.subjects or {}
    sessions = {s[len(prefix) :].rsplit(".", 1)[0] for s in subjects}
    closed = {s[len(prefix) :].rsplit(".", 1)[0] for s in subjects if s.endswith(".close")}
    return sessions, closed


async def pipeline_idle(js: JetStreamContext, run: str) -> tuple[bool, str]:
    """Whether every session is closed and every pipeline consumer has nothing left; why not."""
    try:
        sessions, closed = await log_sessions(js, run)
        if sessions - closed:
            return False, f"{len(sessions - closed)} session(s) not closed yet"
        for stream, durable in PIPELINE_CONSUMERS:
            info = await js.consumer_info(stream, durable)
            if info.num_pending or info.num_ack_pending:
                return False, (
                    f"{stream}/{durable}: {info.num_pending} pending, "
                    f"{info.num_ack_pending} unacked"
                )
    except (nats.errors.Error, TimeoutError) as exc:  # a consumer not made yet, a slow answer
        return False, f"{type(exc).__name__}: {exc}"
    return True, "idle"


def shard_ids(root: Path) -> list[tuple[str, str]]:
    """(trajectory_id, session) of every row of every committed shard."""
    if not root.exists():
        return []
    table = open_shards_dataset(str(root)).to_table(columns=["trajectory_id", "session"])
    return list(zip(table["trajectory_id"].to_pylist(), table["session"].to_pylist(), strict=True))


class Auditor:
    def __init__(
        self,
        js: JetStreamContext,
        run: str,
        tokenizer: Any,
        published_versions: Collection[int] = (0,),
        weights: Mapping[int, Path] | None = None,
    ) -> None:
        """``published_versions``: every policy version the soak's trainer published (or
        tried to), 0 (the served model) included; ``weights``: each one's checkpoint, to check
        the interrupted turns' log-probs against (``tests.chaos.logprobs``; None: not checked)."""
        self.js = js
        self.run = run
        self.tokenizer = tokenizer
        self.published_versions = frozenset(published_versions)
        self.scorer = VersionScorer(weights) if weights is not None else None
        self.codec = Codec()

    async def audit(
        self,
        agent_sessions: Sequence[AgentSession],
        shards: Path,
        journal: Path,
        nats_kills: Sequence[float] = (),
    ) -> Report:
        report = Report()
        report.sessions = sum(s.created for s in agent_sessions)
        report.turns = sum(len(s.completions) for s in agent_sessions)
        report.outcomes = Counter(s.outcome for s in agent_sessions)
        by_name = {s.session: s for s in agent_sessions}
        in_log, _ = await log_sessions(self.js, self.run)
        report.log_sessions = len(in_log)
        rows = shard_ids(shards)
        report.trajectories = len(rows)
        counts = Counter(tid for tid, _ in rows)
        report.duplicated = sum(n - 1 for n in counts.values() if n > 1)
        in_shards: dict[str, set[str]] = defaultdict(set)
        for tid, session in rows:
            in_shards[session].add(tid)
        for name in sorted(in_log | {s.session for s in agent_sessions if s.created}):
            vetted = await self._events(report, name)
            self._check_session(report, name, vetted, by_name.get(name), in_shards[name])
        report.sink = await self._audit_sink(journal, nats_kills)
        report.dead_letters = await self._dead_letters()
        return report

    async def _events(self, report: Report, session: str) -> VettedSession:
        """The session's events as a fold worker believes them (``schemas.trust``: stream
        order, the first stored of two different turns wins); rejects are counted."""
        stored = await read_session_messages(self.js, self.run, session)
        vetted = vet_session(stored, self.codec)
        report.untrusted.update(error.reason for _, error in vetted.rejected)
        return vetted

    def _check_session(
        self,
        report: Report,
        name: str,
        vetted: VettedSession,
        agent: AgentSession | None,
        shard_tids: set[str],
    ) -> None:
        events = vetted.events
        received = agent.completions if agent else []
        report.retokenized += retokenized_continuations(events)
        report.served_after_close += served_after_close(
            events, vetted.seqs, (c.reply for c in received)
        )
        # A reply's id names its turn by the request's reply id (TurnCompleted.reply); the
        # first stored event of one wins, as the fold keeps the first of one turn index.
        first_turns: dict[str, TurnCompleted] = {}
        for event in events:
            if isinstance(event, TurnCompleted):
                first_turns.setdefault(event.reply, event)
                report.versions.add(name, event, self.published_versions)
        self._score_interrupted(report, name, [e for e in events if isinstance(e, TurnCompleted)])
        close = next((e for e in events if isinstance(e, SessionClosed)), None)
        for completion in received:
            stored = first_turns.get(completion.reply)
            if stored is None:
                report.lost_completions.append(f"{name} reply {completion.reply}: not in EVENTS")
            elif not self._same(stored, completion):
                report.lost_completions.append(
                    f"{name} turn {stored.turn}: EVENTS holds other tokens "
                    f"({len(stored.completion_ids)} stored, {len(completion.tokens)} received)"
                )
            elif close and close.num_turns is not None and stored.turn >= close.num_turns:
                report.late_turns.append(
                    f"{name} turn {stored.turn}: served after the session was closed "
                    f"({close.status}, {close.num_turns} turns)"
                )
        if close is None:
            if events:
                report.unclosed.append(f"{name}: in EVENTS, never closed (not reaped)")
            elif agent is not None and agent.outcome == "closed":
                report.unclosed.append(f"{name}: closed with 200, nothing in EVENTS")
            return
        if close.status == "timeout":
            report.reaped += 1
            if agent is not None and agent.outcome == "closed":
                report.closes_overridden.append(
                    f"{name}: its client's close got 200, the log holds the reaper's close "
                    f"(timeout, {close.num_turns} turns, reward {close.reward})"
                )
        expected = {t.trajectory_id for t in fold(events).trajectories}
        missing = expected - shard_tids
        if missing:
            report.lost_sessions.append(
                f"{name} ({close.status}): {len(missing)} of {len(expected)} trajectories "
                f"not in the shards, e.g. {sorted(missing)[0]}"
            )

    def _score_interrupted(self, report: Report, name: str, turns: list[TurnCompleted]) -> None:
        """The log-probs of the turns a weight update reached, under each version's weights."""
        if self.scorer is None or not any(interrupted(t) for t in turns):
            return
        prompts = full_prompts({t.turn: t for t in turns})  # the first stored of each index
        for turn in turns:
            prompt = prompts.get(turn.turn)
            if interrupted(turn) and prompt is not None:
                delta = self.scorer.max_delta(name, prompt, turn)
                report.versions.score(name, turn, delta, TOLERANCE)

    def _same(self, stored: TurnCompleted, received: Completion) -> bool:
        tokens = [
            self.tokenizer.decode([int(i)], skip_special_tokens=False)
            for i in stored.completion_ids
        ]
        return (
            tokens == received.tokens
            and np.array_equal(
                np.asarray(received.logprobs, dtype=np.float32),
                np.asarray(stored.logprobs, dtype=np.float32),
            )
            and stored.text == received.text
        )

    async def _audit_sink(self, journal_path: Path, nats_kills: Sequence[float]) -> SinkAudit:
        traj: dict[int, str] = {}
        for seq, subject, data in await stream_payloads(self.js, "TRAJ"):
            if subject != f"ts.traj.{self.run}":
                continue
            event = self.codec.decode(data)
            assert isinstance(event, TrajectoryReady)
            traj[seq] = event.trajectory_id
        info = await self.js.consumer_info("TRAJ", SINK_DURABLE)
        acked_all = not info.num_pending and not info.num_ack_pending
        return audit_sink(traj, SinkJournal.read(journal_path), acked_all, nats_kills)

    async def _dead_letters(self) -> dict[str, int]:
        try:
            info = await self.js.stream_info("DLQ", subjects_filter=">")
        except nats.js.errors.NotFoundError:  # no DLQ stream: nothing was dead-lettered
            return {}
        return dict(sorted((info.state.subjects or {}).items()))


def examples(items: Iterable[str], n: int = 5) -> list[str]:
    return list(items)[:n]
