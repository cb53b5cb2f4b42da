"""`turnstream COMMAND --help` shows that command's settings, no other's (issue 11, point 9)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from turnstream.cli import COMMANDS, main

ROOT = Path(__file__).resolve().parents[2]

# The nested settings groups each command takes (``--log.url`` is group "log").
GROUPS: dict[str, set[str]] = {
    "demo": {"log", "publisher", "fold", "reaper", "shards", "sink"},
    "export": {"log"},  # the log holds the images a messages export writes
    "gateway": {"log", "publisher"},
    "import-atif": {"log", "publisher"},
    "inspect": {"log"},
    "nats": {"log"},
    "provision": {"log"},
    "record": {"log"},
    "refold": {"log", "publisher"},
    "replay": {"log", "publisher"},
    "shard-writer": {"log", "publisher", "shards"},
    "status": {"log"},
    "train": {"log", "publisher", "sink"},
    "up": {"log", "publisher", "fold", "reaper", "shards"},
    "worker": {"log", "publisher", "fold", "reaper"},
}


def help_of(name: str, capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exited:
        main([name, "--help"])
    assert exited.value.code == 0
    return capsys.readouterr().out


def test_every_command_is_listed_with_a_one_line_description(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert set(COMMANDS) == set(GROUPS)
    assert main(["--help"]) == 0
    usage = capsys.readouterr().out
    for name, (doc, _) in COMMANDS.items():
        first = doc.strip().splitlines()[0]
        assert first.endswith("."), f"{name}: {first!r} is not a sentence"
        assert re.search(rf"^  {re.escape(name)}\s+{re.escape(first)}$", usage, re.M), name


@pytest.mark.parametrize("name", sorted(GROUPS))
def test_help_shows_the_command_and_only_its_settings(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    text = help_of(name, capsys)

    assert text.startswith(f"usage: turnstream {name} ")
    assert COMMANDS[name][0].strip().splitlines()[0] in " ".join(text.split())
    groups = set(re.findall(r"--(?:no-)?([a-z_-]+)\.[a-z]", text))
    assert groups == GROUPS[name], f"turnstream {name} --help shows groups {sorted(groups)}"


def test_the_license_file_is_the_one_pyproject_names() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
