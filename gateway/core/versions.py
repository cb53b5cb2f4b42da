"""Which policy version sampled each token of a turn (DESIGN §4: a weight update does not cost
the agent its turn, and unknown stays unknown).

A backend that holds its weights (``local``) says it with every chunk
(``GenerationChunk.weight_version``): that is the token's version. A remote one (vLLM, SGLang)
says nothing per token on the completions API, so the gateway attributes each part of a turn (the
first submission, and each resubmission after an abort) by the contract between trainer and
gateway (docs/ARCHITECTURE.md, "Weight updates mid-turn"):

1. The trainer publishes a version to the policy bucket *before* it resumes the servers that
   serve it (it pauses them, loads the weights, publishes, resumes).
2. So a part's tokens, which flow only once the servers run, were sampled by the version the
   bucket held when the part's first token arrived: read then (``TurnEngine`` reads the bucket
   afresh for a resubmitted part; a first part takes the watched version). A non-streamed
   first part (its client does not stream, so the backend answers once, at the end) takes the
   version as it was submitted instead: its one chunk arrives after all its tokens.
3. A later version published while the part still streams (a trainer that freezes generations
   with ``/pause?mode=keep``, or swaps weights without pausing) makes every token of the part
   that arrived from its publication on (less ``CLOCK_MARGIN_S``, for the clocks of the log's
   server and the gateway) unknown: no backend of ours says which of them came after the swap.
   A non-streamed part arrives at once, so all of it: the whole turn, for a first part frozen
   mid-generation (and, conservatively, one that waited out a pause before it started).
   What is left: a non-streamed continuation that spans a second update is recorded at the
   version the bucket held as it arrived.

``TokenVersions`` keeps the run-length record a turn's event carries
(``TurnCompleted.version_spans``); ``VersionTimeline`` the versions the gateway has seen
published, with the log's time stamp of each.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

__all__ = ["CLOCK_MARGIN_S", "TokenVersions", "VersionTimeline"]

# Tokens that arrived up to this long before a version's publication (as the log's server stamped
# it) are counted as after it: the server's clock and the gateway's may disagree by this much.
CLOCK_MARGIN_S = 0.25


@dataclass
class VersionTimeline:
    """The versions this gateway learned from the policy bucket, with the log's time stamp of
    each (epoch seconds; None: not known). Versions only grow (``policy_watch.decide``).

    >>> t = VersionTimeline()
    >>> t.learned(3, 100.0); t.learned(4, 200.0)
    >>> t.newer_by(3, 199.0), t.newer_by(3, 199.9), t.newer_by(4, 500.0)
    (False, True, False)
    """

    versions: list[int] = field(default_factory=list)
    published: list[float] = field(default_factory=list)

    def learned(self, version: int, published_at: float | None) -> None:
        if self.versions and version <= self.versions[-1]:
            return
        self.versions.append(version)
        # Unknown time stamp: as early as can be, so tokens around it count as unknown.
        self.published.append(float("-inf") if published_at is None else published_at)
        if len(self.versions) > 64:  # only recent versions matter to turns in flight
            del self.versions[:32], self.published[:32]

    def newer_by(self, version: int, arrived_at: float) -> bool:
        """Whether a version newer than ``version`` had been published by ``arrived_at`` (the
        wall time a token arrived), within ``CLOCK_MARGIN_S``."""
        at = bisect.bisect_right(self.versions, version)
        return any(p <= arrived_at + CLOCK_MARGIN_S for p in self.published[at:])


@dataclass
class TokenVersions:
    """A turn's tokens' versions as they arrive: run-length, with each run's arrival time where
    the backend did not say the version itself (``resolve`` may then make it unknown).

    >>> v = TokenVersions()
    >>> v.add(3, 2, said=True); v.add(3, 1, said=True); v.add(4, 2, said=True)
    >>> v.spans(), v.oldest, sorted(v.known)
    ([(3, 3), (4, 2)], 3, [3, 4])
    >>> one = TokenVersions(); one.add(5, 4, said=False, at=10.0); one.spans() is None
    True
    """

    # [version (None: unknown), count, arrival wall time (None: the backend said the version)]
    runs: list[list[float | int | None]] = field(default_factory=list)

    def add(self, version: int | None, count: int, *, said: bool, at: float = 0.0) -> None:
        if count <= 0:
            return
        last = self.runs[-1] if self.runs else None
        if said and last is not None and last[0] == version and last[2] is None:
            last[1] = int(last[1] or 0) + count
            return
        # An attributed chunk stays a run of its own: resolve judges it by its arrival.
        self.runs.append([version, count, None if said else at])

    @property
    def known(self) -> set[int]:
        return {int(v) for v, _, _ in self.runs if v is not None}

    @property
    def oldest(self) -> int | None:
        return min(self.known, default=None)

    def seal(self) -> None:
        """The backend aborted the generation: the tokens so far were sampled before it paused,
        so before any newer version was published (rule 1); none of them is judged again."""
        for run in self.runs:
            run[2] = None

    def resolve(self, timeline: VersionTimeline) -> None:
        """Make unknown the tokens the gateway attributed (the backend did not say) that
        arrived once a newer version had been published (rule 3 of the module's contract)."""
        for run in self.runs:
            version, _, arrived = run
            known = version is not None and arrived is not None
            if known and timeline.newer_by(int(version or 0), float(arrived or 0.0)):
                run[0] = None

    def spans(self) -> list[tuple[int | None, int]] | None:
        """``TurnCompleted.version_spans``: None when every token has one known version (the
        event's ``weight_version`` says it), else the runs, equal neighbours joined."""
        pairs: list[tuple[int | None, int]] = []
        for version, count, _ in self.runs:
            v = None if version is None else int(version)
            if pairs and pairs[-1][0] == v:
                pairs[-1] = (v, pairs[-1][1] + int(count or 0))
            else:
                pairs.append((v, int(count or 0)))
        if len(pairs) <= 1 and all(v is not None for v, _ in pairs):
            return None
        return pairs
