"""Tests against verl's own code (verl 0.9.1, tensordict 0.10).

verl cannot live in the project venv beside tensordict 0.15, so ``make setup`` installs it without
dependencies into ``.venv/compat/verl-<version>``, and ``tests/integration/test_verl.py`` runs this
directory in a fresh interpreter with that directory first on the path. Collected in the main run
(without verl), these tests are not collected at all: the driver test is what runs them.
"""

from __future__ import annotations

import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("verl") is not None else ["test_*.py"]
