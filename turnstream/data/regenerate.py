"""Regenerate recorded turns: send each again with its recorded sampling, compare the tokens.

Every turn the gateway serves samples with a seed of its own (the client's, else one derived
from run, session, turn and the gateway's instance id: ``gateway.serving.engine.derived_seed``),
recorded in its event's
``sampling`` with the rest of what was sent (temperature, top_p, max_tokens, stop token ids).
So a recorded session, sent again to a server holding the same weights, must give back the
same tokens: this checks that it does, turn by turn (``turnstream replay --regenerate``).

For each ``TurnCompleted``: its full prompt is rebuilt from the deltas (``context(parent)
[:prefix_len] + prompt_ids``, parents followed as ``schemas.delta.replay_context`` does),
generated with the recorded sampling, and the ids compared with ``completion_ids`` (and the
log-probs, within a tolerance, where the tokens agree). A turn recorded without a seed (events
older than issue 19) is reported as not reproducible, unless it was greedy (a temperature below
1e-5, ``schemas.sampling``). A turn that shows images is sent with them (``Prompt.images``: its
full prompt's images, ``full_prompt_images``, their bytes from the recording); one whose image
the recording lacks is not reproducible.

    report = await regenerate(events, backend)
    assert report.ok, [t.line() for t in report.turns if t.status != "same"]
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import numpy as np

from gateway.backends.interface import (
    Backend,
    GenerationChunk,
    Prompt,
    PromptImage,
    SamplingParams,
)
from schemas.delta import EMPTY_CONTEXT, Context, decode_context
from schemas.errors import TurnstreamError
from schemas.events import SessionEvent, TurnCompleted
from schemas.images import ImageRef, prompt_images
from schemas.sampling import is_greedy
from turnstream.data.parts import (
    OWN_WEIGHTS,
    Part,
    PartStatus,
    PartVerdict,
    compare_tokens,
    part_weights,
    turn_parts,
)

__all__ = [
    "LOGPROB_TOLERANCE",
    "RegeneratedTurn",
    "RegenerationReport",
    "VersionWeights",
    "compare",
    "full_prompt_images",
    "full_prompts",
    "regenerate",
    "regeneration_params",
    "session_turns",
]

# fp32 on the same weights and kernels gives the same numbers; a server that batches requests
# differently may move them by rounding (1e-6 .. 1e-5 seen on CPU), never by a token's worth.
LOGPROB_TOLERANCE = 1e-5

# "partial": a turn generated in parts (continued after an abort), some of them the same and the
# others not regenerated (no weights for their version here); none differs or failed.
Status = Literal["same", "differs", "not_reproducible", "failed", "partial"]
SessionKey = tuple[str, str]


@dataclass(frozen=True)
class RegeneratedTurn:
    """One turn's verdict. ``first_difference``: the first position where the ids differ (or
    where one sequence ends before the other); ``max_logprob_delta``: the largest |Δ| over the
    positions before it."""

    run: str
    session: str
    turn: int
    status: Status
    recorded_tokens: int = 0
    regenerated_tokens: int = 0
    first_difference: int | None = None
    max_logprob_delta: float = 0.0
    reason: str = ""
    parts: tuple[PartVerdict, ...] = ()  # a turn continued after an abort: each part's verdict

    def line(self) -> str:
        """One line; a turn generated in parts adds one line per part."""
        where = f"run {self.run} session {self.session} turn {self.turn}"
        if self.status == "same":
            head = (
                f"{where}: same {self.recorded_tokens} tokens "
                f"(max |Δ logprob| {self.max_logprob_delta:.2e})"
            )
        else:
            head = f"{where}: {self.status.replace('_', ' ')}: {self.reason}"
        return "\n".join([head, *(f"  {part.line()}" for part in self.parts)])


@dataclass
class RegenerationReport:
    turns: list[RegeneratedTurn] = field(default_factory=list)

    def count(self, status: Status) -> int:
        return sum(t.status == status for t in self.turns)

    @property
    def ok(self) -> bool:
        """Every turn (part) that could be sent again gave back its tokens, and at least one
        could."""
        regenerated = self.count("same") + self.count("partial")
        return regenerated > 0 and not (self.count("differs") or self.count("failed"))

    def summary(self) -> str:
        sessions = len({(t.run, t.session) for t in self.turns})
        partial = self.count("partial")
        return (
            f"{len(self.turns)} turns of {sessions} sessions: {self.count('same')} same, "
            f"{self.count('differs')} differ, {self.count('failed')} failed, "
            f"{self.count('not_reproducible')} not reproducible"
            + (f", {partial} partly regenerated (parts without their version's weights)"
               if partial else "")
        )  # fmt: skip


def session_turns(events: Iterable[SessionEvent]) -> dict[SessionKey, dict[int, TurnCompleted]]:
    """Each session's turns by index, in the order given (stream order); of two events for one
    turn the first wins, as in the fold (DESIGN §3: the later one is a conflict or a retry)."""
    sessions: dict[SessionKey, dict[int, TurnCompleted]] = {}
    for event in events:
        if isinstance(event, TurnCompleted):
            sessions.setdefault((event.run, event.session), {}).setdefault(event.turn, event)
    return sessions


def full_prompts(turns: dict[int, TurnCompleted]) -> dict[int, np.ndarray | None]:
    """Each turn's full prompt ids: ``context(parent)[:prefix_len] + prompt_ids``, where a
    turn's context is its prompt + its completion and parent -1 has an empty one (the rule of
    ``schemas.delta.replay_context``, memoized along the tree). None: an ancestor is missing.

    >>> t0 = TurnCompleted(run="r", session="s", turn=0, prompt_ids=[1, 2],
    ...                    completion_ids=[3], logprobs=[-0.5])
    >>> t1 = TurnCompleted(run="r", session="s", turn=1, prefix_len=3, prompt_ids=[4],
    ...                    completion_ids=[5], logprobs=[-0.1])
    >>> {t: p.tolist() for t, p in full_prompts({0: t0, 1: t1}).items()}
    {0: [1, 2], 1: [1, 2, 3, 4]}
    """
    prompts: dict[int, np.ndarray | None] = {}
    contexts: dict[int, Context | None] = {-1: EMPTY_CONTEXT}
    for index in sorted(turns):  # a parent is an earlier turn (TurnCompleted checks it)
        turn = turns[index]
        parent = contexts.get(turn.parent)
        if parent is None or turn.prefix_len > parent.length:
            prompts[index] = contexts[index] = None
            continue
        context = contexts[index] = decode_context(parent, turn)
        prompts[index] = context.ids()[: turn.prefix_len + len(turn.prompt_ids)]
    return prompts


def full_prompt_images(turns: dict[int, TurnCompleted]) -> dict[int, list[ImageRef] | None]:
    """Each turn's full prompt's images: its parent's inside its shared prefix, then its own
    (``schemas.images.prompt_images``, memoized along the tree). None: an ancestor is missing.

    >>> a, b = ImageRef("ab" * 32, 0, 2, 8, 8), ImageRef("cd" * 32, 5, 1, 8, 8)
    >>> t0 = TurnCompleted(run="r", session="s", turn=0, prompt_ids=[1, 1, 2],
    ...                    completion_ids=[3], logprobs=[-0.5], images=[a])
    >>> t1 = TurnCompleted(run="r", session="s", turn=1, prefix_len=4, prompt_ids=[4, 1],
    ...                    completion_ids=[5], logprobs=[-0.1], images=[b])
    >>> [[r.offset for r in refs] for refs in full_prompt_images({0: t0, 1: t1}).values()]
    [[0], [0, 5]]
    """
    images: dict[int, list[ImageRef] | None] = {-1: []}
    for index in sorted(turns):
        turn = turns[index]
        parent = images.get(turn.parent)
        images[index] = (
            None if parent is None else prompt_images(parent, turn.prefix_len, turn.images)
        )
    del images[-1]
    return images


def _prompt_images(
    refs: list[ImageRef] | None, data: Mapping[str, bytes]
) -> tuple[PromptImage, ...] | str:
    """The images to send a turn with, or why they cannot be."""
    found = []
    for ref in refs or ():
        if ref.sha256 not in data:
            return (
                f"its image sha256:{ref.sha256} is not in the recording (its log had lost it "
                f"when the run was recorded)"
            )
        found.append(PromptImage(ref, data[ref.sha256]))
    return tuple(found)


def regeneration_params(
    turn: TurnCompleted, stop_token_ids: Sequence[int] = ()
) -> SamplingParams | str:
    """The sampling to send ``turn`` again with, or why it cannot be reproduced.

    Stop token ids are the recorded ones, else ``stop_token_ids`` (the template's: events older
    than the record of them). A turn recorded with raw log-probs is allowed raw ones again.

    >>> t = TurnCompleted(run="r", session="s", turn=0, prompt_ids=[1], completion_ids=[2],
    ...                   logprobs=[-1.0], sampling={"max_tokens": 8, "temperature": 0.7})
    >>> regeneration_params(t).startswith("recorded without a seed")
    True
    """
    sampling = turn.sampling
    max_tokens = sampling.get("max_tokens")
    if not isinstance(max_tokens, int) or max_tokens < 1:
        return f"no recorded max_tokens (sampling {sampling})"
    temperature = float(sampling.get("temperature", 1.0))
    seed = sampling.get("seed")
    if seed is None and not is_greedy(temperature):
        return (
            "recorded without a seed (an event from before per-request seeds): its sample "
            "cannot be drawn again"
        )
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=float(sampling.get("top_p", 1.0)),
        seed=None if seed is None else int(seed),
        stop_token_ids=list(sampling.get("stop_token_ids", stop_token_ids)),
        allow_raw_logprobs=turn.logprobs_kind == "raw",
    )


def compare(
    turn: TurnCompleted,
    ids: Sequence[int],
    logprobs: Sequence[float],
    tolerance: float = LOGPROB_TOLERANCE,
) -> RegeneratedTurn:
    """The verdict on ``turn`` regenerated as ``ids`` / ``logprobs``.

    >>> t = TurnCompleted(run="r", session="s", turn=2, prompt_ids=[1], completion_ids=[5, 6],
    ...                   logprobs=[-0.5, -1.0])
    >>> compare(t, [5, 6], [-0.5, -1.000001]).status
    'same'
    >>> compare(t, [5, 7], [-0.5, -2.0]).line()
    'run r session s turn 2: differs: token 1 of 2: recorded 6, regenerated 7'
    """
    recorded = turn.completion_ids.tolist()
    found = compare_tokens(recorded, turn.logprobs, ids, logprobs, tolerance)
    return RegeneratedTurn(
        turn.run,
        turn.session,
        turn.turn,
        "differs" if found.reason else "same",
        len(recorded),
        len(ids),
        found.first_difference,
        found.max_logprob_delta,
        found.reason,
    )


async def _generate(
    backend: Backend,
    prompt: np.ndarray,
    params: SamplingParams,
    session: str,
    enough: int | None,
    images: tuple[PromptImage, ...] = (),
) -> tuple[list[int], list[float]]:
    """The ids and log-probs ``backend`` samples; with ``enough``, stops once it has that many
    (the gateway cut the recorded turn there: a stop string)."""
    ids: list[int] = []
    logprobs: list[float] = []
    stream: AsyncIterator[GenerationChunk] = backend.generate(
        Prompt(prompt, images=images), params, session=session
    )
    try:
        async for chunk in stream:
            ids.extend(chunk.token_ids)
            logprobs.extend(chunk.logprobs)
            if enough is not None and len(ids) >= enough:
                break
    finally:
        aclose = getattr(stream, "aclose", None)  # stops the generation on the backend
        if aclose is not None:
            with contextlib.suppress(Exception):
                await aclose()
    return ids, logprobs


class VersionWeights(Protocol):
    """The weights of recorded policy versions, put into the backend a turn's parts are sent to
    (``turnstream.data.parts``): for a local backend, checkpoints it loads."""

    @property
    def versions(self) -> Collection[int]:
        """The versions whose weights are here."""
        ...

    async def serve(self, version: int | None) -> None:
        """Make the backend sample with ``version``'s weights (None: its own) from now on."""
        ...


@dataclass
class _Plan:
    """One turn's way through ``regenerate``: its verdict, or its parts and their verdicts."""

    turn: TurnCompleted
    verdict: RegeneratedTurn | None = None
    parts: list[Part] = field(default_factory=list)
    done: dict[int, PartVerdict] = field(default_factory=dict)  # by part index
    images: tuple[PromptImage, ...] = ()  # its full prompt's, with their bytes


async def regenerate(
    events: Iterable[SessionEvent],
    backend: Backend,
    *,
    weights: VersionWeights | None = None,
    stop_token_ids: Sequence[int] = (),
    tolerance: float = LOGPROB_TOLERANCE,
    progress: Callable[[RegeneratedTurn], object] | None = None,
    images: Mapping[str, bytes] | None = None,
) -> RegenerationReport:
    """Send every recorded turn of ``events`` to ``backend`` again and compare (module doc).

    ``weights``: the recorded versions' weights, which each part of a turn is sent to
    (``turnstream.data.parts``); the backend's own weights are used first, then each version's
    in turn, so a recording of many versions loads each once. ``stop_token_ids``: the
    template's, for turns recorded before their stop ids were (newer events carry their own).
    ``progress`` is called with each turn's verdict as it is complete. A backend error fails
    that turn (part), named in the report, and the next is tried. ``images``: the bytes of the
    images the turns show, by digest (a recording's).
    """
    plans: list[_Plan] = []
    jobs: dict[int | None, list[tuple[_Plan, Part]]] = {OWN_WEIGHTS: []}
    checkpoints = weights.versions if weights is not None else ()
    for turns in session_turns(events).values():
        prompts = full_prompts(turns)
        shown = full_prompt_images(turns)
        for index, turn in sorted(turns.items()):
            sent = _prompt_images(shown[index], images or {})
            plan = _plan(turn, prompts[index], stop_token_ids, checkpoints, jobs, sent)
            plans.append(plan)
            if plan.verdict is not None and progress is not None:
                progress(plan.verdict)
    for version in [OWN_WEIGHTS, *sorted(v for v in jobs if v is not OWN_WEIGHTS)]:
        if not jobs.get(version):
            continue
        unloaded = await _serve(weights, version)
        for plan, part in jobs[version]:
            plan.done[part.index] = (
                PartVerdict(part, "failed", reason=unloaded)
                if unloaded
                else await _regenerate_part(backend, plan, part, tolerance)
            )
            if len(plan.done) == len(plan.parts):
                plan.verdict = _joined(plan)
                if progress is not None:
                    progress(plan.verdict)
    return RegenerationReport([plan.verdict for plan in plans if plan.verdict is not None])


def _plan(
    turn: TurnCompleted,
    prompt: np.ndarray | None,
    stop_token_ids: Sequence[int],
    checkpoints: Collection[int],
    jobs: dict[int | None, list[tuple[_Plan, Part]]],
    images: tuple[PromptImage, ...] | str = (),
) -> _Plan:
    """``turn``'s parts queued under the weights each is sent to, or its verdict already."""

    def unreproducible(reason: str) -> _Plan:
        verdict = RegeneratedTurn(
            turn.run, turn.session, turn.turn, "not_reproducible", len(turn.completion_ids),
            reason=reason,
        )  # fmt: skip
        return _Plan(turn, verdict)

    if prompt is None:
        return unreproducible(
            f"its prompt cannot be rebuilt: parent turn {turn.parent} (or one of its ancestors) "
            "is not among the events"
        )
    params = regeneration_params(turn, stop_token_ids)
    if isinstance(params, str):
        return unreproducible(params)
    if isinstance(images, str):
        return unreproducible(images)
    plan = _Plan(turn, parts=turn_parts(turn, prompt, params), images=images)
    versions = {v for part in plan.parts for v in part.versions}
    for part in plan.parts:
        where = part_weights(versions, part, checkpoints)
        if isinstance(where, str):
            plan.done[part.index] = PartVerdict(part, "not_reproducible", reason=where)
        else:
            jobs.setdefault(where, []).append((plan, part))
    if len(plan.done) == len(plan.parts):  # nothing to send
        plan.verdict = _joined(plan)
    return plan


async def _serve(weights: VersionWeights | None, version: int | None) -> str:
    """Put ``version``'s weights into the backend: "", or why they could not be."""
    if weights is None:
        return ""
    try:
        await weights.serve(version)
    except (TurnstreamError, OSError) as exc:
        return f"the weights of version {version} could not be loaded: {exc}"
    return ""


async def _regenerate_part(
    backend: Backend, plan: _Plan, part: Part, tolerance: float
) -> PartVerdict:
    turn = plan.turn
    try:
        ids, logprobs = await _generate(
            backend,
            part.prompt,
            part.params,
            f"{turn.run}/{turn.session}",
            part.enough,
            plan.images,
        )
    except (TurnstreamError, OSError) as exc:
        reason = f"the backend failed: {type(exc).__name__}: {exc}"
        return PartVerdict(part, "failed", reason=reason)
    if part.enough is not None:
        ids, logprobs = ids[: part.enough], logprobs[: part.enough]
    recorded = turn.completion_ids[part.start : part.end].tolist()
    found = compare_tokens(recorded, turn.logprobs[part.start : part.end], ids, logprobs, tolerance)
    status: PartStatus = "differs" if found.reason else "same"
    return PartVerdict(part, status, len(ids), found, found.reason)


def _joined(plan: _Plan) -> RegeneratedTurn:
    """The turn's verdict from its parts'; a turn of one part regenerated reads as it always
    did, one of several tells each part's."""
    turn = plan.turn
    verdicts = [plan.done[part.index] for part in plan.parts]
    statuses = {verdict.status for verdict in verdicts}
    status: Status = next(
        (s for s in ("failed", "differs") if s in statuses),
        "same" if statuses == {"same"} else "partial" if "same" in statuses else "not_reproducible",
    )
    found = [v.comparison for v in verdicts if v.comparison is not None]
    first = next(
        (v.part.start + v.comparison.first_difference for v in verdicts
         if v.comparison is not None and v.comparison.first_difference is not None),
        None,
    )  # fmt: skip
    several = len(verdicts) > 1
    reasons = [v.reason for v in verdicts if v.status == status and v.reason]
    if several and status != "same":
        shown = [f"part {v.part.index}" for v in verdicts if v.status == status]
        reasons = [f"{', '.join(shown)} of {len(verdicts)} parts (below)"]
        if status == "partial":
            reasons = [
                f"{len(found)} of {len(verdicts)} parts regenerated, the same; the others not "
                "(below)"
            ]
    return RegeneratedTurn(
        turn.run,
        turn.session,
        turn.turn,
        status,
        len(turn.completion_ids),
        sum(v.regenerated_tokens for v in verdicts),
        first,
        max((c.max_logprob_delta for c in found), default=0.0),
        "; ".join(reasons),
        tuple(verdicts) if several else (),
    )
