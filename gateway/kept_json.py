"""The JSON text a chat template writes of a kept turn's tools, written once per session.

A coding agent offers the model the same tools on every turn (Claude Code: 24 tools, ~63 KB of
JSON schemas), and a chat template writes each of them with its ``tojson`` filter on every
render: ``json.dumps`` of 63 KB was ~10% of the gateway's CPU per later turn of a
Claude-Code-shaped session (issue 40, point 2). A continued turn offers the tools its kept turn
offered (``branches.continued_turn`` compares them), and a session's kept turns share one list of
tool objects (``aggregate``: a turn recording the same tools inherits its parent's), so the text
can be kept by identity: ``KeptJson`` answers ``tojson`` of an object it was asked to keep from the
text it wrote the first time, and any other value as the filter did (``json.dumps``).

Kept objects are held (their ``id`` cannot be reused while kept) and must not change: the
gateway keeps only a kept turn's tools, which nothing changes once recorded. At most ``limit``
objects are kept, the least recently kept dropped first. Equal texts are kept once: each
session decodes its own copy of the tools, but one agent's sessions send equal ones, and a
text per session was ~110 KB of a Claude-Code-shaped session's memory (issue 40); at most
``limit`` distinct texts are looked up that way (one per kept object at most).

>>> import json
>>> kept = KeptJson(limit=8)
>>> tojson = kept.filter(lambda x, **options: json.dumps(x, **options))
>>> tool = {"name": "Bash"}
>>> kept.keep([tool])
>>> tojson(tool) is tojson(tool), tojson(tool, indent=2) == json.dumps(tool, indent=2)
(True, True)
>>> twin = {"name": "Bash"}  # another session's equal tool
>>> kept.keep([twin])
>>> tojson(twin) is tojson(tool)
True
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["KeptJson"]

# Per object: its tojson text by the filter's options (a template may write a tool twice, as
# is and indented). 4,096 objects: a few hundred sessions' tools, ~2.6 KB of text each.
LIMIT = 4096


class KeptJson:
    """Kept objects and their ``tojson`` texts. Thread-safe: a long prompt renders on a
    worker thread."""

    def __init__(self, limit: int = LIMIT) -> None:
        self.limit = limit
        self._kept: OrderedDict[int, tuple[object, dict[tuple[Any, ...], str]]] = OrderedDict()
        self._texts: OrderedDict[str, str] = OrderedDict()  # each distinct text, once
        self._lock = threading.Lock()

    def keep(self, values: Iterable[object]) -> None:
        """Answer ``tojson`` of each of ``values`` (a kept turn's tool list and its tools)
        from the text written the first time."""
        with self._lock:
            for value in values:
                entry = self._kept.get(id(value))
                if entry is None or entry[0] is not value:
                    self._kept[id(value)] = (value, {})
                else:
                    self._kept.move_to_end(id(value))
            while len(self._kept) > self.limit:
                self._kept.popitem(last=False)

    def filter(self, tojson: Callable[..., str]) -> Callable[..., str]:
        """``tojson`` answering kept objects from their kept text."""

        def kept_tojson(value: Any, *args: Any, **options: Any) -> str:
            entry = self._kept.get(id(value))
            if entry is None or entry[0] is not value:
                return tojson(value, *args, **options)
            key = (args, tuple(sorted(options.items())))
            text = entry[1].get(key)
            if text is None:
                text = entry[1][key] = self._one(tojson(value, *args, **options))
            return text

        kept_tojson.kept = self  # type: ignore[attr-defined]  # found again by kept_json_of
        return kept_tojson

    def _one(self, text: str) -> str:
        """``text``, or the equal text kept before it: looked up once per kept object, when
        its text is first written (hashing it: ~1 µs per KB, once per session's tools)."""
        with self._lock:
            one = self._texts.setdefault(text, text)
            self._texts.move_to_end(one)
            while len(self._texts) > self.limit:
                self._texts.popitem(last=False)
        return one


def kept_json_of(environment: Any) -> KeptJson | None:
    """The ``KeptJson`` behind a jinja environment's ``tojson`` filter, put there the first time
    (transformers compiles a template once per process and shares it); None where the
    environment has no ``tojson`` filter."""
    filters = environment.filters
    current = filters.get("tojson")
    if current is None:
        return None
    kept: KeptJson | None = getattr(current, "kept", None)
    if kept is None:
        kept = KeptJson()
        filters["tojson"] = kept.filter(current)
    return kept
