"""Batching policies (DESIGN §7): samples in, batches and drops out. Pure: no I/O, no clock.

A ``Batcher`` is a state machine the source drives: ``add(sample, now)`` for each trajectory
received, ``tick(now)`` when nothing arrives (group timeouts), ``flush(now)`` at the end of a
finite source. Each returns a ``Decision``: the batches now ready and the samples dropped, each
with its reason. The caller acks dropped samples too (else the live feed redelivers them); it
acks a batch's samples when the trainer commits it. ``now`` is the caller's monotonic clock in
seconds; ``trainer_version`` is the weight version the trainer is at, set by the caller.

Policies (``BatchingSettings.policy``):

- ``count``: ``batch_size`` samples per batch, in arrival order.
- ``tokens``: as many samples, in arrival order, as fit in ``token_budget`` (the sum of their
  ``len(input_ids)``); a batch is released as soon as the next sample would not fit, or when it
  is exactly full. A sample longer than the whole budget can never fit: it is dropped
  (``over_budget``), never sent alone, so that no batch ever exceeds the budget.
- ``groups``: GRPO groups. A group is ``group_size`` *sessions* (rollouts) of one prompt, keyed
  by (run, ``trajectory.group``), with every trajectory of each session: a session cut into
  several segments (forks, per-turn samples) counts once and travels whole. A session's segment
  count is read from its ``metadata["segments"]``, else ``metadata["forks"] + 1`` (exact for a
  fold by segments; for per-turn folds only a lower bound, so a later turn can arrive after its
  group left: it is dropped as ``late_member``). A batch is ``batch_size`` groups, each group's
  samples together and in arrival order. A group still incomplete ``group_timeout_s`` after its
  first member arrived is dropped (``incomplete_group``) or released as it is, by
  ``incomplete_groups``. A further session of a group key already released or full starts a new
  group under the same key (prompts are reused across epochs). With ``drop_uniform_groups``, a
  group whose sessions' rewards are all equal (no GRPO signal; a missing reward counts as 0.0,
  as in ``rm_scores``) is dropped (``uniform_group``), incomplete released groups included.

Group instances (``Sample.uid``, the batch's ``uid``): GRPO normalizes advantages over the samples
that share a uid, so a uid must name one group *instance*, never two. Group names repeat: two runs
reuse them (every demo names its groups g0..g3), and one run sends a prompt again in a later
epoch. A session joins the open instance of its (run, group) key; an instance takes
``group_size`` sessions, and the next session of the key starts a new one (in every policy: count
and tokens batches carry the same uids, so GRPO over them still never pools two instances). An
instance is named after its first member: ``<run>/<group>/<session>.<segment>``. That name is
deterministic for a given stream order, never shared by two instances in one sink, and, since a
committed trajectory is never delivered again, not by instances of two sinks in turn (a restart).

Staleness (``max_staleness``): a sample is stale when ``trainer_version - min_weight_version >
max_staleness``. The *oldest* generated token decides: the policy-gradient ratio is off by
every update since the earliest token was sampled; versions are per token (a turn continued
across a weight update has two), and a token whose version is unknown (``UNKNOWN_VERSION``: a
generation frozen across a swap, DESIGN §4) makes its sample stale under any bound. A sample
with no generated token (no version) is never stale. Stale samples are dropped (``stale``) or
kept with ``stale=True``. ``count`` and ``tokens`` judge a sample on arrival (it only waits for
batch mates); ``groups`` judge a group when it is ready, since it may have waited
``group_timeout_s``: with ``stale="drop"`` one stale member drops the whole group (a partial
group would shift the others' baseline), with ``"flag"`` each stale sample is flagged.

Side calls (``keep_side_calls``, off by default): a sample whose metadata says ``side: true``
(the fold's trajectory of a side request: compaction, auxiliary, side_reply, count_tokens;
``schemas.agents``) is dropped (``side_call``) rather than trained on; the shards keep it. In
``groups`` a session is complete without its side calls (the fold counts them in the metadata's
``side_calls``), so dropping them never holds a group back, redelivered or not.

Duplicates (the live feed is at least once): a trajectory id the batcher holds is always
recognized; of those it already released or dropped, the last ``dedup_window`` are. A
duplicate is dropped (``duplicate``). Caution for the live source: a duplicate of a sample still
uncommitted may be the *same* JetStream message redelivered after ``ack_wait``; acking it acks
the original. ``forget`` undoes the memory of samples handed back for redelivery (a nak).

Two sessions of one group, then a third whose mate never comes:

>>> def sample(session: str, reward: float) -> Sample[None]:
...     return Sample(TrajectoryReady(
...         run="r", session=session, trajectory_id=f"r/{session}/0", group="g", segment=0,
...         status="completed", input_ids=[1, 2], loss_mask=[0, 1], logprobs=[0.0, -1.0],
...         versions=[-1, 3], prompt_len=1, turn_ends=[2], turn_rewards=[None], reward=reward,
...         num_turns=1, finish_reason="stop", messages=[], metadata={}, fold_version=1,
...     ), handle=None)
>>> settings = BatchingSettings(policy="groups", group_size=2, batch_size=1, group_timeout_s=60)
>>> batcher = Batcher[None](settings)
>>> batcher.add(sample("a", 1.0), now=0.0).batches
[]
>>> [batch] = batcher.add(sample("b", 0.0), now=1.0).batches
>>> [(s.trajectory.session, s.uid) for s in batch]
[('a', 'r/g/a.0'), ('b', 'r/g/a.0')]
>>> batcher.add(sample("a", 1.0), now=2.0).dropped[0].reason
'duplicate'
>>> _ = batcher.add(sample("c", 1.0), now=3.0)
>>> batcher.deadline
63.0
>>> [(d.sample.trajectory.session, d.reason) for d in batcher.tick(now=63.0).dropped]
[('c', 'incomplete_group')]
>>> dict(batcher.stats.dropped), batcher.stats.batches
({'duplicate': 1, 'incomplete_group': 1}, 1)
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Generic, Literal, TypeVar

from schemas.agents import is_side_call
from schemas.events import UNKNOWN_VERSION, TrajectoryReady
from trainer_sink.config import BatchingSettings

__all__ = [
    "Batcher",
    "BatchingStats",
    "Decision",
    "DropReason",
    "Dropped",
    "Sample",
    "instance_uid",
]

H = TypeVar("H")
_K = TypeVar("_K")
_V = TypeVar("_V")
DropReason = Literal[
    "duplicate",
    "stale",
    "over_budget",
    "incomplete_group",
    "uniform_group",
    "late_member",
    "side_call",
]
_GroupKey = tuple[str, str]  # (run, group)
_SessionKey = tuple[str, str]  # (run, session)


@dataclass(frozen=True, slots=True)
class Sample(Generic[H]):
    """A trajectory and what its source needs to ack it (a JetStream message; None offline)."""

    trajectory: TrajectoryReady
    handle: H
    stale: bool = False  # set by the batcher: older than max_staleness, kept by stale="flag"
    uid: str = ""  # set by the batcher on release: the group instance (module docstring)


@dataclass(frozen=True, slots=True)
class Dropped(Generic[H]):
    """A sample the batcher will never release; ack it all the same."""

    sample: Sample[H]
    reason: DropReason


@dataclass(frozen=True, slots=True)
class Decision(Generic[H]):
    """What one call released: whole batches (each in the order above) and dropped samples."""

    batches: list[list[Sample[H]]] = field(default_factory=list)
    dropped: list[Dropped[H]] = field(default_factory=list)


@dataclass
class BatchingStats:
    """Counters since the batcher was made."""

    batches: int = 0
    samples: int = 0  # released in batches
    groups: int = 0  # groups released in batches (policy groups), incomplete ones included
    incomplete_groups_released: int = 0
    flagged_stale: int = 0  # samples released with stale=True
    dropped: Counter[DropReason] = field(default_factory=Counter)  # samples, by reason
    dropped_groups: Counter[DropReason] = field(default_factory=Counter)  # groups, by reason


@dataclass
class _Group(Generic[H]):
    number: int  # in order of start
    key: _GroupKey
    uid: str
    started: float
    samples: list[Sample[H]] = field(default_factory=list)  # arrival order
    segments: dict[_SessionKey, int] = field(default_factory=dict)  # expected, per session
    seen: dict[_SessionKey, set[int]] = field(default_factory=dict)

    def complete(self, size: int) -> bool:
        return len(self.segments) == size and all(
            len(self.seen[session]) >= expected for session, expected in self.segments.items()
        )


def instance_uid(first: TrajectoryReady) -> str:
    """The uid of the group instance ``first`` starts (module docstring). Injective: runs and
    sessions are ``[A-Za-z0-9_-]`` ids, so the group name is whatever lies between them."""
    return f"{first.run}/{first.group}/{first.session}.{first.segment}"


@dataclass
class _Instance:
    """count / tokens: the open instance of a (run, group) key."""

    uid: str
    sessions: int = 0


class Batcher(Generic[H]):
    """The batching state machine; see the module docstring for the policies."""

    def __init__(self, settings: BatchingSettings) -> None:
        self.settings = settings
        self.trainer_version: int | None = None  # None: no staleness bound yet
        self.stats = BatchingStats()
        self._now = float("-inf")
        self._held: set[str] = set()  # trajectory ids in a buffer or a pending group
        self._recent: OrderedDict[str, None] = OrderedDict()  # released or dropped ids (LRU)
        self._buffer: list[Sample[H]] = []  # count, tokens
        self._buffer_tokens = 0
        self._pending: dict[int, _Group[H]] = {}  # groups by start: first to time out first
        self._open: dict[_GroupKey, _Group[H]] = {}  # the group of a key taking new sessions
        self._member_of: dict[_SessionKey, _Group[H]] = {}
        self._left: OrderedDict[_SessionKey, None] = OrderedDict()  # sessions of gone groups
        # count / tokens: each recent session's instance, and each key's open instance (LRU)
        self._uid_of: OrderedDict[_SessionKey, str] = OrderedDict()
        self._instances: OrderedDict[_GroupKey, _Instance] = OrderedDict()
        self._ready: list[_Group[H]] = []
        self._next_group = 0

    @property
    def pending(self) -> int:
        """Samples held: added, neither released in a batch nor dropped."""
        return len(self._held)

    @property
    def deadline(self) -> float | None:
        """When the oldest pending group times out: the latest time to call ``tick``."""
        oldest = next(iter(self._pending.values()), None)
        return None if oldest is None else oldest.started + self.settings.group_timeout_s

    def add(self, sample: Sample[H], now: float) -> Decision[H]:
        """Take one received sample; time out the groups due at ``now`` first."""
        out: Decision[H] = Decision()
        self._expire(self._clock(now), out)
        trajectory_id = sample.trajectory.trajectory_id
        if trajectory_id in self._held or trajectory_id in self._recent:
            self._drop(sample, "duplicate", out)
        elif not self.settings.keep_side_calls and is_side_call(sample.trajectory.metadata):
            self._drop(sample, "side_call", out)
        elif self.settings.policy == "groups":
            self._add_to_group(sample, out)
        else:
            self._add_to_buffer(sample, out)
        return out

    def tick(self, now: float) -> Decision[H]:
        """Time out the groups due at ``now``."""
        out: Decision[H] = Decision()
        self._expire(self._clock(now), out)
        return out

    def flush(self, now: float) -> Decision[H]:
        """End of a finite source: release everything held, partial batches included; groups
        still incomplete go by ``incomplete_groups``."""
        out: Decision[H] = Decision()
        self._expire(self._clock(now), out)
        for group in list(self._pending.values()):
            self._finish_group(group, complete=False, out=out)
        if self._buffer:
            self._release_buffer(out)
        if self._ready:
            self._release_groups(out)
        return out

    def forget(self, samples: Iterable[Sample[H]]) -> None:
        """Let these samples (a batch handed back uncommitted) be taken again when redelivered."""
        for sample in samples:
            trajectory = sample.trajectory
            self._recent.pop(trajectory.trajectory_id, None)
            self._left.pop((trajectory.run, trajectory.session), None)

    def drain(self) -> list[Sample[H]]:
        """Take out everything held (buffered, in pending or ready groups) and forget it: for a
        caller closing down, that hands it back to its source."""
        samples = list(self._buffer)
        samples += [s for group in self._pending.values() for s in group.samples]
        samples += [s for group in self._ready for s in group.samples]
        self._buffer, self._buffer_tokens, self._ready = [], 0, []
        self._pending.clear()
        self._open.clear()
        self._member_of.clear()
        self._held.clear()
        self.forget(samples)
        return samples

    # -- count and tokens

    def _add_to_buffer(self, sample: Sample[H], out: Decision[H]) -> None:
        if self._is_stale(sample.trajectory):
            if self.settings.stale == "drop":
                self._drop(sample, "stale", out)
                return
            sample = replace(sample, stale=True)
        sample = replace(sample, uid=self._buffer_uid(sample.trajectory))
        if self.settings.policy == "count":
            self._hold(sample)
            if len(self._buffer) >= self.settings.batch_size:
                self._release_buffer(out)
            return
        length, budget = len(sample.trajectory.input_ids), self.settings.token_budget
        if length > budget:
            self._drop(sample, "over_budget", out)
            return
        if self._buffer_tokens + length > budget:
            self._release_buffer(out)
        self._hold(sample)
        self._buffer_tokens += length
        if self._buffer_tokens == budget:
            self._release_buffer(out)

    def _buffer_uid(self, trajectory: TrajectoryReady) -> str:
        """The instance of the sample's session: the key's open one, or a new one when the open
        one has its ``group_size`` sessions (the same rule as the groups policy)."""
        session: _SessionKey = (trajectory.run, trajectory.session)
        uid = self._uid_of.get(session)
        if uid is None:
            key: _GroupKey = (trajectory.run, trajectory.group)
            instance = self._instances.get(key)
            if instance is None or instance.sessions >= self.settings.group_size:
                instance = _Instance(instance_uid(trajectory))
            instance.sessions += 1
            uid = instance.uid
            self._remember(self._instances, key, instance)
        self._remember(self._uid_of, session, uid)
        return uid

    def _hold(self, sample: Sample[H]) -> None:
        self._held.add(sample.trajectory.trajectory_id)
        self._buffer.append(sample)

    def _release_buffer(self, out: Decision[H]) -> None:
        batch, self._buffer, self._buffer_tokens = self._buffer, [], 0
        self._release(batch, out)

    # -- groups

    def _add_to_group(self, sample: Sample[H], out: Decision[H]) -> None:
        trajectory = sample.trajectory
        session: _SessionKey = (trajectory.run, trajectory.session)
        group = self._member_of.get(session)
        if group is None:
            if session in self._left:
                self._drop(sample, "late_member", out)
                return
            key: _GroupKey = (trajectory.run, trajectory.group)
            group = self._open.get(key)
            if group is None:
                group = _Group(self._next_group, key, instance_uid(trajectory), self._now)
                self._open[key] = group
                self._pending[group.number] = group
                self._next_group += 1
            group.segments[session] = 1
            group.seen[session] = set()
            self._member_of[session] = group
            if len(group.segments) >= self.settings.group_size:
                del self._open[key]  # full: the next session of this key starts a new group
        self._held.add(trajectory.trajectory_id)
        group.samples.append(sample)
        group.segments[session] = max(group.segments[session], self._expected_rows(trajectory))
        group.seen[session].add(trajectory.segment)
        if group.complete(self.settings.group_size):
            self._finish_group(group, complete=True, out=out)

    def _expected_rows(self, trajectory: TrajectoryReady) -> int:
        """The rows of the sample's session this batcher will release: its segments, less
        those of side requests (the fold's ``side_calls``) unless it keeps them."""
        expected = trajectory.expected_segments
        side = trajectory.metadata.get("side_calls")
        if (
            not self.settings.keep_side_calls
            and isinstance(side, int)
            and not isinstance(side, bool)
        ):
            expected -= side
        return max(expected, 1)

    def _expire(self, now: float, out: Decision[H]) -> None:
        # Start times never decrease (see _clock), so the first group not due ends the scan.
        while (oldest := next(iter(self._pending.values()), None)) is not None:
            if now - oldest.started < self.settings.group_timeout_s:
                return
            self._finish_group(oldest, complete=False, out=out)

    def _finish_group(self, group: _Group[H], *, complete: bool, out: Decision[H]) -> None:
        """Take a complete or timed-out group out of the pending ones and judge it."""
        del self._pending[group.number]
        if self._open.get(group.key) is group:
            del self._open[group.key]
        for session in group.segments:
            del self._member_of[session]
            self._remember(self._left, session, None)
        reason = self._group_drop_reason(group, complete)
        if reason is not None:
            self.stats.dropped_groups[reason] += 1
            for sample in group.samples:
                self._drop(sample, reason, out)
            return
        group.samples = [
            replace(s, stale=self._is_stale(s.trajectory), uid=group.uid) for s in group.samples
        ]
        if not complete:
            self.stats.incomplete_groups_released += 1
        self._ready.append(group)
        if len(self._ready) >= self.settings.batch_size:
            self._release_groups(out)

    def _group_drop_reason(self, group: _Group[H], complete: bool) -> DropReason | None:
        if not complete and self.settings.incomplete_groups == "drop":
            return "incomplete_group"
        if self.settings.stale == "drop" and any(
            self._is_stale(s.trajectory) for s in group.samples
        ):
            return "stale"
        if self.settings.drop_uniform_groups:
            rewards = {session: 0.0 for session in group.segments}
            for sample in group.samples:
                trajectory = sample.trajectory
                if trajectory.reward is not None:
                    rewards[(trajectory.run, trajectory.session)] = trajectory.reward
            if len(set(rewards.values())) <= 1:
                return "uniform_group"
        return None

    def _release_groups(self, out: Decision[H]) -> None:
        groups, self._ready = self._ready, []
        self.stats.groups += len(groups)
        self._release([sample for group in groups for sample in group.samples], out)

    # -- shared

    def _release(self, batch: list[Sample[H]], out: Decision[H]) -> None:
        for sample in batch:
            self._forget_held(sample.trajectory.trajectory_id)
        self.stats.batches += 1
        self.stats.samples += len(batch)
        self.stats.flagged_stale += sum(sample.stale for sample in batch)
        out.batches.append(batch)  # the Decision is frozen, its lists are built in place

    def _drop(self, sample: Sample[H], reason: DropReason, out: Decision[H]) -> None:
        trajectory_id = sample.trajectory.trajectory_id
        if reason == "duplicate":
            if trajectory_id in self._recent:
                self._recent.move_to_end(trajectory_id)
        else:
            self._forget_held(trajectory_id)
        self.stats.dropped[reason] += 1
        out.dropped.append(Dropped(sample, reason))

    def _forget_held(self, trajectory_id: str) -> None:
        self._held.discard(trajectory_id)
        self._remember(self._recent, trajectory_id, None)

    def _remember(self, memory: OrderedDict[_K, _V], key: _K, value: _V) -> None:
        memory[key] = value
        memory.move_to_end(key)
        while len(memory) > self.settings.dedup_window:
            memory.popitem(last=False)

    def _is_stale(self, trajectory: TrajectoryReady) -> bool:
        bound, current = self.settings.max_staleness, self.trainer_version
        if bound is None:
            return False
        oldest = trajectory.min_weight_version
        if oldest == UNKNOWN_VERSION:  # a token no one can bound: never taken as fresh
            return True
        if current is None:
            return False
        return oldest >= 0 and current - oldest > bound

    def _clock(self, now: float) -> float:
        # A clock stepping back must not reorder the groups' start times.
        self._now = max(self._now, now)
        return self._now
