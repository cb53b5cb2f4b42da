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
older than issue 19) is reported as not reproducible, unless it was greedy (temperature 0).

    report = await regenerate(events, backend)
    assert report.ok, [t.line() for t in report.turns if t.status != "same"]
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import numpy as np

from consumers.recording import Recording, read_recording
from gateway.backends.interface import Backend, GenerationChunk, Prompt, SamplingParams
from schemas.codec import Codec
from schemas.delta import EMPTY_CONTEXT, Context, decode_context
from schemas.errors import SchemaError, TurnstreamError
from schemas.events import SessionEvent, TurnCompleted
from turnstream.data.progress import progress_bar

if TYPE_CHECKING:
    from pathlib import Path

    from rich.console import Console

    from turnstream.services.gateway.settings import GatewaySettings

__all__ = [
    "LOGPROB_TOLERANCE",
    "RegeneratedTurn",
    "RegenerationReport",
    "compare",
    "full_prompts",
    "gateway_backend",
    "recorded_events",
    "regenerate",
    "regenerate_recording",
    "regeneration_params",
    "session_turns",
]

# fp32 on the same weights and kernels gives the same numbers; a server that batches requests
# differently may move them by rounding (1e-6 .. 1e-5 seen on CPU), never by a token's worth.
LOGPROB_TOLERANCE = 1e-5

Status = Literal["same", "differs", "not_reproducible", "failed"]
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

    def line(self) -> str:
        where = f"run {self.run} session {self.session} turn {self.turn}"
        if self.status == "same":
            return (
                f"{where}: same {self.recorded_tokens} tokens "
                f"(max |Δ logprob| {self.max_logprob_delta:.2e})"
            )
        return f"{where}: {self.status.replace('_', ' ')}: {self.reason}"


@dataclass
class RegenerationReport:
    turns: list[RegeneratedTurn] = field(default_factory=list)

    def count(self, status: Status) -> int:
        return sum(t.status == status for t in self.turns)

    @property
    def ok(self) -> bool:
        """Every turn that could be sent again gave back its tokens, and at least one could."""
        return self.count("same") > 0 and not (self.count("differs") or self.count("failed"))

    def summary(self) -> str:
        sessions = len({(t.run, t.session) for t in self.turns})
        return (
            f"{len(self.turns)} turns of {sessions} sessions: {self.count('same')} same, "
            f"{self.count('differs')} differ, {self.count('failed')} failed, "
            f"{self.count('not_reproducible')} not reproducible"
        )


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
    if seed is None and temperature != 0.0:
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
    n = min(len(recorded), len(ids))
    mismatch = next((i for i in range(n) if recorded[i] != ids[i]), None)
    if mismatch is None and len(recorded) != len(ids):
        mismatch = n
    agreed = n if mismatch is None else mismatch
    deltas = np.abs(
        np.asarray(logprobs[:agreed], dtype=np.float64) - turn.logprobs[:agreed].astype(np.float64)
    )
    delta = float(deltas.max()) if agreed else 0.0
    if math.isnan(delta):
        delta = math.inf
    verdict = RegeneratedTurn(
        turn.run,
        turn.session,
        turn.turn,
        "same",
        len(recorded),
        len(ids),
        mismatch,
        delta,
    )
    if mismatch is not None:
        got = ids[mismatch] if mismatch < len(ids) else "the end"
        want = recorded[mismatch] if mismatch < len(recorded) else "the end"
        reason = f"token {mismatch} of {len(recorded)}: recorded {want}, regenerated {got}"
        return _replace(verdict, "differs", reason)
    if delta > tolerance:
        at = int(deltas.argmax())
        reason = (
            f"same tokens, but the log-prob of token {at} differs by {delta:.3g} "
            f"(> {tolerance:g}): recorded {turn.logprobs[at]:.6g}, regenerated {logprobs[at]:.6g}"
        )
        return _replace(verdict, "differs", reason)
    return verdict


def _replace(verdict: RegeneratedTurn, status: Status, reason: str) -> RegeneratedTurn:
    return RegeneratedTurn(
        verdict.run,
        verdict.session,
        verdict.turn,
        status,
        verdict.recorded_tokens,
        verdict.regenerated_tokens,
        verdict.first_difference,
        verdict.max_logprob_delta,
        reason,
    )


async def _generate(
    backend: Backend,
    prompt: np.ndarray,
    params: SamplingParams,
    session: str,
    enough: int | None,
) -> tuple[list[int], list[float]]:
    """The ids and log-probs ``backend`` samples; with ``enough``, stops once it has that many
    (the gateway cut the recorded turn there: a stop string)."""
    ids: list[int] = []
    logprobs: list[float] = []
    stream: AsyncIterator[GenerationChunk] = backend.generate(
        Prompt(prompt), params, session=session
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


async def regenerate(
    events: Iterable[SessionEvent],
    backend: Backend,
    *,
    stop_token_ids: Sequence[int] = (),
    tolerance: float = LOGPROB_TOLERANCE,
    progress: Callable[[RegeneratedTurn], object] | None = None,
) -> RegenerationReport:
    """Send every recorded turn of ``events`` to ``backend`` again and compare (module doc).

    ``stop_token_ids``: the template's, for turns recorded before their stop ids were (newer
    events carry their own). ``progress`` is called with each turn's verdict as it comes. A
    backend error fails that turn (named in the report) and the next turn is tried.
    """
    report = RegenerationReport()
    for turns in session_turns(events).values():
        prompts = full_prompts(turns)
        for index, turn in sorted(turns.items()):
            verdict = await _regenerate_turn(
                backend, turn, prompts[index], stop_token_ids, tolerance
            )
            report.turns.append(verdict)
            if progress is not None:
                progress(verdict)
    return report


async def _regenerate_turn(
    backend: Backend,
    turn: TurnCompleted,
    prompt: np.ndarray | None,
    stop_token_ids: Sequence[int],
    tolerance: float,
) -> RegeneratedTurn:
    def unreproducible(reason: str) -> RegeneratedTurn:
        return RegeneratedTurn(
            turn.run, turn.session, turn.turn, "not_reproducible", len(turn.completion_ids),
            reason=reason,
        )  # fmt: skip

    if prompt is None:
        return unreproducible(
            f"its prompt cannot be rebuilt: parent turn {turn.parent} (or one of its ancestors) "
            "is not among the events"
        )
    params = regeneration_params(turn, stop_token_ids)
    if isinstance(params, str):
        return unreproducible(params)
    # A stop string ends a turn inside the gateway, after the chunk that completed it: the
    # backend would go on, so only as many tokens as were recorded are read back.
    enough = len(turn.completion_ids) if turn.sampling.get("stop") else None
    try:
        ids, logprobs = await _generate(
            backend, prompt, params, f"{turn.run}/{turn.session}", enough
        )
    except (TurnstreamError, OSError) as exc:
        return RegeneratedTurn(
            turn.run, turn.session, turn.turn, "failed", len(turn.completion_ids),
            reason=f"the backend failed: {type(exc).__name__}: {exc}",
        )  # fmt: skip
    if enough is not None:
        ids, logprobs = ids[:enough], logprobs[:enough]
    return compare(turn, ids, logprobs, tolerance)


# -- the command's glue: a recording's events, a backend built as the gateway builds it ----------


def recorded_events(recording: Recording, codec: Codec) -> tuple[list[SessionEvent], int]:
    """The recording's events, decoded, in stream order, and how many could not be (bytes that
    are no event: no turn of theirs can be regenerated)."""
    events: list[SessionEvent] = []
    undecodable = 0
    for stored in recording.events:
        try:
            event = codec.decode(stored.data)
        except SchemaError:
            undecodable += 1
            continue
        if isinstance(event, SessionEvent):
            events.append(event)
    return events, undecodable


@contextlib.asynccontextmanager
async def gateway_backend(settings: GatewaySettings) -> AsyncIterator[tuple[Backend, list[int]]]:
    """The backend ``turnstream gateway`` would run with ``settings`` (same construction, same
    torch threads for a local model), and the template's stop token ids."""
    from turnstream.services.gateway.assembly import build_backend, model_name, stop_token_ids

    settings = await settings.served()
    model_dir = settings.model_dir
    stop_ids = stop_token_ids(model_dir)
    backend = await asyncio.to_thread(
        build_backend, settings, model_dir, model_name(settings, model_dir)
    )
    try:
        yield backend, stop_ids
    finally:
        await backend.close()


async def regenerate_recording(
    path: Path, settings: GatewaySettings, max_payload: int, tolerance: float, console: Console
) -> RegenerationReport:
    """``turnstream replay PATH --regenerate``: the recording's turns against the backend of
    ``settings``, with a progress bar and a line for each turn that is not the same."""
    recording = await asyncio.to_thread(read_recording, path)
    events, undecodable = recorded_events(recording, Codec(max_payload=max_payload))
    if undecodable:
        console.print(f"{undecodable} recorded message(s) of {path} are no event: skipped")
    turns = sum(isinstance(e, TurnCompleted) for e in events)
    async with gateway_backend(settings) as (backend, stop_ids):
        label = f"regenerating run {recording.meta.run} on {backend.id}"
        with progress_bar(label, console) as bar:
            task = bar.add_task("turns", total=turns)

            def done(verdict: RegeneratedTurn) -> None:
                if verdict.status != "same":
                    bar.console.print(verdict.line(), markup=False)
                bar.update(task, advance=1)

            return await regenerate(
                events, backend, stop_token_ids=stop_ids, tolerance=tolerance, progress=done
            )
