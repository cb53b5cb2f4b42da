"""What every command stands on, and the whole stack in one process.

- ``settings``: ``ServiceSettings`` (data dir, run, log) and ``PublishingSettings``;
- ``event_log``: ``open_log``, the log at ``--log.url`` or an embedded nats-server;
- ``process``: the event loop, signals, heap and logging of a command's process;
- ``stack_file``: ``<data_dir>/stack.json``, how a running ``up`` is joined;
- ``log_server``: ``turnstream nats`` and ``turnstream provision``, the log on its own;
- ``up``: ``turnstream up`` and ``embedded_stack``, nats-server, gateway, fold worker and shard
  writer in one process. Not re-exported here: it is built of ``turnstream.services``, which
  stand on the rest of this package (import ``turnstream.stack.up``).
"""

from __future__ import annotations

from turnstream.stack.event_log import EventLog, open_log, require_log_url
from turnstream.stack.log_server import NATS_PORT, NatsCommand, ProvisionCommand
from turnstream.stack.process import (
    YOUNG_GC_THRESHOLD,
    configure_logging,
    console,
    run_service,
    settle_heap,
    stop_on_signals,
    without_progress_bars,
)
from turnstream.stack.settings import PublishingSettings, ServiceSettings, with_toml
from turnstream.stack.stack_file import (
    STACK_FILE,
    StackFile,
    join_stack,
    new_stack_file,
    read_stack_file,
    remove_stack_file,
    running_stack,
    stack_file_path,
    write_stack_file,
)

__all__ = [
    "NATS_PORT",
    "STACK_FILE",
    "YOUNG_GC_THRESHOLD",
    "EventLog",
    "NatsCommand",
    "ProvisionCommand",
    "PublishingSettings",
    "ServiceSettings",
    "StackFile",
    "configure_logging",
    "console",
    "join_stack",
    "new_stack_file",
    "open_log",
    "read_stack_file",
    "remove_stack_file",
    "require_log_url",
    "run_service",
    "running_stack",
    "settle_heap",
    "stack_file_path",
    "stop_on_signals",
    "with_toml",
    "without_progress_bars",
    "write_stack_file",
]
