"""What a session with sub-agents must have left in the log and the shards (issue 35, point 5).

Three witnesses, none of them the gateway: the CLI's own requests as a recording proxy saw them
(``CuttingProxy(cut_at=0)``: the agent ids in their headers), the scripted backend's record of
what it served (prompt and reply ids, the script's role, arrival and answer times), and the
CLI's output. Against them, what the gateway recorded: the session's events
(``TurnCompleted.agent``) and its shard rows (trajectory metadata ``agent``, ``parent_agent``,
``agent_kind``, ``agent_type``, ``request_class``, ``side``, ``client_gone``).

Every check runs and reports: ``Checks`` collects the failures and the test fails once, naming
all of them, so a run shows at a glance which parts hold (a gateway without concurrent turns
fails only the overlap; one without client identity only the attribution).
"""

from __future__ import annotations

import json
import traceback
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gateway.core.agents import MAIN_AGENT
from schemas import SessionEvent, TurnCompleted
from tests.agents.cutting_proxy import SeenRequest
from tests.agents.subagent_script import FORK, FRESH, SUBAGENTS, SubAgent, main_final_text

__all__ = ["Checks", "CliAgent", "SubagentSession", "cli_agents", "row_turns"]


@dataclass
class Checks:
    """Named checks that all run; ``assert_all`` fails with every failure at once."""

    failures: list[str] = field(default_factory=list)
    passed: list[str] = field(default_factory=list)

    @contextmanager
    def check(self, name: str) -> Iterator[None]:
        try:
            yield
        except Exception as exc:  # a check that cannot even run (a missing key) fails too
            where = traceback.extract_tb(exc.__traceback__)[-1]
            said = str(exc) if isinstance(exc, AssertionError) else repr(exc)
            said = said or "assertion failed"
            said = said if len(said) <= 2000 else said[:2000] + " ..."
            self.failures.append(f"{name}: {said} (line {where.lineno})")
        else:
            self.passed.append(name)

    def assert_all(self) -> None:
        assert not self.failures, (
            f"{len(self.failures)} of {len(self.failures) + len(self.passed)} checks failed:\n- "
            + "\n- ".join(self.failures)
            + "\npassed: "
            + ", ".join(self.passed)
        )


@dataclass(frozen=True)
class CliAgent:
    """One agent conversation as the CLI named it in its request headers."""

    key: str  # Claude Code's agent id (MAIN_AGENT when absent), Codex's thread-id
    parent: str | None
    requests: tuple[SeenRequest, ...]
    script: SubAgent | None  # the sub-agent its task names; None: the main agent

    @property
    def headers(self) -> dict[str, str]:
        return self.requests[0].headers


def _task_markers(body: dict[str, Any]) -> set[str]:
    """The sub-agent markers in a request body, outside what the model wrote (assistant
    messages, function calls): the task the agent was given, if it is a sub-agent."""
    items = body.get("messages") or body.get("input") or []
    written = [
        item
        for item in items
        if isinstance(item, dict)
        and item.get("role") != "assistant"
        and item.get("type") not in ("function_call", "custom_tool_call")
    ]
    text = json.dumps(written)
    return {agent.marker for agent in SUBAGENTS if agent.marker in text}


def cli_agents(requests: Sequence[SeenRequest], cli: str) -> dict[str, CliAgent]:
    """The CLI's agents by key, from its model requests' headers (``cli``: claude_code, codex)."""
    grouped: dict[str, list[SeenRequest]] = {}
    parents: dict[str, str | None] = {}
    for request in requests:
        headers = request.headers
        if cli == "claude_code":
            key = headers.get("x-claude-code-agent-id") or MAIN_AGENT
            parent = headers.get("x-claude-code-parent-agent-id") or (
                MAIN_AGENT if key != MAIN_AGENT else None
            )
        else:
            key = headers["thread-id"]
            parent = headers.get("x-codex-parent-thread-id")
        grouped.setdefault(key, []).append(request)
        parents[key] = parent
    agents = {}
    for key, seen in grouped.items():
        markers = _task_markers(json.loads(seen[0].body))
        assert len(markers) <= 1, f"agent {key}'s first request names tasks {markers}"
        script = next((a for a in SUBAGENTS if a.marker in markers), None)
        agents[key] = CliAgent(key, parents[key], tuple(seen), script)
    return agents


def row_turns(row: dict[str, Any]) -> list[tuple[list[int], list[int], list[float]]]:
    """(prompt, completion, completion log-probs) of each turn of a shard row: a turn's
    completion is the run of trained tokens that ends at its turn end."""
    ids, mask, logprobs = row["input_ids"], row["loss_mask"], row["logprobs"]
    turns = []
    for end in row["turn_ends"]:
        start = end
        while start > 0 and mask[start - 1] == 1:
            start -= 1
        turns.append((list(ids[:start]), list(ids[start:end]), list(logprobs[start:end])))
    return turns


@dataclass
class SubagentSession:
    """One CLI run with sub-agents: what the witnesses saw and what was recorded."""

    cli: str  # claude_code or codex
    agents: dict[str, CliAgent]
    served: list[dict[str, Any]]  # the backend's records of this session's requests
    events: list[SessionEvent]
    rows: list[dict[str, Any]]
    # Codex ``exec`` exits when the root's turn ends and may abandon a sub-agent mid-request:
    # its turn is then recorded with ``client_gone`` (issue 35, point 4), not an error.
    subagents_may_be_cut: bool = False
    checks: Checks = field(default_factory=Checks)

    @property
    def turns(self) -> list[TurnCompleted]:
        return sorted((e for e in self.events if isinstance(e, TurnCompleted)), key=_turn)

    @property
    def main(self) -> CliAgent:
        [main] = [agent for agent in self.agents.values() if agent.script is None]
        return main

    def by_script(self, agent: SubAgent) -> CliAgent:
        [found] = [a for a in self.agents.values() if a.script is agent]
        return found

    def metadata(self, row: dict[str, Any]) -> dict[str, Any]:
        found = json.loads(row["metadata"])
        assert isinstance(found, dict)
        return found

    def agent_rows(self) -> list[dict[str, Any]]:
        return [row for row in self.rows if not self.metadata(row).get("side")]

    def row_of(self, agent: CliAgent) -> dict[str, Any]:
        rows = [r for r in self.rows if self.metadata(r).get("agent_id") == agent.key]
        assert len(rows) == 1, f"{len(rows)} rows name agent {agent.key}"
        return rows[0]

    # -- the checks ---------------------------------------------------------------------------

    def check_script_ran(self) -> None:
        """The CLI spawned both sub-agents from one message, each ran its command and reported,
        and the main agent's last answer names both results."""
        roles = Counter(call["role"] for call in self.served)
        assert roles[FORK.tag] >= 2 and roles[FRESH.tag] >= 2, roles
        main = [c["reply"] for c in self.served if c["role"] == "main"]
        spawns = [reply for reply in main if "spawn_agent" in reply or '"Agent"' in reply]
        assert len(spawns) == 1 and spawns[0].count("<tool_call>") == 2, main
        for agent in SUBAGENTS:
            finals = [c["reply"] for c in self.served if c["role"] == agent.tag]
            assert f"SUBRESULT-{agent.tag}: saw SUB-{agent.tag}" in finals, finals
        assert main[-1] == main_final_text([a.tag for a in SUBAGENTS]), main
        scripts = {key: a.script and a.script.tag for key, a in self.agents.items()}
        assert set(scripts.values()) == {None, FORK.tag, FRESH.tag}, scripts

    def check_tokens(self) -> None:
        """Every served request is exactly one turn of one row of the session: its prompt ids,
        its reply ids (trained) and their log-probs, token for token; nothing else is."""
        served = Counter(
            (tuple(call["prompt_ids"]), tuple(call["completion_ids"])) for call in self.served
        )
        logprobs = {
            (tuple(c["prompt_ids"]), tuple(c["completion_ids"])): c["logprobs"] for c in self.served
        }
        recorded: Counter[tuple[tuple[int, ...], tuple[int, ...]]] = Counter()
        for row in self.agent_rows():
            for prompt, completion, recorded_logprobs in row_turns(row):
                key = (tuple(prompt), tuple(completion))
                recorded[key] += 1
                if key in logprobs:
                    np.testing.assert_allclose(
                        recorded_logprobs, logprobs[key], rtol=1e-5, atol=1e-5
                    )
        missing, extra = served - recorded, recorded - served
        assert not missing and not extra, (
            f"{sum(missing.values())} served requests are no recorded turn, "
            f"{sum(extra.values())} recorded turns were not served as such "
            f"(of {len(self.served)} served)"
        )

    def check_fork_prompt_untrained(self) -> None:
        """The fork's first prompt (the CLI's copy of its parent's history, Claude Code's
        rewritten spawn message included) is prompt: loss mask 0 over all of it."""
        first = min((c for c in self.served if c["role"] == FORK.tag), key=lambda c: c["arrived"])
        prompt = first["prompt_ids"]
        rows = [
            r
            for r in self.agent_rows()
            if len(r["input_ids"]) > len(prompt) and r["input_ids"][: len(prompt)] == prompt
        ]
        assert rows, "no row starts with the fork's first prompt"
        for row in rows:
            assert sum(row["loss_mask"][: len(prompt)]) == 0, (
                f"{sum(row['loss_mask'][: len(prompt)])} tokens of the fork's first prompt "
                f"are trained in {row['trajectory_id']}"
            )

    def check_one_row_per_agent(self) -> None:
        """One trajectory per agent conversation, named by the CLI's own id; nothing else in
        the shards but labelled side calls."""
        named = Counter(self.metadata(r).get("agent_id") for r in self.agent_rows())
        assert named == Counter(self.agents.keys()), (
            f"rows by agent {dict(named)}, CLI sent {list(self.agents)}"
        )
        for agent in self.agents.values():
            row = self.row_of(agent)
            assert row["num_turns"] == len(agent.requests), (
                f"{agent.key}: {row['num_turns']} turns, {len(agent.requests)} requests"
            )
            if agent.script is not None:
                assert agent.script.marker in row["messages"], f"{agent.key}'s task is not its own"
        for row in self.rows:
            meta = self.metadata(row)
            assert meta.get("side") or meta.get("agent_id") in self.agents, meta

    def check_row_identity(self) -> None:
        """Each row's parent and kind as the CLI said and the tokens agree."""
        for agent in self.agents.values():
            meta = self.metadata(self.row_of(agent))
            if agent.script is None:
                assert not meta.get("parent_agent"), meta
                assert meta.get("agent_kind", "main") == "main", meta
                continue
            assert meta.get("parent_agent") == self.main.key, meta
            kind = "fork" if agent.script.fork else "fresh"
            assert meta.get("agent_kind") == kind, (agent.script.tag, meta)

    def check_events_attributed(self) -> None:
        """Every turn records the agent id its request carried (as many turns per agent as
        requests), its first turn resolved by the tokens as the CLI said, no mismatch."""
        recorded = Counter(turn.agent.get("id") for turn in self.turns)
        sent = Counter({key: len(agent.requests) for key, agent in self.agents.items()})
        assert recorded == sent, f"turns by agent {dict(recorded)}, requests {dict(sent)}"
        for agent in self.agents.values():
            mine = [t for t in self.turns if t.agent.get("id") == agent.key]
            expected = "main" if agent.script is None else "fork" if agent.script.fork else "fresh"
            assert mine[0].agent.get("resolved_kind") == expected, (agent.key, mine[0].agent)
            mismatched = [t.agent for t in mine if t.agent.get("mismatch")]
            assert not mismatched, mismatched

    def check_subagents_overlap(self) -> None:
        """The two sub-agents were in flight at the backend together: one's request arrived
        before the other's was answered, and the other way round (no session-wide lock)."""
        forks = [c for c in self.served if c["role"] == FORK.tag]
        freshes = [c for c in self.served if c["role"] == FRESH.tag]
        overlapping = [
            (a, b)
            for a in forks
            for b in freshes
            if a["arrived"] < b["answered"] and b["arrived"] < a["answered"]
        ]
        assert overlapping, "no fork request was in flight with a fresh one: " + ", ".join(
            f"{c['role']} {c['arrived'] % 1000:.2f}-{c['answered'] % 1000:.2f}"
            for c in sorted(forks + freshes, key=lambda c: c["arrived"])
        )

    def check_client_stayed(self) -> None:
        """No turn recorded as answered to a client that went away, but a sub-agent's where the
        CLI is documented to abandon them."""
        allowed = {
            key
            for key, agent in self.agents.items()
            if self.subagents_may_be_cut and agent.script is not None
        }
        gone = [t.agent.get("id") for t in self.turns if t.client_gone]
        assert set(gone) <= allowed, f"turns of {gone} recorded with client_gone"
        for row in self.rows:
            meta = self.metadata(row)
            assert not meta.get("client_gone") or meta.get("agent_id") in allowed, meta

    def run_all(self, *extra: tuple[str, Callable[[], None]]) -> Checks:
        checks = self.checks
        for name, check in (
            ("script ran", self.check_script_ran),
            ("token-exact", self.check_tokens),
            ("fork prompt untrained", self.check_fork_prompt_untrained),
            ("one row per agent", self.check_one_row_per_agent),
            ("row identity", self.check_row_identity),
            ("turns attributed", self.check_events_attributed),
            ("sub-agents overlap", self.check_subagents_overlap),
            ("client stayed", self.check_client_stayed),
            *extra,
        ):
            with checks.check(name):
                check()
        return checks


def _turn(event: TurnCompleted) -> int:
    return event.turn
