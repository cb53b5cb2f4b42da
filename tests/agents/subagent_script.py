"""The scripted sub-agent session: the main agent spawns a fork and a fresh sub-agent at once.

Modelled on the fakes that captured what the CLIs send (../shared/agent-clis/subagents/tools/
fake_anthropic_sub.py, fake_openai_sub.py), but at the token level: the scripted backend sees
only the prompt the gateway rendered (the tiny model's ChatML template, hermes tool calls), so
every decision here is taken from that text, never from request ids or headers.

- **Main agent** (its first user prompt holds ``SUBAGENT_PROMPT``): its first call answers ONE
  message with two spawn calls, a fork and a fresh agent, each task carrying its marker
  (``MARK_FORK_0``, ``MARK_FRESH_1``). Claude Code: two ``Agent`` calls (``subagent_type``
  ``fork`` and ``general-purpose``, background: the default). Codex: the namespace tool the
  gateway offers flattened as ``<namespace>__spawn_agent`` (v1 ``fork_context``, v2
  ``fork_turns`` and ``task_name``). Later calls: Codex calls ``<namespace>__wait_agent`` while a
  spawned agent has not reported (``codex exec`` ends the run, and abandons sub-agents, when the
  root's turn ends); otherwise, and always for Claude Code (``-p`` waits for background agents
  and sends a main request per batch of notifications), a final text naming the results seen.
- **A sub-agent** (a non-assistant turn, outside tool results, carries a marker: Claude Code's
  directive, Codex v1's task message, v2's ``agent_message``): one shell call ``echo SUB-<TAG>``,
  then, once its result is back, the final text ``SUBRESULT-<TAG>: saw SUB-<TAG>``.

The markers appear only in spawn arguments (assistant turns, skipped) and in the sub-agent's own
task; the final texts carry no marker, so a parent reading them back stays the main agent.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

__all__ = [
    "FORK",
    "FRESH",
    "SUBAGENTS",
    "SUBAGENT_PROMPT",
    "RenderedTurn",
    "SubAgent",
    "main_final_text",
    "rendered_turns",
    "subagent_final_text",
    "subagent_step",
]

SUBAGENT_PROMPT = "Use two sub-agents as your tools allow (turnstream sub-agent script)."
WAIT_MAX = 6  # the most wait_agent calls of Codex's main agent


@dataclass(frozen=True)
class SubAgent:
    tag: str  # FORK or FRESH
    marker: str  # in its task, nowhere else but the spawn call's arguments
    fork: bool

    @property
    def command(self) -> str:
        return f"echo SUB-{self.tag}"

    @property
    def task(self) -> str:
        return f"{self.marker}: run `{self.command}` with your shell tool, then reply in one line."


FORK = SubAgent("FORK", "MARK_FORK_0", fork=True)
FRESH = SubAgent("FRESH", "MARK_FRESH_1", fork=False)
SUBAGENTS = (FORK, FRESH)


def subagent_final_text(agent: SubAgent, saw: bool) -> str:
    return f"SUBRESULT-{agent.tag}: " + (f"saw SUB-{agent.tag}" if saw else "no output")


def main_final_text(reported: list[str]) -> str:
    return "MAIN-FINAL: results from " + (", ".join(reported) or "none yet")


@dataclass(frozen=True)
class RenderedTurn:
    role: str
    text: str

    @property
    def results(self) -> list[str]:
        """The tool results this turn holds (the template puts them in user turns)."""
        return _TOOL_RESPONSES.findall(self.text)

    @property
    def said(self) -> str:
        """The turn's text less its tool results: what its author wrote."""
        return _TOOL_RESPONSES.sub("", self.text)


_TURN = re.compile(r"<\|im_start\|>([a-z_]+)\n(.*?)(?:<\|im_end\|>|\Z)", re.DOTALL)
_TOOL_RESPONSES = re.compile(r"\n?<tool_response>\n(.*?)\n</tool_response>", re.DOTALL)
_TOOL_CALLS = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.DOTALL)
_NOTIFICATIONS = ("<task-notification>", "<subagent_notification>")


def rendered_turns(conversation: str) -> list[RenderedTurn]:
    """The turns of a rendered ChatML conversation (after the system turn's tools section)."""
    return [RenderedTurn(role, text) for role, text in _TURN.findall(conversation)]


def _calls(turn: RenderedTurn) -> list[dict[str, Any]]:
    calls = []
    for block in _TOOL_CALLS.findall(turn.text):
        try:
            call = json.loads(block)
        except ValueError:
            continue
        if isinstance(call, dict):
            calls.append(call)
    return calls


def _own_agent(turns: list[RenderedTurn]) -> tuple[SubAgent, int] | None:
    """The sub-agent whose task is the newest marker-bearing turn, and that turn's index: a fork
    carries its parent's history, so only its own task can be newer than the rest."""
    found = None
    for index, turn in enumerate(turns):
        if turn.role == "assistant" or any(tag in turn.text for tag in _NOTIFICATIONS):
            continue
        for agent in SUBAGENTS:
            if agent.marker in turn.said:
                found = (agent, index)
    return found


def subagent_step(conversation: str, tools: dict[str, dict[str, Any]]) -> tuple[str, str] | None:
    """(role, text) of the sub-agent script's next call, or None: not a sub-agent session.

    ``tools``: the offered tools' parameter schemas by name. The text is either a final text or
    hermes tool calls. A fresh sub-agent's first and second calls:

    >>> task = f"<|im_start|>user\\n{FRESH.task}<|im_end|>\\n<|im_start|>assistant\\n"
    >>> print(subagent_step(task, {"Bash": {}})[1])
    <tool_call>
    {"name": "Bash", "arguments": {"command": "echo SUB-FRESH", "description": "Echo a tag"}}
    </tool_call>
    >>> ran = "<|im_start|>user\\n<tool_response>\\nSUB-FRESH\\n</tool_response><|im_end|>\\n"
    >>> subagent_step(task + "<tool_call>...</tool_call><|im_end|>\\n" + ran, {"Bash": {}})
    ('FRESH', 'SUBRESULT-FRESH: saw SUB-FRESH')
    """
    turns = rendered_turns(conversation)
    own = _own_agent(turns)
    if own is not None:
        agent, index = own
        results = [result for turn in turns[index + 1 :] for result in turn.results]
        if results:
            return agent.tag, subagent_final_text(agent, f"SUB-{agent.tag}" in results[-1])
        return agent.tag, _call_text([_shell_call(tools, agent.command)])
    users = [turn.said for turn in turns if turn.role == "user"]
    if not any(SUBAGENT_PROMPT in said for said in users):
        return None
    spawn = _tool_named(tools, "spawn_agent")
    calls = [call for turn in turns if turn.role == "assistant" for call in _calls(turn)]
    spawned = [call for call in calls if call.get("name") in ("Agent", spawn)]
    reported = [agent.tag for agent in SUBAGENTS if _reported(turns, agent)]
    if not spawned:
        if "Agent" in tools:
            return "main", _call_text([_claude_spawn(agent) for agent in SUBAGENTS])
        if spawn is not None:
            spawns = [_codex_spawn(spawn, tools[spawn], agent) for agent in SUBAGENTS]
            return "main", _call_text(spawns)
        return "main", "MAIN: no spawn tool offered"
    wait = _tool_named(tools, "wait_agent")
    waits = sum(call.get("name") == wait for call in calls)
    if wait is not None and len(reported) < len(SUBAGENTS) and waits < WAIT_MAX:
        return "main", _call_text([_codex_wait(wait, tools[wait], turns)])
    return "main", main_final_text(reported)


def _reported(turns: list[RenderedTurn], agent: SubAgent) -> bool:
    """Whether the agent's final text came back to the main agent (a Claude Code notification,
    a Codex wait_agent result, notification or v2 agent_message)."""
    prefix = f"SUBRESULT-{agent.tag}:"
    return any(prefix in turn.text for turn in turns if turn.role != "assistant")


def _tool_named(tools: dict[str, dict[str, Any]], name: str) -> str | None:
    """The offered tool of that name, bare or flattened from a namespace (``ns__name``)."""
    for offered in sorted(tools):
        if offered == name or offered.endswith(f"__{name}"):
            return offered
    return None


def _properties(schema: dict[str, Any]) -> dict[str, Any]:
    properties = schema.get("properties")
    return properties if isinstance(properties, dict) else {}


def _call_text(calls: list[tuple[str, dict[str, Any]]]) -> str:
    blocks = [json.dumps({"name": name, "arguments": arguments}) for name, arguments in calls]
    return "\n".join(f"<tool_call>\n{block}\n</tool_call>" for block in blocks)


def _shell_call(tools: dict[str, dict[str, Any]], command: str) -> tuple[str, dict[str, Any]]:
    if "Bash" in tools:
        return "Bash", {"command": command, "description": "Echo a tag"}
    if "shell_command" in tools:
        return "shell_command", {"command": command}
    if "exec_command" in tools:
        return "exec_command", {"cmd": command}
    return "shell", {"command": ["bash", "-lc", command]}


def _claude_spawn(agent: SubAgent) -> tuple[str, dict[str, Any]]:
    kind = "fork" if agent.fork else "general-purpose"
    arguments = {"description": f"Task {agent.tag}", "prompt": agent.task, "subagent_type": kind}
    return "Agent", arguments


def _codex_spawn(name: str, schema: dict[str, Any], agent: SubAgent) -> tuple[str, dict[str, Any]]:
    properties = _properties(schema)
    arguments: dict[str, Any] = {}
    if "task_name" in properties:
        arguments["task_name"] = agent.tag.lower()
    if "message" in properties or "items" not in properties:
        arguments["message"] = agent.task
    else:
        arguments["items"] = [{"type": "text", "text": agent.task}]
    if "fork_context" in properties:
        arguments["fork_context"] = agent.fork
    if "fork_turns" in properties:
        arguments["fork_turns"] = "all" if agent.fork else "none"
    return name, arguments


_AGENT_ID = re.compile(r'"agent_id"\s*:\s*"([^"]+)"')


def _codex_wait(
    name: str, schema: dict[str, Any], turns: list[RenderedTurn]
) -> tuple[str, dict[str, Any]]:
    """wait_agent on the spawned agents not yet reported (v1 names them by the ``agent_id`` its
    spawn_agent results gave; v2 waits on all)."""
    properties = _properties(schema)
    arguments: dict[str, Any] = {}
    if "targets" in properties:
        results = "\n".join(result for turn in turns for result in turn.results)
        spawned = list(dict.fromkeys(_AGENT_ID.findall(results)))
        done = {
            agent_id
            for agent_id in spawned
            for turn in turns
            if turn.role != "assistant"
            if re.search(re.escape(agent_id) + r'"\s*:\s*\{\s*"completed"', turn.text)
            or re.search(r'"agent_path"\s*:\s*"' + re.escape(agent_id), turn.text)
        }
        arguments["targets"] = [agent_id for agent_id in spawned if agent_id not in done] or spawned
    if "timeout_ms" in properties:
        arguments["timeout_ms"] = 30000
    return name, arguments
