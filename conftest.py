"""Doctest collection: modules that import verl run only under tests/verl's interpreter."""

from __future__ import annotations

import importlib.util

collect_ignore = (
    [] if importlib.util.find_spec("verl") is not None else ["turnstream/integrations/verl.py"]
)
