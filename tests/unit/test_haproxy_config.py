"""The load balancer the compose file ships (``infra/haproxy/haproxy.cfg``) balances every
request on its own, with nothing that would keep a session on one gateway, and the README shows
its lines as they are in the file."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "infra" / "haproxy" / "haproxy.cfg"
# Directives that pin a client or a session to one server.
AFFINITY = re.compile(r"^\s*(cookie|stick|stick-table|hash-type|balance\s+(?!roundrobin\b))")


def config_lines() -> list[str]:
    """The file's directives, comments and blank lines left out."""
    lines = (line.split("#", 1)[0].strip() for line in CONFIG.read_text().splitlines())
    return [line for line in lines if line]


def test_every_request_is_balanced_round_robin_with_no_affinity() -> None:
    lines = config_lines()
    assert "balance roundrobin" in lines
    assert "option http-server-close" in lines  # a keep-alive client is not pinned either
    assert "option httpchk GET /health" in lines
    assert [line for line in lines if AFFINITY.match(line)] == []


def test_the_readme_shows_the_shipped_lines() -> None:
    readme = (REPO / "README.md").read_text()
    [block] = re.findall(r"```haproxy\n(.*?)```", readme, flags=re.DOTALL)
    shown = [line.strip() for line in block.splitlines() if line.strip()]
    assert shown, "the README's haproxy block is empty"
    assert [line for line in shown if line not in config_lines()] == []
