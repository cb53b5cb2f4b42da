"""The long-running processes, one module (or package) each: ``gateway/`` (``turnstream
gateway``), ``worker`` (``turnstream worker``: fold worker and reaper), ``shard_writer``
(``turnstream shard-writer``), ``train`` (``turnstream train``: the reference trainer of
``turnstream.trainer``). ``turnstream.stack.up`` runs the first three in one process.

Nothing is imported here: each service is imported on its own when its command runs, and
``train`` needs torch, which a base install lacks.
"""
