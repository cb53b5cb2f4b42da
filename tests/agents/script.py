"""The scripted agent session both CLIs are driven through, and how to phrase each step.

A session is three model calls: two shell commands the CLI really runs in its working directory
(the first reads a file the test wrote, the second writes a file the test then finds on disk),
then a final text. Which step a call is comes from how many tool results its conversation holds,
so a resent request gets the same answer as the original.

Both the discovery server (``capture.py``, API level) and the scripted vLLM stand-in
(``scripted_backend.py``, token level) phrase the steps with the functions here.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ANSWER_FILE",
    "ANSWER_TEXT",
    "FINAL_TEXT",
    "NOTE_FILE",
    "NOTE_TEXT",
    "PROMPT",
    "STEPS",
    "claude_bash_call",
    "codex_shell_call",
    "step_for",
]

NOTE_FILE = "notes.txt"
NOTE_TEXT = "turnstream-probe-7391"
ANSWER_FILE = "answer.txt"
ANSWER_TEXT = "42"
# The shell commands of steps 1 and 2; step 3 (and any later call) is FINAL_TEXT.
STEPS = (f"cat {NOTE_FILE}", f"echo {ANSWER_TEXT} > {ANSWER_FILE} && ls")
FINAL_TEXT = f"Done: {NOTE_FILE} read and {ANSWER_FILE} written."
PROMPT = f"Read {NOTE_FILE}, then write {ANSWER_TEXT} into {ANSWER_FILE}."


def step_for(tool_results: int) -> str | None:
    """The shell command to call after ``tool_results`` results, or None: answer FINAL_TEXT."""
    return STEPS[tool_results] if tool_results < len(STEPS) else None


def claude_bash_call(command: str) -> tuple[str, dict[str, Any]]:
    """Claude Code's ``Bash`` tool call."""
    return "Bash", {"command": command, "description": f"Run {command.split()[0]}"}


def codex_shell_call(tool_names: set[str], command: str) -> tuple[str, dict[str, Any]]:
    """Codex's shell tool call, in whichever shape the offered tools take."""
    if "shell_command" in tool_names:
        return "shell_command", {"command": command}
    if "exec_command" in tool_names:
        return "exec_command", {"cmd": command}
    return "shell", {"command": ["bash", "-lc", command]}
