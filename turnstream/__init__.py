"""turnstream's composition root: the ``turnstream`` command and everything it runs, by role.

The layers below it (``schemas`` <- ``eventlog``, ``shardstore`` <- ``gateway``, ``consumers``,
``trainer_sink``) hold the logic; this package only puts them together into processes. Where
each role lives::

    cli/           the command table (``commands``) and parsing, ``--config``, exit codes
                   (``main``); ``turnstream = "turnstream.cli:main"``
    stack/         what every command stands on: its settings (``settings``), the log it joins
                   or embeds (``event_log``), its process (``process``: event loop, signals,
                   heap, logging), ``stack.json`` (``stack_file``); ``nats`` / ``provision``
                   (``log_server``); and ``up``, the whole stack in one process (``up``)
    services/      the long-running processes: ``gateway/`` (settings, assembly, HTTP, the
                   ``--workers`` supervisor and its worker processes, the command), ``worker``
                   (fold worker + reaper), ``shard_writer``, ``train`` (the reference trainer)
    trainer/       the reference GRPO / PPO trainer as a library: ``reference``, ``objective``
                   (its math, pure), ``checkpoints``
    data/          commands on recorded data: ``record``, ``replay`` (``regenerate``),
                   ``refold``, ``export``, ``status``
    inspect/       ``turnstream inspect``: one session's turns and trajectories (``command``;
                   pure: ``view``, ``tree``, ``text``)
    demo/          ``turnstream demo``: agents, the tiny model's lesson, the report, the job
    integrations/  verl's agent loop and what it needs (imported by verl, never by the rest)

A module is named by what it is, its role by the package it is in: ``services/worker.py`` is
``turnstream worker``, ``data/record.py`` is ``turnstream record``, and a package that is one
command (``inspect/``, ``demo/``, ``services/gateway/``) holds it in ``command.py``. Each command
is imported only when it runs (``cli.commands``): a base install has every command but ``train``
and ``demo``, and no torch (the gateway's local backend aside).
"""
