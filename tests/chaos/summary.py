"""The soak's verdict: a table of faults, a table of counts, and the one-line JSON summary."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from tests.chaos.audit import Report, examples
from tests.chaos.record import SoakRecord
from tests.chaos.targets import PROXY_STATS, Fault


def read_proxy_stats(data_dir: Path) -> dict[str, Any]:
    """What the round-robin proxy counted ({} without one): connections per gateway."""
    path = data_dir / PROXY_STATS
    stats: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    return stats


def summarize(
    record: SoakRecord, report: Report, settled: bool, proxy: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The JSON the soak prints last: the issue's six keys, the two of gateways sharing the log
    and the three of weight updates mid-turn first, then the detail."""
    sink = report.sink
    assert sink is not None
    versions = report.versions
    return {
        "faults": len(record.faults),
        "sessions": report.sessions,
        "turns": report.turns,
        "lost": report.lost,
        "duplicated": report.duplicated,
        "redelivered_after_commit": sink.redelivered_after_commit,
        "continuations_retokenized": len(report.retokenized),
        "turns_served_after_close": len(report.served_after_close),
        "version_spans_bad": len(versions.bad),
        "unknown_version_tokens": versions.unknown_tokens,
        "continued_turns": versions.continued,
        "version_logprobs_bad": len(versions.logprobs_bad),
        "max_tokens_bad": len(versions.max_tokens_bad),
        "seed": record.seed,
        "duration_s": record.duration_s,
        "agents": record.agents,
        "gateways": record.gateways,
        "faults_by_target": dict(sorted(Counter(f.target for f in record.faults).items())),
        "faults_by_action": dict(sorted(Counter(f.action for f in record.faults).items())),
        "faults_by_action_and_target": {
            action: dict(sorted(Counter(f.target for f in mine).items()))
            for action, mine in _by_action(record).items()
        },
        "policy_updates": len(record.updates),
        "policy_updates_by_mode": dict(sorted(Counter(u.mode for u in record.updates).items())),
        "continuations": versions.continuations,  # resubmissions, in the continued turns
        "multi_version_turns": versions.multi_version,  # continued, or switched ("keep")
        "stored_turns": versions.turns,
        "interrupted_turns_scored": versions.scored,  # their log-probs, against each version
        "max_logprob_delta": versions.max_logprob_delta,
        "lost_completions": len(report.lost_completions),
        "lost_sessions": len(report.lost_sessions),
        "unclosed_sessions": len(report.unclosed),
        "uncommitted": len(sink.never_committed),
        "closed": report.outcomes["closed"],
        "reaped": report.reaped,
        "left_open": report.outcomes["left_open"] + report.outcomes["gave_up"],
        "refused": report.outcomes["refused"],  # an unexpected 4xx ended the agent's session
        "late_turns": len(report.late_turns),
        "closes_overridden": len(report.closes_overridden),
        "log_sessions": report.log_sessions,
        "trajectories": report.trajectories,
        "traj_messages": sink.traj_messages,
        "traj_duplicate_ids": sink.traj_duplicate_ids,
        "sink_deliveries": sink.delivered,
        "batches_committed": sink.batches_committed,
        "redelivered_after_commit_nats_crash": sink.redelivered_after_commit_nats_crash,
        "redelivered_before_commit": sink.redelivered_before_commit,
        "commit_unconfirmed": sink.commit_unconfirmed,
        "unexpected_exits": dict(sorted(Counter(e.target for e in record.exits).items())),
        "dead_letters": report.dead_letters,
        "untrusted_events": dict(sorted(report.untrusted.items())),
        "proxy": proxy or {},
        "gateway_counters": record.gateway_counters,  # lower bounds: see gateway_counters.py
        "settled": settled,
    }


def _by_action(record: SoakRecord) -> dict[str, list[Fault]]:
    by: dict[str, list[Fault]] = {}
    for fault in record.faults:
        by.setdefault(fault.action, []).append(fault)
    return dict(sorted(by.items()))


def print_tables(record: SoakRecord, report: Report, summary: dict[str, Any]) -> None:
    console = Console(file=sys.stdout, width=110)
    faults = Table(title="faults: SIGKILL then a restart, SIGSTOP then SIGCONT, disk full, slow")
    columns = ("target", "fault", "count", "planned s", "back after s", "exited on its own")
    for column in columns:
        faults.add_column(column, justify="right")
    exits = Counter(e.target for e in record.exits)
    played = {(f.target, f.action) for f in record.faults}
    for target, action in sorted(played | {(t, "kill") for t in exits}):
        mine = [f for f in record.faults if f.target == target and f.action == action]
        back = [f.back_after_s for f in mine if f.back_after_s is not None]
        faults.add_row(
            target,
            action,
            str(len(mine)),
            f"{sum(f.downtime_s for f in mine) / max(len(mine), 1):.1f}",
            f"{sum(back) / max(len(back), 1):.1f}",
            str(exits[target]) if action == "kill" else "",
        )
    console.print(faults)
    counts = Table(title="counts")
    counts.add_column("what")
    counts.add_column("count", justify="right")
    for key, value in summary.items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            counts.add_row(key, f"{value:g}" if isinstance(value, float) else str(value))
    for mode, n in summary["policy_updates_by_mode"].items():
        counts.add_row(f"policy updates: {mode}", str(n))
    for outcome, n in sorted(report.outcomes.items()):
        counts.add_row(f"agent sessions: {outcome}", str(n))
    for subject, n in report.dead_letters.items():
        counts.add_row(f"dead letters: {subject}", str(n))
    for backend, n in summary["proxy"].get("connections", {}).items():
        counts.add_row(f"proxy connections to {backend}", str(n))
    for name, n in record.gateway_counters.items():
        counts.add_row(f"gateways: {name}", str(n))
    console.print(counts)
    never = report.sink.never_committed if report.sink else []
    for line in [
        *examples(report.lost_completions),
        *examples(report.lost_sessions),
        *examples(report.unclosed),
        *(f"TRAJ seq {seq}: never committed by the sink" for seq in never[:5]),
        *examples(report.retokenized),
        *examples(report.served_after_close),
        *examples(report.versions.bad),
        *examples(report.versions.logprobs_bad),
        *examples(report.versions.max_tokens_bad),
    ]:
        console.print(line, style="red", markup=False, highlight=False)
    for line in [*examples(report.late_turns), *examples(report.closes_overridden)]:
        console.print(line, style="yellow", markup=False, highlight=False)
    for exit_ in record.exits[:5]:
        console.print(
            f"{exit_.target} (pid {exit_.pid}) exited with {exit_.code} at {exit_.at_s:.0f}s; "
            f"its log ends:\n{exit_.log_tail[-600:]}",
            markup=False,
            highlight=False,
        )
