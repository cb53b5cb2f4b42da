"""The command table: each ``turnstream`` command's name, one-line help and settings class.

A command's module is imported only when it runs (``_lazy``): torch, transformers, pyarrow and
duckdb are slow to import, most commands need none of them, and a base install has no torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from schemas import TurnstreamError
from turnstream.stack.log_server import NatsCommand, ProvisionCommand
from turnstream.stack.settings import ServiceSettings

__all__ = ["COMMANDS", "EXTRA_PACKAGES"]

# The packages only an extra installs (pyproject.toml), by the import name.
EXTRA_PACKAGES = frozenset({"torch", "tensordict", "safetensors", "openai", "matplotlib", "ray"})


def _lazy(module: str, name: str, extra: str | None = None) -> Callable[[], type[ServiceSettings]]:
    """The settings class ``module.name``, imported only when its command runs (torch,
    transformers, pyarrow and duckdb are slow to import and most commands need none of them).
    ``extra``: the install extra the command needs; without it, an error says to install it."""

    def load() -> type[ServiceSettings]:
        try:
            imported = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if extra is None or (exc.name or "").split(".")[0] not in EXTRA_PACKAGES:
                raise  # not a missing extra: a bug, shown as one
            raise TurnstreamError(
                f"this command needs the {extra!r} extra ({exc}): pip install 'turnstream[{extra}]'"
            ) from exc
        cls: type[ServiceSettings] = getattr(imported, name)
        return cls

    return load


# name -> (one-line help, the command's settings class, imported only when it runs)
COMMANDS: dict[str, tuple[str, Callable[[], type[ServiceSettings]]]] = {
    "demo": (
        "The main job on the embedded default: agents, gateway, log, shards, a GRPO trainer.",
        _lazy("turnstream.demo.command", "DemoCommand", extra="demo"),
    ),
    "export": (
        "Export a run's trajectories from the shards as a dataset (tokens or chat messages).",
        _lazy("turnstream.data.export", "ExportCommand"),
    ),
    "gateway": (
        "Run the OpenAI-compatible gateway; every turn is published to the log before it answers.",
        _lazy("turnstream.services.gateway.command", "GatewayCommand"),
    ),
    "import-atif": (
        "ATIF trajectories with token ids as a run's sessions (SFT / off-policy data).",
        _lazy("turnstream.data.import_atif", "ImportAtifCommand"),
    ),
    "inspect": (
        "Show one session's turns and trajectories: loss mask, logprobs, forks, rewards.",
        _lazy("turnstream.inspect.command", "InspectCommand"),
    ),
    "nats": (NatsCommand.__doc__ or "", lambda: NatsCommand),
    "provision": (ProvisionCommand.__doc__ or "", lambda: ProvisionCommand),
    "record": (
        "Record a run's raw events (EVENTS) into one portable, checksummed Parquet file.",
        _lazy("turnstream.data.record", "RecordCommand"),
    ),
    "refold": (
        "Fold a run's stored events again and publish the trajectories under a new run.",
        _lazy("turnstream.data.refold", "RefoldCommand"),
    ),
    "replay": (
        "Publish a recording's events into a log again (same run, or a new one).",
        _lazy("turnstream.data.replay", "ReplayCommand"),
    ),
    "shard-writer": (
        "Write the trajectories of TRAJ to Parquet shards (zstd), each exactly once.",
        _lazy("turnstream.services.shard_writer", "ShardWriterCommand"),
    ),
    "status": (
        "Streams, consumer lag, dead letters, sessions per run and shards of a running log.",
        _lazy("turnstream.data.status", "StatusCommand"),
    ),
    "train": (
        "The reference GRPO trainer as a service: live from TRAJ, publishes its policies.",
        _lazy("turnstream.services.train", "TrainCommand", extra="train"),
    ),
    "up": (
        "Everything in one process: nats-server, gateway, fold worker + reaper, shard writer.",
        _lazy("turnstream.stack.up", "UpCommand"),
    ),
    "worker": (
        "Fold closed sessions into trajectories (TRAJ); close idle sessions (reaper).",
        _lazy("turnstream.services.worker", "WorkerCommand"),
    ),
}
