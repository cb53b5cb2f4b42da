"""The ``turnstream`` command: ``turnstream COMMAND [--flags]``; ``turnstream COMMAND --help``.

Each command is a settings model (flags, ``TURNSTREAM_*`` env, ``--config`` TOML) whose
``cli_cmd`` runs it. Errors turnstream raises on purpose are printed as one clear line.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from pydantic import ValidationError
from pydantic_settings import CliApp, SettingsConfigDict
from rich.markup import escape
from rich.table import Table

from eventlog import LogSecurity, ensure_log_security
from eventlog.permissions import ROLE_DUTIES
from schemas import TurnstreamError
from turnstream.stack.event_log import open_log
from turnstream.stack.process import configure_logging, console, stop_on_signals
from turnstream.stack.settings import ServiceSettings, with_toml

__all__ = ["main"]


def _actions_table(actions: Sequence[object]) -> Table:
    table = Table("stream / bucket", "action", "changed", title="provisioning")
    for a in actions:
        table.add_row(a.name, a.action, ", ".join(a.changed))  # type: ignore[attr-defined]
    return table


NATS_PORT = 4222
"""Where ``turnstream nats`` listens unless ``--log.port`` says otherwise: NATS's own port, so
the URL other services join with is the same each time (the embedded servers of ``up`` and
``gateway`` pick a free one)."""


class NatsCommand(ServiceSettings):
    """Run an embedded nats-server with JetStream and turnstream's streams until Ctrl-C."""

    model_config = SettingsConfigDict(cli_prog_name="turnstream nats")

    def cli_cmd(self) -> None:
        asyncio.run(self._run())

    async def _run(self) -> None:
        port = self.log.port if "port" in self.log.model_fields_set else NATS_PORT
        log = self.log.model_copy(update={"url": None, "port": port})
        settings = self.model_copy(update={"log": log})
        stop = stop_on_signals()
        async with open_log(settings, name="turnstream-nats", stop=stop) as event_log:
            console.print(_actions_table(event_log.provisioned))
            if settings.log.secure:
                security = ensure_log_security(settings.nats_auth_dir)
                console.print(_credentials_table(security))
                worker = security.roles["worker"].config_file
                console.print(
                    f"TLS and a user per role required; clients trust [bold]{security.ca_file}[/] "
                    f"(--log.tls-ca). A service joins with its role's file, e.g.\n"
                    f"  turnstream worker --log.url {event_log.url} --config {worker}"
                )
            console.print(
                f"nats-server ready at [bold]{event_log.url}[/] (Ctrl-C stops it); services "
                f"join with [bold]--log.url {event_log.url}[/]"
            )
            await stop.wait()


def _credentials_table(security: LogSecurity) -> Table:
    table = Table("role (user)", "for", "credentials: --config FILE", title="log users")
    for role, credentials in security.roles.items():
        table.add_row(role, ROLE_DUTIES[role], str(credentials.config_file))
    return table


class ProvisionCommand(ServiceSettings):
    """Create or update the streams and KV buckets on a running NATS (--log.url)."""

    model_config = SettingsConfigDict(cli_prog_name="turnstream provision")

    def cli_cmd(self) -> None:
        if self.log.url is None:
            raise TurnstreamError("provision needs --log.url (or TURNSTREAM_LOG__URL)")
        asyncio.run(self._run())

    async def _run(self) -> None:
        async with open_log(self, name="turnstream-provision") as event_log:
            console.print(_actions_table(event_log.provisioned))


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
        _lazy("turnstream.services.gateway.assembly", "GatewayCommand"),
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


def _usage() -> str:
    lines = ["usage: turnstream COMMAND [--flags]   (turnstream COMMAND --help for its flags)", ""]
    for name, (doc, _) in COMMANDS.items():
        lines.append(f"  {name:<12} {doc.strip().splitlines()[0]}")
    lines += [
        "",
        "Config: flags > TURNSTREAM_* env vars (nested with __) > --config FILE.toml > defaults.",
    ]
    return "\n".join(lines)


def _pop_config(argv: list[str]) -> Path | None:
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            path = argv[i + 1]
            del argv[i : i + 2]
            return Path(path)
        if arg.startswith("--config="):
            del argv[i]
            return Path(arg.split("=", 1)[1])
    env = os.environ.get("TURNSTREAM_CONFIG")
    return Path(env) if env else None


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name = args.pop(0)
    if name not in COMMANDS:
        console.print(f"[red]error:[/] {escape(f'unknown command {name!r}')}\n{escape(_usage())}")
        return 2
    # transformers advises at import that without torch "Models won't be available": true and
    # meant for a gateway in front of vLLM, which needs only the tokenizer.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    configure_logging()
    try:
        CliApp.run(with_toml(COMMANDS[name][1](), _pop_config(args)), cli_args=args)
    except ValidationError as exc:
        console.print(f"[red]error:[/] {escape(f'invalid settings for `turnstream {name}`:')}")
        console.print(str(exc), markup=False)
        return 2
    except (TurnstreamError, FileNotFoundError) as exc:
        # Not markup: a message like "pip install 'turnstream[local]'" must print as it is.
        console.print(f"[red]error:[/] {escape(str(exc))}")
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
