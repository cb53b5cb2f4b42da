"""The ``turnstream`` command: ``turnstream COMMAND [--flags]``; ``turnstream COMMAND --help``.

Each command is a settings model (flags, ``TURNSTREAM_*`` env, ``--config`` TOML) whose
``cli_cmd`` runs it (``turnstream.cli.commands``). Errors turnstream raises on purpose are printed
as one clear line; exit codes: 0 done, 1 such an error, 2 invalid flags or settings, 130 Ctrl-C.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

from pydantic import ValidationError
from pydantic_settings import CliApp
from rich.markup import escape

from schemas import TurnstreamError
from turnstream.cli.commands import COMMANDS
from turnstream.stack.process import configure_logging, console
from turnstream.stack.settings import with_toml

__all__ = ["main"]


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
