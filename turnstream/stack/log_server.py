"""``turnstream nats`` and ``turnstream provision``: the log on its own.

``nats`` runs the embedded nats-server that ``up`` and ``gateway`` would start, alone and on a
known port, so that services in other processes (or on other machines) join it with
``--log.url``; ``provision`` creates or updates the streams and buckets on a server run by
someone else.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from pydantic_settings import SettingsConfigDict
from rich.table import Table

from eventlog.server import ROLE_DUTIES, LogSecurity, ensure_log_security
from schemas import TurnstreamError
from turnstream.stack.event_log import open_log
from turnstream.stack.process import console, stop_on_signals
from turnstream.stack.settings import ServiceSettings

__all__ = ["NATS_PORT", "NatsCommand", "ProvisionCommand"]


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
    """Create or update the streams and buckets (KV, images) on a running NATS (--log.url)."""

    model_config = SettingsConfigDict(cli_prog_name="turnstream provision")

    def cli_cmd(self) -> None:
        if self.log.url is None:
            raise TurnstreamError("provision needs --log.url (or TURNSTREAM_LOG__URL)")
        asyncio.run(self._run())

    async def _run(self) -> None:
        async with open_log(self, name="turnstream-provision") as event_log:
            console.print(_actions_table(event_log.provisioned))
