"""``python -m turnstream.cli``: the ``turnstream`` command."""

from __future__ import annotations

import sys

from turnstream.cli.main import main

sys.exit(main())
