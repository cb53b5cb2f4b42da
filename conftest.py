"""Collection rules for the whole tree.

- Modules that import verl are doctested only under tests/verl's interpreter.
- tests/deploy (a Docker engine, a NATS cluster, a real vLLM) runs only under
  ``make test-deploy``, which sets ``TURNSTREAM_TEST_DEPLOY=1``: ``make test`` needs no engine.
- tests/agents (Claude Code and Codex CLI installed with npm, run through the gateway) runs only
  under ``make test-agents``, which sets ``TURNSTREAM_TEST_AGENTS=1``: ``make test`` needs no npm.
"""

from __future__ import annotations

import importlib.util
import os

collect_ignore = (
    [] if importlib.util.find_spec("verl") is not None else ["turnstream/integrations/verl.py"]
)
if os.environ.get("TURNSTREAM_TEST_DEPLOY") != "1":
    collect_ignore.append("tests/deploy")
if os.environ.get("TURNSTREAM_TEST_AGENTS") != "1":
    collect_ignore.append("tests/agents")
