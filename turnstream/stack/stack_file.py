"""``<data_dir>/stack.json``: where a running ``turnstream up`` can be joined (DESIGN §9).

``turnstream up`` writes it once the gateway serves and the workers run, and removes it when it
exits; a file left by an ``up`` that was killed names a dead pid and is ignored. ``status``,
``inspect`` and ``train`` read it when no ``--log.url`` is given, so on one machine::

    turnstream up            # writes data/stack.json
    turnstream train         # joins data/stack.json's log, trains its run
    turnstream status        # reports on the same log and shards

Light on purpose (no gateway, torch or pyarrow import): every command may read it.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from eventlog.server import pid_alive
from turnstream.stack.settings import ServiceSettings

__all__ = [
    "STACK_FILE",
    "StackFile",
    "join_stack",
    "new_stack_file",
    "read_stack_file",
    "remove_stack_file",
    "running_stack",
    "stack_file_path",
    "write_stack_file",
]

STACK_FILE = "stack.json"

S = TypeVar("S", bound=ServiceSettings)


class StackFile(BaseModel):
    """What ``stack.json`` holds: the URLs to join, the run, the processes."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    gateway_url: str = Field(description="the gateway's base URL (/health, /v1/sessions)")
    openai_base_url: str = Field(description="what an OpenAI client's base_url is set to")
    nats_url: str = Field(description="the log: what --log.url is set to")
    data_dir: str = Field(description="the data directory, absolute")
    shards: str = Field(description="the shard writer's target directory or URI")
    run: str = Field(description="the run new sessions go to")
    model_dir: str | None = Field(None, description="the model the gateway serves")
    pids: dict[str, int | None] = Field(description="up: the process; nats_server: its server")
    started_at: float = Field(description="when the stack was ready (Unix time)")

    @property
    def up_pid(self) -> int | None:
        return self.pids.get("up")

    @property
    def alive(self) -> bool:
        """Whether the ``up`` that wrote the file is still running."""
        return self.up_pid is not None and pid_alive(self.up_pid)


def stack_file_path(data_dir: Path) -> Path:
    return data_dir / STACK_FILE


def read_stack_file(data_dir: Path) -> StackFile | None:
    """The file, or None when there is none or it is not one (a torn or foreign file)."""
    try:
        return StackFile.model_validate_json(stack_file_path(data_dir).read_bytes())
    except (OSError, ValidationError):
        return None


def running_stack(data_dir: Path) -> StackFile | None:
    """The stack a live ``turnstream up`` runs on ``data_dir``, or None."""
    found = read_stack_file(data_dir)
    return found if found is not None and found.alive else None


def write_stack_file(data_dir: Path, stack: StackFile) -> bool:
    """Write ``stack.json`` whole (temp file, then rename); False, writing nothing, when it
    names another ``up`` that is still running (two stacks on one data dir: its file stays)."""
    path = stack_file_path(data_dir)
    other = read_stack_file(data_dir)
    if other is not None and other.alive and other.up_pid != stack.up_pid:
        return False
    data_dir.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{STACK_FILE}.{os.getpid()}.tmp")
    staging.write_text(stack.model_dump_json(indent=2) + "\n")
    os.replace(staging, path)
    return True


def remove_stack_file(data_dir: Path, up_pid: int) -> bool:
    """Remove ``stack.json`` if ``up_pid`` wrote it; another stack's file is left alone."""
    found = read_stack_file(data_dir)
    if found is None or found.up_pid != up_pid:
        return False
    with contextlib.suppress(FileNotFoundError):
        stack_file_path(data_dir).unlink()
    return True


def join_stack(settings: S) -> tuple[S, StackFile | None]:
    """``settings`` joined to the running stack of its data dir when ``--log.url`` is unset:
    the log URL from ``stack.json``, and its run unless ``--run`` was given. The stack file
    used, or None (``--log.url`` given, or no live stack)."""
    if settings.log.url is not None:
        return settings, None
    stack = running_stack(settings.data_dir)
    if stack is None:
        return settings, None
    update: dict[str, object] = {"log": settings.log.model_copy(update={"url": stack.nats_url})}
    if "run" not in settings.model_fields_set:
        update["run"] = stack.run
    return settings.model_copy(update=update), stack


def new_stack_file(
    *,
    gateway_url: str,
    nats_url: str,
    data_dir: Path,
    shards: str,
    run: str,
    model_dir: Path | None,
    nats_server_pid: int | None,
) -> StackFile:
    """The file for a stack of this process, ready now."""
    return StackFile(
        gateway_url=gateway_url,
        openai_base_url=f"{gateway_url}/v1",
        nats_url=nats_url,
        data_dir=str(data_dir.absolute()),
        shards=shards,
        run=run,
        model_dir=str(model_dir.absolute()) if model_dir is not None else None,
        pids={"up": os.getpid(), "nats_server": nats_server_pid},
        started_at=time.time(),
    )
