"""Where deploy tests keep what they install or build, so the next run on this machine reuses it.

``${TURNSTREAM_DEPLOY_CACHE:-~/.cache/turnstream/deploy}``: never the repository (a venv, a base
image's rootfs or a model there would be picked up by git and by the next test collection). A
fresh machine simply rebuilds it.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir"]


def cache_dir(*parts: str) -> Path:
    """``<deploy cache>/<parts...>``, created if missing."""
    root = os.environ.get("TURNSTREAM_DEPLOY_CACHE") or "~/.cache/turnstream/deploy"
    path = Path(root).expanduser().joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path
