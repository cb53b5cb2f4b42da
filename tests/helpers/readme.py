"""README.md's code blocks as a test runs them (issue 11, point 9).

Every fenced ``sh`` and ``python`` block is run, in order, in one scratch directory. An HTML
comment on the line before a fence says how, when plain "run it, exit 0" is not the way::

    <!-- readme-test: services ready=nats://127.0.0.1:4222 ready=http://127.0.0.1:8000/health -->
        each line a long-running process, started in order after the previous services
        block's are stopped; the i-th ``ready`` URL must answer (http: 200 on GET; nats: a TCP
        connect) before the line after the i-th starts
    <!-- readme-test: eventually 60 -->   retried until it exits 0, for up to 60 s (a result
        that appears asynchronously, e.g. a shard committed after its max age)
    <!-- readme-test: skip REASON -->     not run; REASON is required and shown

Blocks in other languages (``text``, ``sql`` shown for reading, ``toml``) are not run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Snippet", "commands", "snippets", "stacks"]

RUNNABLE = ("sh", "python")
_DIRECTIVE = re.compile(r"<!--\s*readme-test:\s*(?P<kind>\w+)\s*(?P<arg>.*?)\s*-->")


@dataclass(frozen=True)
class Snippet:
    lang: str
    code: str
    line: int  # of the opening fence, 1-based
    kind: str  # "run", "services", "eventually", "skip"
    arg: str  # the directive's argument ("" for run)

    @property
    def where(self) -> str:
        return f"README.md:{self.line} ({self.lang}, {self.kind})"

    @property
    def ready_urls(self) -> list[str]:
        return [part.removeprefix("ready=") for part in self.arg.split() if "ready=" in part]


def snippets(readme: Path) -> list[Snippet]:
    """The README's runnable blocks in order, each with its directive (``run`` by default)."""
    lines = readme.read_text().splitlines()
    found: list[Snippet] = []
    i = 0
    while i < len(lines):
        fence = re.fullmatch(r"```(\w*).*", lines[i])
        if fence is None:
            i += 1
            continue
        lang, start = fence.group(1), i
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        if lang in RUNNABLE:
            directive = _DIRECTIVE.fullmatch(lines[start - 1].strip()) if start else None
            kind, arg = (directive["kind"], directive["arg"]) if directive else ("run", "")
            if kind not in ("run", "services", "eventually", "skip"):
                raise ValueError(f"README.md:{start}: unknown readme-test directive {kind!r}")
            if kind == "skip" and not arg:
                raise ValueError(f"README.md:{start}: a skipped block must say why")
            code = "\n".join(lines[start + 1 : end]) + "\n"
            found.append(Snippet(lang, code, start + 1, kind, arg))
        i = end + 1
    return found


def stacks(found: list[Snippet]) -> list[list[Snippet]]:
    """The blocks grouped by the stack they talk to: each ``services`` block with the blocks
    after it, up to the next one (those before the first: a group of their own); a group whose
    blocks are all skipped is left out. Each group runs on its own, in a directory of its own."""
    groups: list[list[Snippet]] = [[]]
    for snippet in found:
        if snippet.kind == "services":
            groups.append([])
        groups[-1].append(snippet)
    return [group for group in groups if any(s.kind != "skip" for s in group)]


def commands(sh: str) -> list[str]:
    """The shell block's commands: continuation lines joined, comments and blanks dropped."""
    joined = re.sub(r"\\\n\s*", " ", sh)
    out = []
    for line in joined.splitlines():
        command = re.sub(r"\s+#.*$", "", line).strip()
        if command and not command.startswith("#"):
            out.append(command)
    return out
