"""Which model names a gateway answers to: the one it serves, and ``--model-aliases`` (PURE).

Coding-agent CLIs ask for their vendor's model by default (Claude Code a ``claude-...`` name,
Codex a ``gpt-...`` one), and a gateway serving ``Qwen3-8B`` would refuse them (404). An alias
``PATTERN=NAME`` answers a requested name that matches the glob ``PATTERN`` (``fnmatch``: ``*``,
``?``, ``[...]``, case-sensitive, as model names are) with the served model ``NAME``. The served
name itself always matches first; then the aliases in the order given, the first match winning.

>>> names = ModelNames.of("Qwen3-8B", parse_model_aliases(["claude-*=Qwen3-8B", "gpt-5*=Qwen3-8B"]))
>>> names.resolve("claude-sonnet-4-6"), names.resolve("Qwen3-8B"), names.resolve("o3")
('Qwen3-8B', 'Qwen3-8B', None)
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["ModelAlias", "ModelNames", "answered_as", "parse_model_aliases"]

_EXAMPLE = "e.g. --model-aliases 'claude-*=Qwen3-8B,gpt-*=Qwen3-8B'"


@dataclass(frozen=True)
class ModelAlias:
    """Requested names matching the glob ``pattern`` are answered by the served ``target``."""

    pattern: str
    target: str

    def matches(self, asked: str) -> bool:
        return fnmatch.fnmatchcase(asked, self.pattern)

    def __str__(self) -> str:
        return f"{self.pattern}={self.target}"


def parse_model_aliases(specs: Iterable[str]) -> tuple[ModelAlias, ...]:
    """``PATTERN=NAME`` specs as aliases, in order; a ValueError naming the spec that is not
    one (no ``=``, an empty side, whitespace, a pattern given twice).

    >>> parse_model_aliases(["claude-*=tiny", "gpt-?=tiny"])
    (ModelAlias(pattern='claude-*', target='tiny'), ModelAlias(pattern='gpt-?', target='tiny'))
    """
    aliases: list[ModelAlias] = []
    for spec in specs:
        pattern, sep, target = spec.partition("=")
        if not sep or not pattern or not target or "=" in target:
            raise ValueError(
                f"model alias {spec!r} is not PATTERN=NAME (a glob of requested model names, "
                f"then the served model's name), {_EXAMPLE}"
            )
        if spec != spec.strip() or any(c.isspace() for c in spec):
            raise ValueError(f"model alias {spec!r} holds whitespace; model names hold none")
        if any(alias.pattern == pattern for alias in aliases):
            raise ValueError(f"model alias pattern {pattern!r} is given twice")
        aliases.append(ModelAlias(pattern, target))
    return tuple(aliases)


@dataclass(frozen=True)
class ModelNames:
    """The served model's name and the aliases that lead to it."""

    served: str
    aliases: tuple[ModelAlias, ...] = ()

    @classmethod
    def of(cls, served: str, aliases: Sequence[ModelAlias]) -> ModelNames:
        """The names of a gateway serving ``served``; a ValueError for an alias whose target is
        another model (a gateway serves one: an alias to another name would still be a 404)."""
        for alias in aliases:
            if alias.target != served:
                raise ValueError(
                    f"model alias {str(alias)!r} leads to {alias.target!r}, but this gateway "
                    f"serves {served!r}: write {alias.pattern}={served}"
                )
        return cls(served, tuple(aliases))

    def alias_for(self, asked: str) -> ModelAlias | None:
        """The first alias whose pattern ``asked`` matches (None: none does)."""
        return next((alias for alias in self.aliases if alias.matches(asked)), None)

    def resolve(self, asked: str) -> str | None:
        """The served name ``asked`` leads to: itself if it is the served one, else the first
        matching alias's target; None when nothing matches (the model is not served here)."""
        if asked == self.served:
            return self.served
        alias = self.alias_for(asked)
        return None if alias is None else alias.target


def answered_as(asked: str | None, served: str) -> str:
    """The model name a reply carries: the one its request asked for (an alias's is echoed, as
    vLLM echoes whichever of its --served-model-name was asked: clients key their context
    window, costs and checks on the name they asked for), else the served one. The log keeps
    both: the asked name in ``TurnCompleted.request``, the served one in ``SessionOpened.model``.
    """
    return served if asked is None else asked
