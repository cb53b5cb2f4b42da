"""Which ATIF files make one session: ``turnstream import-atif``'s reading of paths.

A Harbor agent directory holds more than one file per run: ``trajectory.json``, its
continuations (``trajectory.cont-1.json``, named by ``continued_trajectory_ref``; same
``session_id``) and sub-agents stored as files (``trajectory.summarization-1-summary.json``,
named by a step's ``subagent_trajectory_ref.trajectory_path``), beside the trial's
``result.json``, ``config.json`` and others that are no trajectories. So:

- a directory is searched for ``*.json`` files, and those that are no ATIF trajectory (no
  ``schema_version`` "ATIF-..." with ``steps``) are passed over; a file named on the command
  line must be one;
- a file another one refers to (by a relative path: a URL is not followed) is *attached* to it:
  its trajectories become chains of the referring file's session, not a session of their own.
  A referred file that exists but was not named is read too;
- a session's episode reward, when its trajectory says none, is Harbor's: the trial's
  ``result.json`` (``../result.json`` from ``agent/trajectory.json``), ``verifier_result.rewards``
  — its ``reward``, or its only value.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from consumers.errors import AtifRefused

__all__ = ["AtifFile", "SessionFiles", "gather"]

JSON = dict[str, Any]


@dataclass
class AtifFile:
    path: Path
    document: JSON
    data: bytes


@dataclass
class SessionFiles:
    """A session's files: the root, the files it refers to (depth first), Harbor's reward."""

    root: AtifFile
    attached: list[AtifFile] = field(default_factory=list)
    reward: float | None = None


def gather(paths: list[Path]) -> tuple[list[SessionFiles], int]:
    """The sessions of the ATIF files under ``paths``, and how many JSON files found in
    directories were passed over (no ATIF). AtifRefused when a path is missing, a named file
    is no ATIF trajectory, or no trajectory is found."""
    files: dict[Path, AtifFile] = {}
    passed_over = 0
    for path, named in _candidates(paths):
        found = _read(path, named)
        if found is None:
            passed_over += 1
        else:
            files[path.resolve()] = found
    if not files:
        raise AtifRefused(
            f"no ATIF trajectory under {', '.join(map(str, paths))} ({passed_over} other JSON "
            f"file(s) passed over); nothing was imported"
        )
    children: dict[Path, list[Path]] = {}
    referred: set[Path] = set()
    todo = list(files)
    while todo:  # referred files not named are read too
        key = todo.pop()
        children[key] = []
        for ref in _references(files[key].document, key.parent):
            if ref == key or ref in referred:
                continue
            if ref not in files:
                if not ref.is_file():
                    continue  # stored elsewhere (a URL, a file not copied): not ours to find
                loaded = _read(ref, named=True)
                assert loaded is not None
                files[ref] = loaded
                todo.append(ref)
            children[key].append(ref)
            referred.add(ref)
    sessions = []
    for key in sorted(k for k in files if k not in referred):
        attached = [files[k] for k in _descendants(key, children)]
        sessions.append(SessionFiles(files[key], attached, _harbor_reward(key)))
    return sessions, passed_over


def _candidates(paths: list[Path]) -> list[tuple[Path, bool]]:
    found: list[tuple[Path, bool]] = []
    for path in paths:
        if path.is_dir():
            found += [(p, False) for p in sorted(path.rglob("*.json")) if p.is_file()]
        elif path.is_file():
            found.append((path, True))
        else:
            raise AtifRefused(f"{path}: no such file or directory; nothing was imported")
    return found


def _read(path: Path, named: bool) -> AtifFile | None:
    data = path.read_bytes()
    try:
        document = json.loads(data)
    except ValueError as exc:
        if not named:
            return None
        raise AtifRefused(f"{path}: not JSON ({exc}); nothing was imported") from exc
    version = document.get("schema_version") if isinstance(document, dict) else None
    if isinstance(version, str) and version.startswith("ATIF-") and "steps" in document:
        return AtifFile(path, document, data)
    if not named:
        return None
    raise AtifRefused(
        f"{path}: not an ATIF trajectory (an object with schema_version 'ATIF-v1.x' and "
        f"steps); nothing was imported"
    )


def _references(document: JSON, folder: Path) -> list[Path]:
    """The files ``document`` refers to, in order: sub-agents by path, then its continuation."""
    names: list[str] = []
    for trajectory in _with_embedded(document):
        for step in trajectory.get("steps") or ():
            observation = step.get("observation") if isinstance(step, dict) else None
            results = observation.get("results") if isinstance(observation, dict) else None
            for result in results if isinstance(results, list) else ():
                refs = result.get("subagent_trajectory_ref") if isinstance(result, dict) else None
                for ref in refs if isinstance(refs, list) else ():
                    path = ref.get("trajectory_path") if isinstance(ref, dict) else None
                    if isinstance(path, str):
                        names.append(path)
    continued = document.get("continued_trajectory_ref")
    if isinstance(continued, str):
        names.append(continued)
    return [(folder / name).resolve() for name in names if name and "://" not in name]


def _with_embedded(document: JSON) -> list[JSON]:
    found, todo = [], [document]
    while todo:
        trajectory = todo.pop()
        found.append(trajectory)
        embedded = trajectory.get("subagent_trajectories")
        todo += [t for t in embedded if isinstance(t, dict)] if isinstance(embedded, list) else []
    return found


def _descendants(key: Path, children: dict[Path, list[Path]]) -> list[Path]:
    out: list[Path] = []
    for child in children.get(key, []):
        out.append(child)
        out += _descendants(child, children)
    return out


def _harbor_reward(trajectory: Path) -> float | None:
    result = trajectory.parent.parent / "result.json"
    if trajectory.parent.name != "agent" or not result.is_file():
        return None
    try:
        verifier = json.loads(result.read_text()).get("verifier_result") or {}
        rewards = verifier.get("rewards") or {}
    except (ValueError, AttributeError):
        return None  # not Harbor's result: no reward read from it
    if not isinstance(rewards, dict):
        return None
    value = rewards.get("reward", next(iter(rewards.values())) if len(rewards) == 1 else None)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None
