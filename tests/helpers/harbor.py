"""Harbor's own ATIF models (``harbor.models.trajectories``), to validate what we write.

Harbor needs Python >= 3.12 to install, so ``make setup`` unpacks its wheel, without its
dependencies, into ``.venv/compat/harbor-<version>`` (``--python-version 3.12``); its
trajectory models are plain pydantic and load on 3.11. Its ``harbor/__init__.py`` imports
nothing at import time (every name is lazy), so the package imports as it is with that folder
on ``sys.path``; nothing else of Harbor (its app, its agents) is imported. The folder is
required, not skipped when absent: ``make test`` installs it, and a missing validator must fail
the run, not hide it. ``TURNSTREAM_TEST_HARBOR`` names another folder (a worktree without a
``.venv`` of its own).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import ModuleType

HARBOR_VERSION = "0.26.0"
_ROOT = Path(__file__).resolve().parents[2]


def harbor_dir() -> Path:
    given = os.environ.get("TURNSTREAM_TEST_HARBOR")
    return Path(given) if given else _ROOT / ".venv" / "compat" / f"harbor-{HARBOR_VERSION}"


def harbor_trajectories() -> tuple[ModuleType, ModuleType]:
    """``harbor.models.trajectories`` and ``harbor.utils.trajectory_validator``."""
    folder = harbor_dir()
    assert (folder / "harbor").is_dir(), (
        f"{folder} holds no harbor: run `make setup` (it installs Harbor {HARBOR_VERSION} "
        f"there), or set TURNSTREAM_TEST_HARBOR"
    )
    if str(folder) not in sys.path:
        sys.path.append(str(folder))  # appended: it must shadow nothing of the venv
    import harbor.models.trajectories as models
    import harbor.utils.trajectory_validator as validator

    return models, validator


def assert_valid_atif(document: dict[str, object]) -> None:
    """``document`` passes Harbor's validator and loads as its ``Trajectory`` model."""
    models, validator = harbor_trajectories()
    checker = validator.TrajectoryValidator()
    assert checker.validate(document), checker.get_errors()
    models.Trajectory.model_validate(document)
