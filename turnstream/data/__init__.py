"""The commands on recorded data: ``record`` (a run's events into one file), ``replay`` (a file's
events into a log again; ``--regenerate``: ``regenerate``, the turns sent to a backend again and
compared), ``refold`` (a run's events folded again as a new run), ``export`` (shards as a
dataset), ``status`` (what a running log and the shards hold); ``progress``, their progress bar.

Nothing is imported here: each command is imported on its own when it runs (``export`` loads
pyarrow, ``replay --regenerate`` a gateway backend; ``status`` needs neither).
"""
