"""``turnstream replay PATH --regenerate``'s glue: a recording's events, a backend built as the
gateway builds it, and the recorded versions' checkpoints loaded into it
(``turnstream.data.regenerate`` does the regenerating)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Collection, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from consumers.recording import Recording, read_recording
from gateway.backends.interface import Backend
from gateway.backends.policy_watch import PolicyTarget
from schemas.codec import Codec
from schemas.errors import SchemaError, TurnstreamError
from schemas.events import SessionEvent, TurnCompleted
from turnstream.data.progress import progress_bar
from turnstream.data.regenerate import RegeneratedTurn, RegenerationReport, regenerate

if TYPE_CHECKING:
    from rich.console import Console

    from turnstream.services.gateway.settings import GatewaySettings

__all__ = ["CheckpointWeights", "gateway_backend", "recorded_events", "regenerate_recording"]


class CheckpointWeights:
    """Recorded versions' checkpoints (``--checkpoint VERSION=PATH``: a ``.safetensors`` file or
    a directory as the trainer writes them), loaded into a backend that holds its own weights,
    and its own weights (``own``: its model directory) back when they are asked for again."""

    def __init__(self, target: PolicyTarget, checkpoints: Mapping[int, Path], own: Path) -> None:
        self._target = target
        self._checkpoints = dict(checkpoints)
        self._own = own
        self._own_version = target.weight_version
        self._serving: int | None = None  # None: its own weights

    @property
    def versions(self) -> Collection[int]:
        return self._checkpoints.keys()

    async def serve(self, version: int | None) -> None:
        if version == self._serving:
            return
        if version is None:
            await self._target.load_weights(self._own, self._own_version)
        else:
            await self._target.load_weights(self._checkpoints[version], version)
        self._serving = version


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
async def gateway_backend(
    settings: GatewaySettings, checkpoints: Mapping[int, Path]
) -> AsyncIterator[tuple[Backend, list[int], CheckpointWeights | None]]:
    """The backend ``turnstream gateway`` would run with ``settings`` (same construction, same
    torch threads for a local model), the template's stop token ids, and ``checkpoints`` to
    load into it (None when there are none)."""
    from turnstream.services.gateway.assembly import build_backend, model_name, stop_token_ids

    settings = await settings.served()
    model_dir = settings.model_dir
    stop_ids = stop_token_ids(model_dir)
    backend = await asyncio.to_thread(
        build_backend, settings, model_dir, model_name(settings, model_dir)
    )
    try:
        weights = None
        if checkpoints:
            if not isinstance(backend, PolicyTarget):  # vLLM / SGLang: their weights are theirs
                raise TurnstreamError(f"backend {backend.id} loads no checkpoints (--checkpoint)")
            weights = CheckpointWeights(backend, checkpoints, model_dir)
        yield backend, stop_ids, weights
    finally:
        await backend.close()


async def regenerate_recording(
    path: Path,
    settings: GatewaySettings,
    max_payload: int,
    tolerance: float,
    console: Console,
    checkpoints: Mapping[int, Path] | None = None,
) -> RegenerationReport:
    """``turnstream replay PATH --regenerate``: the recording's turns against the backend of
    ``settings`` (each part of a continued turn against its version's checkpoint), with a
    progress bar, a line for each turn that is not the same and each turn's parts."""
    recording = await asyncio.to_thread(read_recording, path)
    events, undecodable = recorded_events(recording, Codec(max_payload=max_payload))
    if undecodable:
        console.print(f"{undecodable} recorded message(s) of {path} are no event: skipped")
    turns = sum(isinstance(e, TurnCompleted) for e in events)
    async with gateway_backend(settings, checkpoints or {}) as (backend, stop_ids, weights):
        label = f"regenerating run {recording.meta.run} on {backend.id}"
        with progress_bar(label, console) as bar:
            task = bar.add_task("turns", total=turns)

            def done(verdict: RegeneratedTurn) -> None:
                if verdict.status != "same" or verdict.parts:
                    bar.console.print(verdict.line(), markup=False)
                bar.update(task, advance=1)

            return await regenerate(
                events,
                backend,
                weights=weights,
                stop_token_ids=stop_ids,
                tolerance=tolerance,
                progress=done,
                images=recording.images,
            )
