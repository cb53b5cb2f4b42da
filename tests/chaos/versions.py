"""Each token's policy version, checked on the soak's stored turns (issue 37) (PURE).

The soak's trainer (``tests.chaos.trainer``) publishes versions while the agents' turns run; the
gateways' local backends load each, say with every chunk which version sampled it, and the
gateway continues a generation the load aborted on the new weights (DESIGN §4). A stored turn's
versions are **bad** when:

- its ``version_spans`` do not cover its completion exactly (``TurnCompleted`` refuses that as
  it is decoded; counted here too, should that check ever go);
- a known version is lower than one before it in the same turn (weights only move forward);
- a version was never published by the soak (0, the model the gateways start with, or one of
  the trainer's);
- its ``weight_version`` is not the oldest known version of its tokens (the event's contract);
- a continuation (``sampling["continued"]``, after ``at`` tokens) does not start on a newer
  version than the token before it: the local backend's "abort" ends a generation only for a
  load, and a continuation waits until the new weights are in, so the versions flip exactly at
  the abort point.

Also counted: turns continued, turns whose tokens span more than one version (a continuation,
or a "keep" switch), tokens of unknown version (null: none with the local backend, which
knows each token's version), and turns whose length breaks their ``max_tokens``: more tokens, or
fewer with ``finish_reason`` "length" (a continuation is sent with what is left of the turn's
``max_tokens``, so the turn as a whole stops at it, not short of it or past it).

>>> audit = VersionAudit()
>>> audit.add("s", turn_of([(0, 3), (1, 2)], continued=[3]), published={0, 1})
>>> audit.continued, audit.multi_version, audit.bad
(1, 1, [])
>>> audit.add("s", turn_of([(1, 3), (0, 2)]), published={0, 1})
>>> audit.bad
['s turn 0: version 0 after version 1']
"""

from __future__ import annotations

import itertools
from collections.abc import Collection
from dataclasses import dataclass, field

from schemas.events import TurnCompleted

__all__ = ["VersionAudit", "interrupted", "turn_of", "turn_versions_wrong"]


@dataclass
class VersionAudit:
    turns: int = 0
    continued: int = 0  # turns with sampling["continued"]
    continuations: int = 0  # their entries: resubmissions after an abort
    multi_version: int = 0  # turns whose known tokens span more than one version
    unknown_tokens: int = 0  # tokens whose version is null
    bad: list[str] = field(default_factory=list)
    max_tokens_bad: list[str] = field(default_factory=list)
    # The interrupted turns' log-probs against each version's weights (tests.chaos.logprobs).
    scored: int = 0
    max_logprob_delta: float = 0.0
    logprobs_bad: list[str] = field(default_factory=list)

    def add(self, session: str, turn: TurnCompleted, published: Collection[int]) -> None:
        self.turns += 1
        continued = turn.sampling.get("continued") or []
        self.continued += bool(continued)
        self.continuations += len(continued)
        versions = _versions(turn)
        self.unknown_tokens += sum(v is None for v in versions)
        self.multi_version += len({v for v in versions if v is not None}) > 1
        wrong = turn_versions_wrong(turn, published)
        if wrong:
            self.bad.append(f"{session} turn {turn.turn}: {wrong}")
        n, asked = len(turn.completion_ids), turn.sampling.get("max_tokens")
        if isinstance(asked, int) and (n > asked or (turn.finish_reason == "length" and n < asked)):
            self.max_tokens_bad.append(
                f"{session} turn {turn.turn}: {n} tokens, finish {turn.finish_reason}, "
                f"max_tokens {asked}, continued {continued}"
            )

    def score(
        self, session: str, turn: TurnCompleted, delta: float | None, tolerance: float
    ) -> None:
        """``delta``: the largest |recorded - recomputed| log-prob of ``turn``'s tokens, each
        under its own version's weights (None: a version whose weights are not known)."""
        self.scored += 1
        if delta is None:
            self.logprobs_bad.append(f"{session} turn {turn.turn}: a version of unknown weights")
            return
        self.max_logprob_delta = max(self.max_logprob_delta, delta)
        if delta > tolerance:
            self.logprobs_bad.append(
                f"{session} turn {turn.turn} (versions {turn.version_spans}, continued "
                f"{turn.sampling.get('continued')}): a log-prob {delta:.2g} away from its "
                f"version's weights'"
            )


def interrupted(turn: TurnCompleted) -> bool:
    """Whether a weight update reached ``turn`` while it ran: continued, or its known tokens
    span more than one version."""
    known = {v for v in _versions(turn) if v is not None}
    return bool(turn.sampling.get("continued")) or len(known) > 1


def _versions(turn: TurnCompleted) -> list[int | None]:
    """Each completion token's version, None where unknown."""
    if turn.version_spans is None:
        return [turn.weight_version] * len(turn.completion_ids)
    return [version for version, count in turn.version_spans for _ in range(count)]


def turn_versions_wrong(turn: TurnCompleted, published: Collection[int]) -> str | None:
    """What is wrong with ``turn``'s token versions (the module's list); None: nothing."""
    n = len(turn.completion_ids)
    if turn.version_spans is not None:
        covered = sum(count for _, count in turn.version_spans)
        if covered != n or any(count < 1 for _, count in turn.version_spans):
            return f"version_spans {turn.version_spans} do not cover its {n} tokens"
    versions = _versions(turn)
    known = [v for v in versions if v is not None]
    for before, after in itertools.pairwise(known):
        if after < before:
            return f"version {after} after version {before}"
    never = sorted({v for v in known if v not in published})
    if never:
        return f"version(s) {never} never published"
    if known and turn.weight_version != min(known):
        return f"weight_version {turn.weight_version}, its oldest token's is {min(known)}"
    for entry in turn.sampling.get("continued") or []:
        at = int(entry["at"])
        if 0 < at < n:
            was, now = versions[at - 1], versions[at]
            if was is not None and now is not None and now <= was:
                return f"continued after {at} tokens on version {now}, its tokens before on {was}"
    return None


def turn_of(
    spans: list[tuple[int | None, int]], continued: list[int] | None = None, turn: int = 0
) -> TurnCompleted:
    """A turn of ``spans`` (its tokens all 7), continued after each of ``continued`` tokens:
    for the doctests and tests/unit/test_soak_audit.py."""
    n = sum(count for _, count in spans)
    known = [v for v, _ in spans if v is not None]
    sampling = {"continued": [{"at": at, "seed": None} for at in continued or []]}
    return TurnCompleted(
        run="r",
        session="s",
        turn=turn,
        prompt_ids=[1, 2],
        completion_ids=[7] * n,
        logprobs=[-1.0] * n,
        sampling=sampling if continued else {},
        weight_version=min(known, default=0),
        version_spans=spans if len(spans) > 1 or not known else None,
    )
